"""Run under several ``torchrun`` agents on loopback (each agent a node, with its own
``FMSTORE_CONFIG`` and ``FMSTORE_NODE_ID``) by tests/test_dcp_nodes.py (gloo, CPU).

``python -m torch.distributed.run --nnodes=N ... tests/node_worker.py SCENARIO[,SCENARIO...] OUT``
(several scenarios: run one after the other in the same launch)

The state: a model sharded with FSDP2 over every rank plus its Adam state, and replicated
values (a tensor, an int, a string) that DCP's deduplication (``dedup_save_to_lowest_rank``)
saves on rank 0 alone, so on another node's part only fmstore's copy of them exists.

Scenarios (every rank writes ``OUT/SCENARIO-RANK.json``; any failed check exits non-zero):

* ``save``: saves step 10 to ``nvme:`` (node-local) and ``lustre:`` (shared) through
  ``fmstore.checkpoint.dcp.save``, checks that a bare ``dcp.save`` with a ``Writer`` onto
  ``nvme:`` is refused, and restores step 10 from ``nvme:`` bit-exact into a fresh model;
* ``kill``: saves step 20; the lowest rank of the node without rank 0 stops mid-save after
  writing ``OUT/blocked`` (the test then SIGKILLs that node);
* ``resume``: restores the first of step 20 and step 10 on NVMe, then on Lustre, that every
  rank can read (the test corrupted a chunk of n1's part of step 10: Lustre's), saves
  step 30 (``async_save`` in DCP's checkpoint process) and restores it bit-exact;
* ``replaced``: restores step 30 with no fallback (the test wiped one node) and reports the
  error every rank got;
* ``redo``: with that node replaced, the sharded manager falls back to step 10 on Lustre,
  saves step 30 again (the newer steps moved aside) and restores it bit-exact;
* ``reshard``: on fewer ranks, restores step 10 from ``lustre:`` bit-exact;
* ``pause``: sets ``nodes/paused-RANK`` in the test's TCP store (its port in
  ``NODE_WORKER_TEST_PORT``) and waits for the test's ``nodes/go`` (the test wipes a node
  meanwhile), so one launch serves the scenarios before and after.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import set_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_worker import full_state, make_model, same, state, train  # noqa: E402

import fmstore.checkpoint.dcp as fdcp  # noqa: E402
from fmstore import runtime  # noqa: E402
from fmstore.checkpoint.dcp.nodes import node_id  # noqa: E402
from fmstore.stores import open_store  # noqa: E402
from fmstore.testing.cluster import pg_timeout  # noqa: E402
from fmstore.tiering.managers.sharded import ShardedCheckpointManager  # noqa: E402

warnings.filterwarnings("ignore")


def step_uri(tier: str, step: int) -> str:
    return f"{tier}:run/step_{step:012d}"


def extra(seed: int) -> dict[str, Any]:
    return {"rep": torch.arange(6, dtype=torch.float32) + seed, "n": 10 + seed, "note": f"s{seed}"}


def full(model: Any, opt: Any, ex: dict[str, Any]) -> dict[str, Any]:
    return {
        **full_state(model, opt),
        "extra": {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in ex.items()},
    }


def trained(steps: int) -> tuple[Any, Any]:
    model, opt = make_model(0)
    train(model, opt, steps, 0)
    return model, opt


def planner() -> DefaultSavePlanner:
    # Replicated values on rank 0 alone: the other node's part gets them only from fmstore.
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def restore(uris: list[str], ckpt: Any) -> tuple[str, dict[str, Any]]:
    model, opt = make_model(1)
    ex = extra(99)
    sd = {**state(model, opt), "extra": ex}
    used = fdcp.load(sd, uris[0], fallbacks=uris[1:], process_group=ckpt)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return used, full(model, opt, sd["extra"])


def save_step(
    step: int, tier: str, model: Any, opt: Any, ckpt: Any, out: str, process: bool = False
) -> None:
    """Saved through fmstore.checkpoint.dcp.save, or with ``process`` through async_save
    in DCP's checkpoint process, waited for."""
    sd = {**state(model, opt), "extra": extra(step)}
    snap = full(model, opt, extra(step))  # a collective
    if dist.get_rank() == 0:
        torch.save(snap, os.path.join(out, f"ref-{step}.pt"))
    if process:
        stager = fdcp.Stager(share_memory=True)
        fut = fdcp.async_save(
            sd,
            step_uri(tier, step),
            stager=stager,
            process=True,
            process_group=ckpt,
            planner=planner(),
        )
        fut.result()
        return
    fdcp.save(sd, step_uri(tier, step), process_group=ckpt, planner=planner())


def ref(out: str, step: int) -> dict[str, Any]:
    return torch.load(os.path.join(out, f"ref-{step}.pt"), weights_only=False)


def local_copy_of_replicated(uri: str) -> bool:
    """Whether this node's copy of the manifest puts ``extra.rep`` in this node's part."""
    m = runtime.run(fdcp.read_manifest(open_store(uri)))
    part = m.part_of(node_id())
    assert part is not None, "no part of this node"
    return any(
        it.fqn == "extra.rep" and m.blobs[it.chunks[0].blob].rank in part.ranks for it in m.items
    )


def managed(ckpt: Any) -> dict[str, Any]:
    """The sharded manager: an asynchronous save while training goes on, restored bit-exact,
    on node-local NVMe and with Lustre (shared) as the write tier."""
    rep: dict[str, Any] = {}
    for root, tier, step in (("mgr", "nvme", 40), ("mgr2", "lustre", 50)):
        mgr = ShardedCheckpointManager(root, process_group=ckpt, write_tier=tier)
        model, opt = trained(2)
        snap = full(model, opt, extra(step))
        fut = mgr.save(step, {**state(model, opt), "extra": extra(step)})
        train(model, opt, 1, 5)  # the save runs meanwhile; it keeps the staged values
        fut.result()
        mgr.wait()
        latest = mgr.latest_step()
        m2, o2 = make_model(1)
        sd = {**state(m2, o2), "extra": extra(99)}
        got = mgr.restore(sd)
        set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        same(full(m2, o2, sd["extra"]), snap, f"manager {root} step {step}")
        rep[root] = [latest, got, mgr.restored_step, mgr.restored_tier]
    return rep


class Blocking(DefaultSavePlanner):
    """The chosen rank writes ``marker`` and stops after resolving a few items."""

    def __init__(self, victim: bool, marker: str) -> None:
        super().__init__(dedup_save_to_lowest_rank=True)
        self.victim, self.marker, self.n = victim, marker, 0

    def resolve_data(self, write_item: Any) -> Any:
        if self.victim:
            self.n += 1
            if self.n > 2:
                with open(self.marker, "w") as f:
                    f.write(node_id())
                time.sleep(3600)  # killed by the test
        return super().resolve_data(write_item)


def scenario(name: str, out: str, ckpt: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node_id(), group=ckpt)
    rep: dict[str, Any] = {"node": nodes[rank], "nodes": nodes}
    if name == "save":
        model, opt = trained(2)
        save_step(10, "nvme", model, opt, ckpt, out)
        save_step(10, "lustre", model, opt, ckpt, out)
        rep["local_rep"] = local_copy_of_replicated(step_uri("nvme", 10))
        try:
            dcp.save(
                {**state(model, opt), "extra": extra(0)},
                storage_writer=fdcp.Writer(step_uri("nvme", 11)),
                process_group=ckpt,
            )
            rep["bare"] = ""
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            rep["bare"] = str(e)
        used, got = restore([step_uri("nvme", 10)], ckpt)
        same(got, ref(out, 10), "nvme step 10")
        rep["used"] = used
        rep.update(managed(ckpt))
    elif name == "kill":
        model, opt = trained(3)
        sd = {**state(model, opt), "extra": extra(20)}
        victim = nodes[rank] != nodes[0] and nodes.index(nodes[rank]) == rank
        fdcp.save(
            sd,
            step_uri("nvme", 20),
            process_group=ckpt,
            planner=Blocking(victim, os.path.join(out, "blocked")),
        )
        rep["committed"] = True
    elif name == "resume":
        cands = [step_uri("nvme", 20), step_uri("nvme", 10), step_uri("lustre", 10)]
        used, got = restore(cands, ckpt)
        same(got, ref(out, 10), "resumed from step 10")
        rep["used"] = used
        model, opt = trained(4)
        save_step(30, "nvme", model, opt, ckpt, out, process=True)
        used30, got30 = restore([step_uri("nvme", 30)], ckpt)
        same(got30, ref(out, 30), "nvme step 30")
        rep["used30"] = used30
    elif name == "replaced":
        try:
            restore([step_uri("nvme", 30)], ckpt)
            rep["error"] = ""
        except Exception as e:
            rep["error"] = f"{type(e).__name__}: {e}"
    elif name == "redo":
        # n1 was replaced (its NVMe is empty): the manager falls back to step 10 on Lustre,
        # moves n0's newer steps aside, and the redone step 30 saves on both nodes.
        mgr = ShardedCheckpointManager("run", process_group=ckpt)
        m2, o2 = make_model(1)
        sd = {**state(m2, o2), "extra": extra(99)}
        rep["restored"] = [mgr.restore(sd), mgr.restored_tier, mgr.moved_aside]
        set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        same(full(m2, o2, sd["extra"]), ref(out, 10), "fell back to step 10")
        model, opt = trained(5)
        snap = full(model, opt, extra(30))
        mgr.save(30, {**state(model, opt), "extra": extra(30)})
        mgr.wait()
        m3, o3 = make_model(1)
        sd3 = {**state(m3, o3), "extra": extra(99)}
        rep["redone"] = [mgr.restore(sd3), mgr.restored_tier]
        set_state_dict(m3, o3, model_state_dict=sd3["model"], optim_state_dict=sd3["optim"])
        same(full(m3, o3, sd3["extra"]), snap, "redone step 30")
        mgr.close()
    elif name == "reshard":
        used, got = restore([step_uri("nvme", 10), step_uri("lustre", 10)], ckpt)
        same(got, ref(out, 10), "4 -> 2 from lustre")
        rep["used"] = used
    return rep


def pause(rank: int) -> None:
    """Until the test's signal: its checks and changes take no process group's time."""
    port = int(os.environ["NODE_WORKER_TEST_PORT"])
    test = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    test.set(f"nodes/paused-{rank}", "1")
    test.wait(["nodes/go"])


def main() -> None:
    import faulthandler

    hang = float(os.environ.get("NODE_WORKER_HANG_DUMP", "300"))
    names, out = sys.argv[1:3]
    timeout = pg_timeout()
    dist.init_process_group("gloo", timeout=timeout)
    try:
        ckpt = dist.new_group(backend="gloo", timeout=timeout)
        for name in names.split(","):  # one launch, the scenarios in this order
            faulthandler.dump_traceback_later(hang, exit=True)  # each scenario's own limit
            if name == "pause":
                pause(dist.get_rank())
                continue
            rep = scenario(name, out, ckpt)
            with open(os.path.join(out, f"{name}-{dist.get_rank()}.json"), "w") as f:
                json.dump(rep, f)
            dist.barrier(group=ckpt)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
