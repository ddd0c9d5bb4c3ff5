"""The policies: their rules parsed from ``[policies]`` (:mod:`.rules`), the objects and pure
decisions (:mod:`.policies`), the runner that carries them out one idempotent step at a
time (:mod:`.runner`), failures said loudly (:mod:`.failures`), per-tier back-off
(:mod:`.backoff`) and the sweep of what dead writers left (:mod:`.sweep`)."""
