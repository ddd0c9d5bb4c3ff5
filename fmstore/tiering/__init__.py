"""When and where copies go, one concept per subpackage: :mod:`.copy` (the copy engine and
its resume journal), :mod:`.staging` (dataset staging, eager and lazy), :mod:`.inventory`
(what each tier holds: the catalog and its rebuild from the tiers), :mod:`.policy` (export,
retention and release rules and the runner that applies them), :mod:`.exports` (whole
checkpoints and node parts carried between tiers), :mod:`.service` (the daemon and the
policy helper that run the policies), :mod:`.managers` (the checkpoint managers a training
loop uses).  Here directly: the configured tiers (:mod:`.tiers`), their probe and
credentials, and the metrics every part counts into."""
