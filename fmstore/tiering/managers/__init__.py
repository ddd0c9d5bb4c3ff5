"""The checkpoint managers a training loop uses: single-node (:mod:`.manager`) and
sharded across ranks and nodes (:mod:`.sharded`); the steps a restore fell back from moved
out of the way of their redo (:mod:`.redo`; where they lie: :mod:`~fmstore.tiering.inventory.aside`); the read-through cache of a lazy
restore (:mod:`.cache`)."""
