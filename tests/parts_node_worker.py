"""Run under ``torchrun`` agents on loopback (each agent a node of a
:class:`fmstore.testing.cluster.Cluster`) by tests/test_tiering_nodes.py (gloo, CPU).

``python -m torch.distributed.run ... tests/parts_node_worker.py SCENARIO OUT STEP...``

The state: a tensor sharded over every rank (a DTensor on a CPU mesh) and a replicated
value, both derived from the step, so that a restore is checked bit for bit against the
state of the step it says it restored.

* ``save``: saves each STEP through ``ShardedCheckpointManager`` on the write tier (the
  nodes' NVMe), waits for every commit; a STEP ``pause`` instead waits for the commits so
  far, sets ``parts/paused-RANK`` in the test's TCP store (its port in
  ``PARTS_WORKER_TEST_PORT``) and waits for the test's ``parts/go`` (the test drains the
  nodes' daemons meanwhile: one start of the job fewer);
* ``restore``: restores the newest step every rank can read; every rank writes
  ``OUT/restore-RANK.json`` with the step, the tier it read and whether it is bit-exact;
* ``redo``: ``restore`` (its report also lists the steps the restore moved aside), then
  saves each STEP again (the job redoing the steps it fell back from) and waits for
  every commit.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fmstore.testing.cluster import pg_timeout  # noqa: E402
from fmstore.tiering.managers.sharded import ShardedCheckpointManager  # noqa: E402

warnings.filterwarnings("ignore")


def make_state(step: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(step)
    full = torch.randn(world * 4096, generator=g)
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "rep": torch.full((5,), float(step)),
        "step": step,
    }


def pause(rank: int) -> None:
    """Tell the test this rank waits, then wait for its signal."""
    from datetime import timedelta

    port = int(os.environ["PARTS_WORKER_TEST_PORT"])
    test = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    test.set(f"parts/paused-{rank}", "1")
    test.wait(["parts/go"])


def main() -> None:
    scenario, out, *steps = sys.argv[1:]
    dist.init_process_group("gloo", timeout=pg_timeout())
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.new_group(backend="gloo", timeout=pg_timeout())
    mgr = ShardedCheckpointManager("run", process_group=pg)
    if scenario == "save":
        for s in steps:
            if s == "pause":
                mgr.wait()
                dist.barrier(pg)
                pause(rank)
                continue
            mgr.save(int(s), make_state(int(s), world))
        mgr.wait()
        dist.barrier(pg)
    elif scenario in ("restore", "redo"):
        state = make_state(0, world)
        got = mgr.restore(state)
        want = make_state(got if got is not None else 0, world)
        exact = bool(
            torch.equal(state["w"].to_local(), want["w"].to_local())
            and torch.equal(state["rep"], want["rep"])
            and state["step"] == got
        )
        with open(os.path.join(out, f"restore-{rank}.json"), "w") as f:
            rep = {"step": got, "tier": mgr.restored_tier, "exact": exact}
            if scenario == "redo":
                rep["moved_aside"] = mgr.moved_aside
            json.dump(rep, f)
        if scenario == "redo":  # the job goes on: the steps after the restored one again
            for s in steps:
                mgr.save(int(s), make_state(int(s), world))
            mgr.wait()
            dist.barrier(pg)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
