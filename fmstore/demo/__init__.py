"""The demo: a small GPT trained on CPU with fmstore doing all the storage work.

``python -m fmstore.demo`` (what ``make demo`` runs) starts a SeaweedFS as the S3 tier, writes
a text corpus as fmstore shards and stages it to S3, runs the tiering daemon, trains while
``StreamingDataset`` streams from S3 and ``CheckpointManager`` checkpoints to nvme (the daemon
exports to lustre and S3), then prints a summary and writes a PNG.  ``--crash`` also kills a
second run with SIGKILL at a random step, restarts it (``--wipe-nvme``: on an empty nvme, as
on a replaced node; ``--lose-lustre``: its lustre copies lost too, so it resumes from S3) and
checks its final weights against the uninterrupted run, bit for bit.
"""
