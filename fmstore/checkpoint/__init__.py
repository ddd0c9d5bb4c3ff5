"""What a checkpoint is: single-process save / load, and multi-rank checkpoints through
``torch.distributed.checkpoint`` (:mod:`fmstore.checkpoint.dcp`)."""
