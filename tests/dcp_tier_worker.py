"""Run under ``torchrun --nproc-per-node=2`` by tests/test_tiering_dcp.py (gloo, CPU).

``python -m torch.distributed.run --nproc-per-node=2 tests/dcp_tier_worker.py ROOT STEP...``

Both ranks save one DCP checkpoint per STEP through fmstore's ``Writer`` to
``ROOT/step_SSSSSSSSSSSS`` (a tier location such as ``nvme:runs/d``, resolved with the
``FMSTORE_CONFIG`` of the environment).  The state holds tensors replicated on both ranks
(DCP writes each on one rank only, spread over both) and one rank-local tensor per rank, so
every rank writes blobs of its own.  :func:`expected` gives the values pytest checks.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fmstore.checkpoint.dcp import Writer  # noqa: E402

warnings.filterwarnings("ignore")


def expected(step: int, world: int = 2) -> dict[str, Any]:
    """The state saved at ``step``, as one process sees it after the save."""
    g = torch.Generator().manual_seed(step)
    out: dict[str, Any] = {
        "model.w": torch.randn(64, 96, generator=g),
        "model.b": torch.randn(33, generator=g).bfloat16(),
        "optim.m": torch.randn(4000, generator=g),
        "step": step,
    }
    for r in range(world):
        out[f"rank{r}.rng"] = torch.full((17,), float(step * 10 + r))
    return out


def main() -> None:
    root, steps = sys.argv[1], [int(s) for s in sys.argv[2:]]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in steps:
        full = expected(step, dist.get_world_size())
        sd = {k: v for k, v in full.items() if not k.startswith("rank")}
        sd[f"rank{rank}.rng"] = full[f"rank{rank}.rng"]
        dcp.save(sd, storage_writer=Writer(f"{root}/step_{step:012d}"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
