"""One rank of ``benchmarks/scale.py``'s 1-3 node check, under ``torchrun`` agents on loopback
(each agent a node with its own ``FMSTORE_CONFIG`` and ``FMSTORE_NODE_ID``).

``python -m torch.distributed.run ... benchmarks/scale_worker.py NODE_BYTES ROUNDS OUT``

Every rank holds ``NODE_BYTES / local world size`` bytes of fp32 tensors and saves them with
``fmstore.checkpoint.dcp.save`` to ``nvme:`` (node-local), ``lustre:`` and ``s3:`` (shared),
then restores the ``nvme:`` copy (page cache dropped); with two nodes or more it also saves
to ``peer:`` (node-local, ``replicas = 1``), removes the last node's part and restores it
from its replica, ``ROUNDS`` times after a warm-up save
of almost nothing; each phase between two barriers of the checkpoint group, timed on rank 0,
which writes the medians (and every run) to ``OUT/times.json``, with the phases of rank 0's
saves with replicas (seconds from the call: ``opened`` its write began, after planning;
``own_write`` its blobs and record durable; ``sent`` its replica stream done;
``committed`` the commit and the manifest's copy done; ``received`` the replicas it holds
durable; ``counted`` their records and manifest written; ``returned``).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

import fmstore.checkpoint.dcp as fdcp
from benchmarks.common import settle


def main() -> None:
    node_bytes, rounds, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    pg = dist.new_group(backend="gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_WORLD_SIZE"])
    n = max(1, node_bytes // local // 4 // 8)
    gen = torch.Generator().manual_seed(rank)
    state = {f"t{i}": torch.rand(n, generator=gen) for i in range(8)}
    times: dict[str, list[float]] = {}
    phases: list[dict[str, float]] = []

    def timed(name: str, fn: object) -> None:
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        dist.barrier(group=pg)
        times.setdefault(name, []).append(time.perf_counter() - t0)

    nodes = dist.get_world_size() // local

    def replicas(r: int) -> None:
        """A save to the tier with ``replicas = 1``, the last node's part of it removed (a
        replaced node), and the restore that brings it back from the replica."""
        uri = f"peer:scale/r{r}"
        w = fdcp.Writer(uri)

        def save() -> None:
            t0 = time.perf_counter()
            fdcp.save(state, w, process_group=pg)
            got = w.replica_stream.times if w.replica_stream is not None else {}
            at = {k: v - t0 for k, v in got.items()}
            phases.append({**at, "returned": time.perf_counter() - t0})

        timed("save to nvme with replicas", save)
        dist.barrier(group=pg)
        if rank == dist.get_world_size() - 1:
            shutil.rmtree(os.path.join(os.environ["SCALE_PEER_DIR"], "scale", f"r{r}"))
        if rank == 0:
            settle()
        for v in back.values():
            v.zero_()
        timed("restore from replica", lambda: fdcp.load(back, uri, process_group=pg))
        assert all(torch.equal(back[k], state[k]) for k in state), "replica restore differs"

    # Threads, pools and connections started, outside the timed phases.
    tiny = {"t": torch.zeros(16)}
    for tier in ("nvme", "lustre", "s3"):
        fdcp.save(tiny, f"{tier}:scale/warm", process_group=pg)
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    for r in range(rounds):
        for tier in ("nvme", "lustre", "s3"):
            uri = f"{tier}:scale/r{r}"
            timed(f"save to {tier}", lambda u=uri: fdcp.save(state, u, process_group=pg))
        if rank == 0:
            settle()
        timed(
            "restore from nvme", lambda r=r: fdcp.load(back, f"nvme:scale/r{r}", process_group=pg)
        )
        assert all(torch.equal(back[k], state[k]) for k in state), "restore is not bit-exact"
        if nodes > 1:
            replicas(r)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        with open(os.path.join(out, "times.json"), "w") as f:
            doc = {"world": dist.get_world_size(), "times": med, "runs": times}
            json.dump({**doc, "phases": phases}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
