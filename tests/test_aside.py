"""A step a restore abandoned never stays committed on a shared tier: the restorer's fence
(a retired record, then a look at the manifest) against the committer's (a look for the
record before and after its manifest write), with the real export of node parts on a real
POSIX directory and on SeaweedFS; and the redo of the step, exported under its new
generation, retires the abandoned copy (manifest first) instead of being refused."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from parts_support import ROOT, Node, PauseAt, ckpt_list, lustre, save_parts

from fmstore import runtime
from fmstore.checkpoint.dcp.manifest import DcpManifest
from fmstore.checkpoint.gc import gc
from fmstore.checkpoint.layout import checkpoint_key
from fmstore.checkpoint.verify import verify_checkpoint
from fmstore.errors import NotFound
from fmstore.format.manifest import MANIFEST_KEY
from fmstore.protocol.env import Env
from fmstore.protocol.records import ExportLease, lease_key, retired_key
from fmstore.stores import open_store
from fmstore.stores.base import PrefixStore, PutOptions, Store
from fmstore.tiering.exports.mover import CHECKPOINT_COPY
from fmstore.tiering.exports.parts import export_part
from fmstore.tiering.exports.retire import fence
from fmstore.tiering.inventory import catalog as cat
from fmstore.tiering.inventory.foreign import NotCounted
from fmstore.tiering.tiers import Tiers

NODES3 = ("n0", "n1", "n2")
STEP = 24
EXPORT = {"ladder": ["nvme", "lustre"], "export": [{"to": "lustre", "every_steps": 8}]}


@pytest.fixture(params=["posix", "s3"])
def dest(request, tmp_path) -> Any:
    """A factory of the shared tier's store of step 24 (a fresh prefix per call)."""
    made: list[Store] = []
    n = [0]

    def make() -> Store:
        n[0] += 1
        if request.param == "posix":
            st = open_store(str(tmp_path / f"lustre{n[0]}" / checkpoint_key(ROOT, STEP)))
        else:
            s3 = request.getfixturevalue("s3_server")
            bucket = request.getfixturevalue("s3_bucket")
            url = f"s3://{bucket}/t{n[0]}/{checkpoint_key(ROOT, STEP)}"
            st = open_store(url, **s3.store_options())
        made.append(st)
        return st

    yield make
    for st in made:
        runtime.run(st.close())


def _nvme(base: Path, node: str) -> Store:
    return open_store(str(base / node / "nvme" / checkpoint_key(ROOT, STEP)))


def _export(base: Path, dst: Store, node: str) -> Any:
    return runtime.run(
        export_part(_nvme(base, node), dst, node, options=CHECKPOINT_COPY, env=Env())
    )


async def _manifest(dst: Store) -> bytes | None:
    try:
        return await dst.get(MANIFEST_KEY)
    except NotFound:
        return None


def test_a_retired_record_before_the_commit_leaves_no_commit(tmp_path, dest):
    """n1 and n2 exported their parts; the restore retires the generation; n0's export
    (the slow one) then finds every part there but commits nothing."""
    raw = save_parts(tmp_path, STEP, NODES3)
    gen = DcpManifest.loads(raw).generation
    dst = dest()
    assert _export(tmp_path, dst, "n1").waiting_for == ("n0", "n2")
    assert _export(tmp_path, dst, "n2").waiting_for == ("n0",)
    assert runtime.run(fence(dst, gen, Env(node="n2"))) is False  # nothing committed yet
    res = _export(tmp_path, dst, "n0")
    assert res.retired and not res.waiting_for
    assert runtime.run(_manifest(dst)) is None
    assert runtime.run(dst.exists(retired_key(gen)))


def test_a_commit_before_the_record_is_retired_by_the_restorer(tmp_path, dest):
    """Every part was there and committed before the restore looked: its fence deletes the
    manifest (the copy is an uncommitted generation again)."""
    raw = save_parts(tmp_path, STEP, NODES3)
    gen = DcpManifest.loads(raw).generation
    dst = dest()
    for n in ("n1", "n2", "n0"):
        res = _export(tmp_path, dst, n)
    assert not res.waiting_for and not res.retired
    assert runtime.run(_manifest(dst)) == raw
    assert runtime.run(fence(dst, gen, Env(node="n0"))) is True
    assert runtime.run(_manifest(dst)) is None
    # an export of it after that commits nothing again
    assert _export(tmp_path, dst, "n1").retired
    assert runtime.run(_manifest(dst)) is None


def test_a_commit_landing_after_the_restorers_look_takes_itself_back(tmp_path, dest):
    """n0 looked for the retired record (none), and its manifest write lands after the
    restorer wrote the record and found no manifest: n0's look after its write finds the
    record and deletes its own manifest."""
    raw = save_parts(tmp_path, STEP, NODES3)
    gen = DcpManifest.loads(raw).generation
    dst = dest()
    for n in ("n1", "n2"):
        _export(tmp_path, dst, n)
    paused = PauseAt(dst, "", MANIFEST_KEY)

    async def race() -> Any:
        task = asyncio.create_task(
            export_part(_nvme(tmp_path, "n0"), paused, "n0", options=CHECKPOINT_COPY, env=Env())
        )
        await paused.reached.wait()  # n0's checks passed; its manifest write is next
        assert await fence(dst, gen, Env(node="n2")) is False  # the restorer sees no manifest
        paused.go.set()
        return await task

    res = runtime.run(race())
    assert res.retired
    assert runtime.run(_manifest(dst)) is None


class CrashAfter(PrefixStore):
    """``inner``, pausing before a put of ``key`` (``before`` set, then waits for ``go``)
    and hanging for good after it (``after`` set): the caller cancels it there, as a
    process dying right after that write."""

    def __init__(self, inner: Store, key: str) -> None:
        super().__init__(inner, "")
        self.key = key
        self.before, self.go, self.after = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def put(self, key, data, options=PutOptions()):
        if key != self.key:
            return await super().put(key, data, options)
        self.before.set()
        await self.go.wait()
        await super().put(key, data, options)
        self.after.set()
        await asyncio.Event().wait()


def test_the_redo_retires_an_abandoned_commit_and_commits_its_own(tmp_path, monkeypatch, capsys):
    """The worst case the fence leaves: n0's commit of the abandoned generation landed
    after the restorer's look, and n0 died before its look after the write.  The redo of
    the step (a new generation) waits while n0's lease may be alive, then deletes the
    abandoned manifest and commits its own: nothing refused, nothing marked corrupt, and
    the sweep takes the abandoned generation."""
    old = save_parts(tmp_path, STEP, NODES3)
    gen = DcpManifest.loads(old).generation
    nodes = [Node(tmp_path, n, EXPORT) for n in NODES3]
    for n in nodes:
        n.record(STEP)
    for n in nodes[1:]:
        n.step(monkeypatch)
    dst = open_store(str(lustre(tmp_path, STEP)))
    crash = CrashAfter(dst, MANIFEST_KEY)

    async def n0_dies_after_its_commit() -> None:
        task = asyncio.create_task(
            export_part(_nvme(tmp_path, "n0"), crash, "n0", options=CHECKPOINT_COPY, env=Env())
        )
        await crash.before.wait()
        assert await fence(dst, gen, Env(node="n2")) is False  # the restorer sees no manifest
        crash.go.set()
        await crash.after.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    runtime.run(n0_dies_after_its_commit())
    assert (lustre(tmp_path, STEP) / MANIFEST_KEY).read_bytes() == old  # abandoned, written
    # ... and counted by no reader: its generation is retired
    tiers = Tiers(nodes[1].cfg)
    notes = NotCounted()
    try:
        assert runtime.run(tiers.committed_copy("lustre", ROOT, STEP, notes=notes)) is None
        assert runtime.run(tiers.newest_committed("lustre", ROOT)) is None
    finally:
        runtime.run(tiers.close())
    assert "retired" in str(notes.by_root), notes.by_root

    # The restore moved every node's step 24 aside; the job saves 24 again.
    for node in nodes:
        shutil.rmtree(tmp_path / node.name / "nvme" / checkpoint_key(ROOT, STEP))
        node.catalog.forget_copy(ROOT, STEP, "lustre")
    new = save_parts(tmp_path, STEP, NODES3)
    gen2 = DcpManifest.loads(new).generation
    assert gen2 != gen
    for n in nodes:
        n.record(STEP)
    nodes[1].step(monkeypatch)
    # the leases of the abandoned generation may be alive (n0's among them: it may still
    # write): the redo waits, refuses nothing
    row = nodes[1].catalog.copy(ROOT, STEP, "lustre")
    assert row is not None and row.state == cat.EXPORTING, row
    assert f"n0 ({gen})" in (row.error or ""), row.error
    assert (lustre(tmp_path, STEP) / MANIFEST_KEY).read_bytes() == old
    # n0 is gone and n1's and n2's exports of it stopped (the restore took their rows):
    # their leases age out (renewed long ago)
    for n in NODES3:
        runtime.run(dst.put(lease_key(gen, n), ExportLease(n, 1, 1.0).dumps()))
    for _ in range(2):
        for n in nodes:
            n.step(monkeypatch)
    assert (lustre(tmp_path, STEP) / MANIFEST_KEY).read_bytes() == new
    assert runtime.run(verify_checkpoint(dst)).ok
    for n in nodes:
        assert n.state(STEP, "lustre") == cat.PRESENT, n.name
    out = ckpt_list(tmp_path, "n0", capsys, monkeypatch)
    assert "corrupt" not in out and "present" in out, out
    # the sweep removes the abandoned generation, never the redo's
    gc(str(tmp_path / "lustre"), older_than=0)
    assert not (lustre(tmp_path, STEP) / gen).exists()
    assert runtime.run(verify_checkpoint(dst)).ok
