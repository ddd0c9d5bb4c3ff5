"""Edges of ``fmstore.checkpoint.dcp.load``: what it is given, and the causes it reports.

* it takes a ``Reader`` as ``save`` takes a ``Writer``, and refuses anything else that is
  not a URI before any collective;
* an error that is no storage error (a bug, a wrong argument) is raised on every rank at
  once, unretried, never taken for "could not look" nor for an unusable candidate; DCP's
  own verdict (a missing key, a size mismatch), a bad checksum and a missing blob still
  send the restore to the next candidate;
* a node whose replicas cannot be read leaves what they hold unknown: a candidate whose
  lost part they may hold is looked at again, then raised, never passed over (I3 of
  docs/distributed.md); only replicas verified absent hold nothing;
* a relaunch whose ranks moved, with a saved rank on no node, passes the candidate over for
  that reason, on every rank, and adopts nothing.

Two ranks, each its own node (gloo, processes spawned by the test: tests/gloo_ranks.py);
two launches run every collective case.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gloo_ranks import run
from sharded_support import config_text, make_state, same
from torch.distributed.checkpoint import DefaultLoadPlanner

from fmstore.checkpoint import dcp as fdcp
from fmstore.checkpoint.dcp import Reader
from fmstore.checkpoint.dcp.collective import CandidatesFailed
from fmstore.errors import NotFound
from fmstore.protocol.problems import Code

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

KEY = "run/step_{:012d}"
NV, LU = "nvme:" + KEY.format(20), "lustre:" + KEY.format(10)


def _raised(fn: Any) -> str:
    """'' if ``fn()`` returns, else the exception's class and first line."""
    try:
        fn()
    except BaseException as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return ""


class BrokenPlanner(DefaultLoadPlanner):
    """A planner with a bug (on rank 1 of a process group)."""

    def create_local_plan(self) -> Any:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 1:
            raise TypeError("a bug in the planner")
        return super().create_local_plan()


# ---- one process, no process group -------------------------------------------------------


def _steps(tmp_path: Path) -> tuple[str, str]:
    """Steps 10 (with an extra key) and 20 saved in one process; their URIs, newest first."""
    old, new = str(tmp_path / "step_10"), str(tmp_path / "step_20")
    fdcp.save({"w": torch.full((4,), 10.0), "extra": torch.ones(2)}, old)
    fdcp.save({"w": torch.full((4,), 20.0)}, new)
    return new, old


def test_load_takes_a_reader_like_save_takes_a_writer_and_refuses_other_objects(tmp_path):
    new, old = _steps(tmp_path)
    sd = {"w": torch.zeros(4)}
    assert fdcp.load(sd, Reader(new, store_options={}), fallbacks=[old]) == new
    assert sd["w"].eq(20).all()
    for bad in (42, None, {"uri": new}, Reader):
        with pytest.raises(TypeError, match="URIs or a Reader"):
            fdcp.load(sd, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="URIs or a Reader"):
        fdcp.load(sd, new, fallbacks=[Reader(old)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="give store_options"):
        fdcp.load(sd, Reader(new), store_options={})
    assert fdcp.load(sd, Path(new)) == new


def test_a_bug_is_raised_as_it_is_and_only_the_checkpoints_own_verdicts_fall_back(tmp_path):
    new, old = _steps(tmp_path)
    sd = {"w": torch.zeros(4), "extra": torch.zeros(2)}
    # A bug in the planner: raised as it is (not DCP's CheckpointException around it), not
    # "no checkpoint every rank can read" after every candidate was passed over.
    with pytest.raises(TypeError, match="a bug in the planner"):
        fdcp.load(sd, new, fallbacks=[old], planner=BrokenPlanner())
    assert sd["w"].eq(0).all()
    # DCP's verdict (step 20 lacks "extra"; a "w" of another size): the next candidate.
    passed: list[Any] = []
    assert fdcp.load(sd, new, fallbacks=[old], passed=passed) == old
    assert [p.code for _c, p in passed] == [Code.UNUSABLE] and sd["w"].eq(10).all()
    with pytest.raises(CandidatesFailed) as failed:
        fdcp.load({"w": torch.zeros(8)}, new)
    assert [p.code for _c, p in failed.value.problems] == [Code.UNUSABLE]
    # A bad checksum: the next candidate, too.
    blob = next(p for p in Path(new).rglob("*.bin"))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    passed.clear()
    assert fdcp.load({"w": torch.zeros(4)}, new, fallbacks=[old], passed=passed) == old
    assert [p.code for _c, p in passed] == [Code.UNUSABLE], passed
    # A Reader's read options are the load's: unchecked, the flipped byte is loaded.
    assert fdcp.load({"w": torch.zeros(4)}, Reader(new, verify=False), fallbacks=[old]) == new


def test_what_plain_dcp_load_raises_for_a_missing_checkpoint(tmp_path):
    """docs/dcp.md: DCP's CheckpointException, a BaseException that ``except Exception``
    misses, the fmstore error's text inside; ``fmstore.checkpoint.dcp.load`` raises a
    NotFound."""
    from torch.distributed.checkpoint.api import CheckpointException

    missing = str(tmp_path / "step_30")
    with pytest.raises(CheckpointException) as got:
        dcp.load({"w": torch.zeros(4)}, storage_reader=Reader(missing))
    assert not isinstance(got.value, Exception)
    assert "no checkpoint at" in str(got.value)
    with pytest.raises(NotFound, match="no checkpoint every rank can read") as failed:
        fdcp.load({"w": torch.zeros(4)}, missing)
    assert isinstance(failed.value, CandidatesFailed)
    assert [p.code for _c, p in failed.value.problems] == [Code.NO_MANIFEST]
    assert not os.path.exists(missing)


# ---- two ranks, each its own node --------------------------------------------------------


def _link_replica_manifest(tmp: str, node: str, *, back: bool = False) -> None:
    """Make ``node``'s replica manifest of step 20 unreadable (a link: the POSIX store
    refuses to follow it, PermissionDenied), or readable again."""
    d = Path(tmp, node, "nvme", ".replicas", KEY.format(20))
    if back:
        (d / "manifest.json").unlink()
        (d / "real.json").rename(d / "manifest.json")
    else:
        (d / "manifest.json").rename(d / "real.json")
        (d / "manifest.json").symlink_to("real.json")


def in_place(rank: int, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    pg = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    fdcp.save(make_state(20), NV, process_group=pg)
    fdcp.save(make_state(10), LU, process_group=pg)
    st = make_state(0)
    used = fdcp.load(st, Reader(NV), fallbacks=[LU], process_group=pg)
    out["reader"] = (used, same(st, make_state(20)))
    # A wrong argument on rank 1 only (a config that is not one): every rank raises at once.
    so = {"config": 42} if rank == 1 else None
    st = make_state(0)
    out["argument"] = _raised(
        lambda: fdcp.load(st, NV, fallbacks=[LU], process_group=pg, store_options=so)
    )
    # A bug in the planner on rank 1: raised on every rank, no older step loaded.
    out["planner"] = _raised(
        lambda: fdcp.load(st, NV, fallbacks=[LU], process_group=pg, planner=BrokenPlanner())
    )
    out["planner_step"] = st["step"]
    # n0 loses its part's blobs; n1's replica of it cannot be read: unknown, not older.
    part = Path(tmp, "n0", "nvme", KEY.format(20))
    if rank == 0:
        m = json.loads((part / "manifest.json").read_text())
        for b in m["blobs"]:
            if b["rank"] == 0:
                (part / m["generation"] / b["name"]).unlink()
        _link_replica_manifest(tmp, "n1")
    dist.barrier(pg)
    out["unknown"] = _raised(lambda: fdcp.load(st, NV, fallbacks=[LU], process_group=pg))
    out["unknown_step"] = st["step"]
    dist.barrier(pg)
    if rank == 0:
        _link_replica_manifest(tmp, "n1", back=True)
    dist.barrier(pg)
    # Readable again: n0's part comes back from n1's replica.
    st = make_state(0)
    used = fdcp.load(st, NV, fallbacks=[LU], process_group=pg)
    out["fetched"] = (used, same(st, make_state(20)))
    dist.barrier(pg)
    return out


def swapped(rank: int, tmp: str) -> dict[str, Any]:
    """Rank 0 on n1, rank 1 on n0; n0 lost its whole part of step 20."""
    import torch.distributed as dist

    pg = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    n0 = Path(tmp, "n0", "nvme", KEY.format(20))
    if rank == 0:
        shutil.rmtree(n0)
        _link_replica_manifest(tmp, "n1")
    dist.barrier(pg)
    st = make_state(0)
    out["unknown"] = _raised(lambda: fdcp.load(st, NV, fallbacks=[LU], process_group=pg))
    out["unknown_step"] = st["step"]
    dist.barrier(pg)
    if rank == 0:
        _link_replica_manifest(tmp, "n1", back=True)
    dist.barrier(pg)
    st = make_state(0)
    out["routed"] = (fdcp.load(st, NV, fallbacks=[LU], process_group=pg), same(st, make_state(20)))
    dist.barrier(pg)
    # n1's replica of saved rank 0 removed: no node holds it, and that is the reason given.
    if rank == 0:
        shutil.rmtree(Path(tmp, "n1", "nvme", ".replicas", KEY.format(20)))
    dist.barrier(pg)
    passed: list[Any] = []
    st = make_state(0)
    used = fdcp.load(st, NV, fallbacks=[LU], process_group=pg, passed=passed)
    out["lost"] = (used, same(st, make_state(10)), [(p.code.value, p.text) for _c, p in passed])
    dist.barrier(pg)
    out["adopted"] = (n0 / "manifest.json").exists()
    return out


def test_collective_failures_unknown_replicas_and_a_failed_route_on_two_nodes(tmp_path):
    tmp = str(tmp_path)
    for node in ("n0", "n1"):
        Path(tmp, f"{node}.toml").write_text(config_text(tmp, node))

    def env(node: str) -> dict[str, str]:
        return {"FMSTORE_NODE_ID": node, "FMSTORE_CONFIG": f"{tmp}/{node}.toml"}

    reps = run(in_place, [env("n0"), env("n1")], tmp, init=str(tmp_path / "init1"))
    for r in reps:
        assert r["reader"] == (NV, True), r
        # Raised on both ranks at once, as fmstore's error naming the cause: not "could
        # not tell ... after 3 looks", not an older step.
        assert r["argument"].startswith("FmstoreError: ") and "not retried" in r["argument"], r
        assert "AttributeError" in r["argument"], r
        assert r["planner"].startswith("FmstoreError: ") and "a bug in the planner" in r["planner"]
        assert r["planner_step"] == 0, r
        assert r["unknown"].startswith("StoreUnavailable: ") and "3 looks" in r["unknown"], r
        assert "could not look" in r["unknown"] and "PermissionDenied" in r["unknown"], r
        assert r["unknown_step"] == 0, r
        assert r["fetched"] == (NV, True), r

    reps = run(swapped, [env("n1"), env("n0")], tmp, init=str(tmp_path / "init2"))
    for r in reps:
        assert r["unknown"].startswith("StoreUnavailable: ") and "3 looks" in r["unknown"], r
        assert r["unknown_step"] == 0, r
        assert r["routed"] == (NV, True), r
        used, exact, passed = r["lost"]
        assert (used, exact) == (LU, True), r
        assert [c for c, _t in passed] == ["lacks_part"], r
        assert "ranks [0] of the save are on no node of this job" in passed[0][1], r
        assert not r["adopted"], r  # no manifest written beside a part n0 does not hold
