"""One rank of a two-node save onto a tier each node has its own copy of (its own
directory) but whose ``scope = "node"`` was forgotten.  Rank 0 prints the error it met.

Run as ``python scope_hint_worker.py RANK PORT BASE``."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

RANK, PORT, BASE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = os.path.join(BASE, f"n{RANK}.toml")
with open(cfg, "w") as f:
    f.write(f'state_dir = "{BASE}/state{RANK}"\n[tiers.nvme]\nurl = "{BASE}/nvme{RANK}"\n')
os.environ["FMSTORE_CONFIG"] = cfg
os.environ["FMSTORE_NODE_ID"] = f"n{RANK}"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fmstore.checkpoint import dcp  # noqa: E402

dist.init_process_group(
    "gloo",
    init_method=f"tcp://127.0.0.1:{PORT}",
    rank=RANK,
    world_size=2,
    timeout=timedelta(seconds=60),
)
try:
    dcp.save({f"w{RANK}": torch.arange(10) + RANK}, "nvme:run/step_000000000001")
    error = ""
except BaseException as e:  # DCP raises its CheckpointException, a BaseException
    error = str(e)
if RANK == 0:
    print("RESULT", json.dumps({"error": error}), flush=True)
dist.destroy_process_group()
