"""Run under ``torchrun --nproc_per_node=N`` by tests/test_loader_ranks.py (gloo, CPU).

``python -m torch.distributed.run --nproc_per_node=4 tests/loader_rank_worker.py CFG``

``CFG`` is JSON: ``remote`` (an ``s3://`` dataset), ``cache`` (the node cache every rank
shares), ``out``, ``workers``, ``batch``, ``limit`` (the cache limit, or null), ``direct_reads``,
``lockstep`` (ranks meet after every batch, as DDP's gradient all-reduce makes them; else
each runs free), ``stagger`` (rank ``r > 0`` starts an epoch only once rank ``r - 1`` has
taken that many batches: ranks far apart, as after a slow start) and ``epochs``: the store
options of each epoch in turn.  Every rank streams epoch ``e``
through a ``StreamingDataLoader`` whose store talks to ``epochs[e]``'s endpoint (the test
gives each epoch its own proxy, so it can count each epoch's requests apart), writes the
sample ids it got to ``OUT/e{e}-r{rank}.json`` and waits for every rank at a barrier
before the next epoch starts.  ``CFG`` may also be a list of such objects: they run one after
the other in the same launch (tests share one start of the ranks).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fmstore.loaders import StreamingDataLoader, StreamingDataset  # noqa: E402

warnings.filterwarnings("ignore")


def sample_id(sample: dict) -> int:
    return int(sample["i"])


def go_file(out: str, epoch: int, rank: int) -> str:
    return os.path.join(out, f"e{epoch}-go-r{rank}")


def main() -> None:
    cfgs = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    for cfg in cfgs if isinstance(cfgs, list) else [cfgs]:
        run(cfg, dist.get_rank())
    dist.destroy_process_group()


def run(cfg: dict, rank: int) -> None:
    for epoch, opts in enumerate(cfg["epochs"]):
        ds = StreamingDataset(
            cfg["remote"],
            cfg["cache"],
            batch_size=cfg["batch"],
            storage_options=opts,
            cache_limit=cfg["limit"],
            direct_reads=cfg["direct_reads"],
            transform=sample_id,
        )
        ds.set_epoch(epoch)
        dl = StreamingDataLoader(ds, batch_size=cfg["batch"], num_workers=cfg["workers"])
        stagger = cfg.get("stagger", 0)
        if stagger and rank > 0:
            while not os.path.exists(go_file(cfg["out"], epoch, rank)):
                time.sleep(0.01)  # until rank - 1 is far enough ahead
        got: list[int] = []
        for k, b in enumerate(dl):
            got.extend(int(x) for x in b)
            if cfg["lockstep"]:
                dist.all_reduce(torch.zeros(1))
            if stagger and k + 1 == stagger:
                open(go_file(cfg["out"], epoch, rank + 1), "w").close()
        if stagger:
            open(go_file(cfg["out"], epoch, rank + 1), "w").close()
        with open(os.path.join(cfg["out"], f"e{epoch}-r{rank}.json"), "w") as f:
            json.dump(got, f)
        dist.barrier()


if __name__ == "__main__":
    main()
