"""The two ranks of a gloo group, each its own node (``n0``, ``n1``) with its own directory
for the ``nvme`` tier, whose ``scope = "node"`` was forgotten; rank 0 prints, as JSON, what
fmstore made of each case (one pair of processes for them all: starting one costs seconds).

1. ``save``: a two-node save onto that tier (the coordinator misses rank 1's blob).
2. ``recv``, ``gather``, ``broadcast``, ``stream``: rank 1 turns hostile and announces
   2**40 bytes to a replica transfer, a gather, a broadcast and a replica streamed while
   saving, while rank 0's address space is capped.

Run as ``python two_rank_worker.py RANK PORT BASE``."""

from __future__ import annotations

import json
import os
import resource
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

from fmstore import runtime  # noqa: E402
from fmstore.checkpoint import dcp  # noqa: E402
from fmstore.checkpoint.dcp import replicas  # noqa: E402
from fmstore.checkpoint.dcp.replica_stream import Stream  # noqa: E402
from fmstore.errors import FmstoreError  # noqa: E402
from fmstore.protocol.wire import broadcast_result, gather_json  # noqa: E402
from fmstore.stores import open_store  # noqa: E402


def hostile_sizes(pg: object) -> dict[str, str]:
    out: dict[str, str] = {}
    if RANK == 1:
        dist.send(torch.tensor([1, 1 << 40], dtype=torch.int64), 0, group=pg)
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(lens, torch.tensor([1 << 40], dtype=torch.int64), group=pg)
        dist.broadcast(torch.tensor([1, 1 << 40], dtype=torch.int64), group=pg, group_src=1)
        return out
    # 2 GiB more address space than now: a 2**40-byte allocation would fail loudly
    with open("/proc/self/status") as f:
        vm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
    out["recv"] = str(replicas._recv(pg, 1, [5]))
    for name, call in (
        ("gather", lambda: gather_json(pg, "fine")),
        ("broadcast", lambda: broadcast_result(pg, 1, None, limit=1 << 20)),
    ):
        try:
            call()
            out[name] = "accepted"
        except FmstoreError as e:
            out[name] = f"FmstoreError: {e}"
    return out


dist.init_process_group(
    "gloo",
    init_method=f"tcp://127.0.0.1:{PORT}",
    rank=RANK,
    world_size=2,
    timeout=timedelta(seconds=60),
)
try:
    dcp.save({f"w{RANK}": torch.arange(10) + RANK}, "nvme:run/step_000000000001")
    result = {"save": ""}
except BaseException as e:  # DCP raises its CheckpointException, a BaseException
    result = {"save": str(e)}
result.update(hostile_sizes(dist.group.WORLD))


def hostile_stream(pg: object) -> str:
    """Rank 1 announces a 2**40-byte chunk to rank 0's replica stream: refused."""
    if RANK == 1:
        dist.send(torch.tensor([1, 0, 0, 1 << 40, 0], dtype=torch.int64), 0, group=pg)
        return ""

    async def holder() -> Stream:
        store = open_store(f"{BASE}/replica")
        return Stream(pg, 0, "n0", (), (1,), store, "g000000000000-00000000", 4096, {})

    stream = runtime.run(holder())
    stream.finish_sends(True)
    return stream.wait_received()[1].error


result["stream"] = hostile_stream(dist.group.WORLD)
if RANK == 0:
    print("RESULT", json.dumps(result), flush=True)
dist.destroy_process_group()
