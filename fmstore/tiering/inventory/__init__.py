"""What each tier holds: the catalog (:mod:`.catalog`, its schema :mod:`.catalog_schema`),
its rebuild from the tiers (:mod:`.discovery`), the checkpoints fmstore does not count
(:mod:`.foreign`), the steps a restore moved aside (:mod:`.aside`), and what a deletion by
hand does to the catalog (:mod:`.removal`)."""
