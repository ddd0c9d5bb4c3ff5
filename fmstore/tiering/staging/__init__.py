"""Dataset staging between any two locations: planned then copied by the copy engine
(:mod:`.stage`), one stage per destination at a time (:mod:`.stagelock`), and lazy staging
(:mod:`.lazy`, its hostile-input index :mod:`.lazy_index`).  Knows nothing of policies or
managers."""
