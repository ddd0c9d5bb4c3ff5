"""A restore whose ranks run on other nodes than the save: every item from a node that
holds it (issue 46, point 1).  Two ranks, each its own node (gloo, processes spawned by the
test); the routing decision itself is a pure function, tested on its own."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from gloo_ranks import run
from sharded_support import config_text, make_state

from fmstore.protocol.routing import PART, REPLICA, Holding, Routes, may_drop_pending, route

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

STEP = "run/step_{:012d}"


def test_route_reads_on_its_own_node_first_then_a_part_then_a_replica():
    # Saved ranks 0, 1 on n0, 2, 3 on n1; the relaunch swapped the nodes.
    hs = [
        Holding(0, "n1", frozenset({2, 3}), frozenset({0, 1})),
        Holding(1, "n1", frozenset({2, 3}), frozenset({0, 1})),
        Holding(2, "n0", frozenset({0, 1})),
        Holding(3, "n0", frozenset({0, 1})),
    ]
    got = route(4, hs)
    assert isinstance(got, Routes)
    assert got.source[(0, 2)] == (0, PART)  # its own node's part
    assert got.source[(0, 0)] == (0, REPLICA)  # its own node's replica before another's part
    assert got.source[(2, 3)] == (0, PART)  # another node's part: that node's lowest rank
    assert got.local(3) == {0, 1} and got.remote()
    # n0 lost its part, keeps a replica of nothing: saved ranks 0, 1 only as n1's replica.
    hs[2] = Holding(2, "n0")
    hs[3] = Holding(3, "n0")
    got = route(4, hs)
    assert isinstance(got, Routes) and got.source[(2, 0)] == (0, REPLICA)
    # Nobody holds saved rank 0 any more: the ranks no node holds.
    hs[0] = hs[1] = Holding(0, "n1", frozenset({2, 3}), frozenset({1}))
    assert route(4, hs) == (0,)


def test_a_pending_part_is_removed_only_when_every_node_of_its_save_is_in_the_job():
    assert may_drop_pending(["n0", "n1"], ["n1", "n0"])  # swapped ranks: still every node
    assert not may_drop_pending(["n0", "n1"], ["n1", "n2"])
    assert not may_drop_pending([], ["n0"])  # a record without its layout: kept


def save(rank: int, tmp: str) -> None:
    import torch.distributed as dist

    import fmstore.checkpoint.dcp as fdcp
    from fmstore.checkpoint.dcp.nodes import RankRecord, rank_record_key
    from fmstore.checkpoint.layout import new_generation

    pg = dist.new_group(backend="gloo")
    fdcp.save(make_state(10), "lustre:" + STEP.format(10), process_group=pg)
    fdcp.save(make_state(20), "nvme:" + STEP.format(20), process_group=pg)
    # A save killed before its commit: each node's pending part (its rank's record).
    gen = new_generation()
    rec = Path(tmp, f"n{rank}", "nvme", STEP.format(30), rank_record_key(gen, rank))
    rec.parent.mkdir(parents=True)
    (rec.parent / f"{rank:06d}.bin").write_bytes(b"abc")
    rec.write_bytes(
        RankRecord(
            gen, "s", rank, f"n{rank}", ((f"{rank:06d}.bin", 3),), nodes=("n0", "n1")
        ).dumps()
    )
    dist.barrier(pg)


def files(tmp: str) -> list[str]:
    return sorted(str(p.relative_to(tmp)) for p in Path(tmp).rglob("*") if p.is_file())


def restore(rank: int, tmp: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import fmstore.checkpoint.dcp as fdcp

    pg = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    passed: list[Any] = []
    state = make_state(0)
    out["pending"] = fdcp.load(
        state, "nvme:" + STEP.format(30), fallbacks=["nvme:" + STEP.format(20)], process_group=pg
    )
    before = files(tmp)
    dist.barrier(pg)
    state = make_state(0)
    out["used"] = fdcp.load(
        state,
        "nvme:" + STEP.format(20),
        fallbacks=["lustre:" + STEP.format(10)],
        process_group=pg,
        passed=passed,
    )
    want = make_state(20)
    out["exact"] = bool(torch.equal(state["w"].to_local(), want["w"].to_local()))
    out["step"] = state["step"]
    out["passed"] = [p.text for _c, p in passed]
    dist.barrier(pg)
    out["written"] = sorted(set(files(tmp)) - set(before))
    return out


def restore_in_place(rank: int, tmp: str) -> tuple[int, bool]:
    """Step 20 restored on the nodes that saved it: how many times this rank parsed its
    manifest (the collective's check and the Reader's), and whether the state is exact."""
    import torch
    import torch.distributed as dist

    import fmstore.checkpoint.dcp as fdcp
    from fmstore.checkpoint.dcp.manifest import DcpManifest

    pg = dist.new_group(backend="gloo")
    parsed: list[str] = []
    loads = DcpManifest.loads.__func__  # type: ignore[attr-defined]

    def counted(cls: Any, data: bytes, *, where: str = "") -> Any:
        if ".replicas" not in where:  # the replicas a node holds are their own manifests
            parsed.append(where)
        return loads(cls, data, where=where)

    DcpManifest.loads = classmethod(counted)  # type: ignore[method-assign, assignment]
    state = make_state(0)
    fdcp.load(state, "nvme:" + STEP.format(20), process_group=pg)
    return len(parsed), bool(torch.equal(state["w"].to_local(), make_state(20)["w"].to_local()))


def restore_with_manager(rank: int, tmp: str) -> tuple[int | None, bool]:
    import torch
    import torch.distributed as dist

    from fmstore import ShardedCheckpointManager

    pg = dist.new_group(backend="gloo")
    state = make_state(0)
    with ShardedCheckpointManager("run", process_group=pg) as mgr:  # close() raises failures
        got = mgr.restore(state)
    return got, bool(torch.equal(state["w"].to_local(), make_state(20)["w"].to_local()))


def save_then_restore_in_place(rank: int, tmp: str) -> tuple[int, bool]:
    """The save, then (the same ranks on the same nodes) step 20 restored in place."""
    save(rank, tmp)
    return restore_in_place(rank, tmp)


def restore_then_lose_a_part(rank: int, tmp: str) -> tuple[dict[str, Any], Any]:
    """On the swapped nodes: the restore; then n0 loses its part of step 20 (its rank
    removes it between two barriers) and the manager restores."""
    import torch.distributed as dist

    from fmstore.checkpoint.dcp.nodes import node_id

    out = restore(rank, tmp)
    dist.barrier()
    if node_id() == "n0":
        shutil.rmtree(Path(tmp, "n0", "nvme", STEP.format(20)))
    dist.barrier()
    return out, restore_with_manager(rank, tmp)


def test_swapped_nodes_restore_the_newest_step_from_the_nodes_not_the_shared_tier(tmp_path):
    tmp = str(tmp_path)
    for node in ("n0", "n1"):
        Path(tmp, f"{node}.toml").write_text(config_text(tmp, node))

    def env(node: str) -> dict[str, str]:
        return {"FMSTORE_NODE_ID": node, "FMSTORE_CONFIG": f"{tmp}/{node}.toml"}

    # Two launches, each serving two phases (a start of the ranks costs more than the work).
    # On the nodes that saved it, each rank parses the manifest once: the collective's
    # check hands it to the Reader.
    got = run(save_then_restore_in_place, [env("n0"), env("n1")], tmp, init=str(tmp_path / "i1"))
    assert got == [(1, True), (1, True)]
    # The relaunch's rendezvous orders the hosts the other way round.
    both = run(restore_then_lose_a_part, [env("n1"), env("n0")], tmp, init=str(tmp_path / "i2"))
    for r, _ in both:
        # The pending step 30 of nodes n0 and n1 is removed though each node now runs the
        # other rank: every node of its save said it holds no manifest.
        assert r["pending"] == "nvme:" + STEP.format(20), r
        assert r["used"] == "nvme:" + STEP.format(20) and r["passed"] == [], r
        assert r["exact"] and r["step"] == 20, r
        assert r["written"] == [], r  # streamed into memory, nothing written to disk
    for node in ("n0", "n1"):
        assert not list(Path(tmp, node, "nvme", STEP.format(30)).rglob("rank-*.json"))

    # n0 lost its part (its replica of n1's part stays): n0's rank reads saved rank 1 from
    # its own replica and saved rank 0 from n1's replica, over the group; the manager
    # records nothing on n0, which holds nothing of the step.
    assert [m for _, m in both] == [(20, True), (20, True)]
    assert not Path(tmp, "n0", "nvme", STEP.format(20)).exists()
