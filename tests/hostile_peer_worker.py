"""One rank of a two-rank gloo group whose rank 1 is hostile: it announces sizes no message
of fmstore's has.  Rank 0 prints what fmstore's receiving side made of each, as JSON.

Run as ``python hostile_peer_worker.py RANK PORT``."""

from __future__ import annotations

import json
import resource
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from fmstore.checkpoint.dcp import replicas
from fmstore.checkpoint.dcp.wire import broadcast_result, gather_json
from fmstore.errors import FmstoreError


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    pg = dist.group.WORLD
    out: dict[str, str] = {}
    if rank == 0:
        # 2 GiB more address space than now: a 2**40-byte allocation would fail loudly
        with open("/proc/self/status") as f:
            vm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
        # a replica's header announcing a 1 TiB rank record
        out["recv"] = str(replicas._recv(pg, 1, [5]))
        # a gather where rank 1 announces 1 TiB
        try:
            gather_json(pg, "fine")
            out["gather"] = "accepted"
        except FmstoreError as e:
            out["gather"] = f"FmstoreError: {e}"
        # a broadcast of a manifest announcing more than the limit
        try:
            broadcast_result(pg, 1, None, limit=1 << 20)
            out["broadcast"] = "accepted"
        except FmstoreError as e:
            out["broadcast"] = f"FmstoreError: {e}"
        print("RESULT", json.dumps(out), flush=True)
    else:
        dist.send(torch.tensor([1, 1 << 40], dtype=torch.int64), 0, group=pg)
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(lens, torch.tensor([1 << 40], dtype=torch.int64), group=pg)
        dist.broadcast(torch.tensor([1, 1 << 40], dtype=torch.int64), group=pg, group_src=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
