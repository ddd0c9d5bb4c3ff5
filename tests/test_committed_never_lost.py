"""No committed checkpoint is lost to what another writer left on a tier (issue: a stray
``manifest.json``, a race of supersede and commit, a part record that lies): each case is
forced with the real functions and checked against the invariants of docs/distributed.md."""

from __future__ import annotations

import asyncio

from parts_support import ROOT, Node, PauseAt, save_parts
from tiering_helpers import posix_config
from tiering_runs import held, run_saves

from fmstore import runtime
from fmstore.checkpoint.dcp.manifest import DcpManifest
from fmstore.checkpoint.dcp.nodes import NODE_ENV
from fmstore.checkpoint.layout import checkpoint_key
from fmstore.checkpoint.verify import read_committed, verify_checkpoint
from fmstore.errors import NotFound
from fmstore.format.checksum import crc32c
from fmstore.format.manifest import MANIFEST_KEY
from fmstore.protocol.env import Env
from fmstore.protocol.records import PartRecord, manifest_sha256
from fmstore.stores import open_store
from fmstore.tiering.exports.mover import CHECKPOINT_COPY
from fmstore.tiering.exports.parts import _part_blobs, delete_own_part, export_part
from fmstore.tiering.inventory import catalog as cat
from fmstore.tiering.inventory.discovery import rediscover
from fmstore.tiering.service.daemon import Daemon, DaemonSettings
from fmstore.tiering.tiers import Tiers

POLICIES = {
    "export": [{"to": "lustre", "every_saves": 1}],
    "retention": {"nvme": {"keep_latest": 1}, "lustre": {"keep_latest": 1}},
}


def _verifies(cfg, tier: str, root: str, step: int) -> bool:
    """The copy verifies, looked at on the tier itself (not through a step listing)."""
    tiers = Tiers(cfg)

    async def check() -> bool:
        try:
            return (await verify_checkpoint(tiers.checkpoint(tier, root, step))).ok
        except NotFound:
            return False
        finally:
            await tiers.close()

    return runtime.run(check())


def _daemon_once(cfg) -> None:
    d = Daemon(cfg, settings=DaemonSettings(port=0, interval=0.01))
    try:
        assert d.run(drain=True, timeout=120) == 0
    finally:
        d.close()


def test_a_garbage_manifest_in_a_newer_step_deletes_no_real_checkpoint(tmp_path):
    """I1: an empty manifest (and one that is not fmstore's) in a newer step directory on
    every tier is no commit: retention with keep_latest = 1 keeps the real newest step."""
    cfg = posix_config(str(tmp_path), POLICIES, tiers=("nvme", "lustre"))
    run_saves(cfg, "runs/a", [1, 2])
    assert held(cfg, "lustre", "runs/a") == [2]
    for tier, junk in (("nvme", b""), ("lustre", b'{"format": "fmstore-checkpoint"}')):
        d = tmp_path / tier / checkpoint_key("runs/a", 3)
        d.mkdir(parents=True)
        (d / "manifest.json").write_bytes(junk)
    _daemon_once(cfg)
    assert _verifies(cfg, "lustre", "runs/a", 2) and _verifies(cfg, "nvme", "runs/a", 2)
    assert held(cfg, "lustre", "runs/a") == held(cfg, "nvme", "runs/a") == [2]


def test_a_manifest_without_its_part_on_a_node_is_not_counted_by_node_local_keep_latest(
    tmp_path, monkeypatch
):
    """The same on a node-local tier: a manifest at a newer step whose generation holds no
    part of this node (copied there by hand) does not move the node's keep_latest window
    past the real newest step, the only copy of its part."""
    policies = {
        "ladder": ["nvme", "lustre"],
        "export": [{"to": "lustre", "every_steps": 1000}],
        "retention": {"nvme": {"keep_latest": 1}},
    }
    save_parts(tmp_path, 10)
    raw = save_parts(tmp_path, 20)
    stray = tmp_path / "n0" / "nvme" / checkpoint_key(ROOT, 30)
    stray.mkdir(parents=True)
    (stray / "manifest.json").write_bytes(raw)
    n0 = Node(tmp_path, "n0", policies)
    monkeypatch.setenv(NODE_ENV, "n0")
    runtime.run(rediscover(n0.catalog, n0.runner.tiers, ["nvme", "lustre"]))
    n0.step(monkeypatch)
    assert _verifies_part(tmp_path / "n0" / "nvme", 20, "n0")
    assert not (tmp_path / "n0" / "nvme" / checkpoint_key(ROOT, 10)).exists()


def _verifies_part(nvme, step: int, node: str) -> bool:
    async def check() -> bool:
        store = open_store(str(nvme / checkpoint_key(ROOT, step)))
        try:
            _data, m = await read_committed(store)
            return (await verify_checkpoint(store, manifest=m.part_view(node))).ok
        except NotFound:
            return False

    return runtime.run(check())


def _nvme(base, node: str, step: int):
    return open_store(str(base / node / "nvme" / checkpoint_key(ROOT, step)))


def test_a_part_superseded_while_another_node_commits_stays_in_the_commit(tmp_path, monkeypatch):
    """I2 / I4, supersede vs commit: n0 lists both part records and is about to write the
    manifest when n1 supersedes its export (removes its record, finds no manifest yet):
    n1 must not take its blobs out from under the commit n0 is making."""
    save_parts(tmp_path, 10)
    lustre_root = open_store(str(tmp_path / "lustre"))
    key = checkpoint_key(ROOT, 10)

    async def race() -> bool:
        plain = lustre_root.sub(key)
        monkeypatch.setenv(NODE_ENV, "n1")
        res = await export_part(
            _nvme(tmp_path, "n1", 10), plain, "n1", options=CHECKPOINT_COPY, env=Env()
        )
        assert res.waiting_for == ("n0",)
        monkeypatch.setenv(NODE_ENV, "n0")
        paused = PauseAt(lustre_root, key, MANIFEST_KEY)
        commit = asyncio.create_task(
            export_part(_nvme(tmp_path, "n0", 10), paused, "n0", options=CHECKPOINT_COPY, env=Env())
        )
        await paused.reached.wait()  # n0 listed both records; its manifest write is next
        monkeypatch.setenv(NODE_ENV, "n1")
        removed = await delete_own_part(plain, "n1", _nvme(tmp_path, "n1", 10), env=Env())
        paused.go.set()
        assert not (await commit).waiting_for
        assert (await verify_checkpoint(plain)).ok  # every part of the manifest is there
        return removed

    assert runtime.run(race()) is False


EXPORT = {"ladder": ["nvme", "lustre"], "export": [{"to": "lustre", "every_steps": 10}]}


def _lustre_copy_holds(base, node: Node) -> None:
    """I2 on the shared copy, and the node's catalog says verified only after a check."""
    plain = open_store(str(base / "lustre" / checkpoint_key(ROOT, 10)))
    assert runtime.run(verify_checkpoint(plain)).ok
    cp = node.catalog.copy(ROOT, 10, "lustre")
    assert cp is not None and cp.state == cat.PRESENT and cp.verified is not None


def test_a_part_record_listing_no_blobs_vouches_for_nothing(tmp_path, monkeypatch):
    """A ``part-n0.json`` that n0 never wrote (no blobs, the manifest's SHA-256 copied from
    n1's record): neither n1 commits on it nor n0 skips its export on it."""
    raw = save_parts(tmp_path, 10)
    gen = DcpManifest.loads(raw).generation
    d = tmp_path / "lustre" / checkpoint_key(ROOT, 10) / gen
    d.mkdir(parents=True)
    forged = PartRecord("n0", (0,), gen, manifest_sha256(raw), ())
    (d / "part-n0.json").write_bytes(forged.dumps())
    n0, n1 = (Node(tmp_path, n, EXPORT) for n in ("n0", "n1"))
    for n in (n1, n0):
        n.record(10)
        n.step(monkeypatch)
    _lustre_copy_holds(tmp_path, n0)


def test_a_record_whose_part_fails_its_checksums_is_copied_again_before_the_commit(
    tmp_path, monkeypatch
):
    """n0's own record holds by the listing (names, sizes) but a blob's bytes changed on
    the shared tier: the commit that counts it checks the part first, and copies it again;
    "verified" comes from that check, never from the copy option."""
    raw = save_parts(tmp_path, 10)
    m = DcpManifest.loads(raw)
    n0 = Node(tmp_path, "n0", EXPORT)
    n0.record(10)
    n0.step(monkeypatch)  # n0's part is there, waiting for n1's
    d = tmp_path / "lustre" / checkpoint_key(ROOT, 10) / m.generation
    blob = d / m.part_view("n0").blobs[0].name
    blob.write_bytes(bytes(b ^ 0xFF for b in blob.read_bytes()))
    # n1's part arrives (its blobs and a record that holds) without n1 committing.
    src = tmp_path / "n1" / "nvme" / checkpoint_key(ROOT, 10) / m.generation
    for b in m.part_view("n1").blobs:
        (d / b.name).write_bytes((src / b.name).read_bytes())
    rec = PartRecord("n1", (1,), m.generation, manifest_sha256(raw), tuple(_part_blobs(m, "n1")))
    (d / "part-n1.json").write_bytes(rec.dumps())
    n0.step(monkeypatch)
    _lustre_copy_holds(tmp_path, n0)


def test_a_rescan_lists_no_blobs_of_a_manifest_the_catalog_validated(tmp_path):
    """Counting by validation stays cheap: a manifest whose checksum the catalog knows for
    that copy is not listed again (its blobs gone here shows the listing was skipped),
    while the clock bound on ``created`` still applies to it."""
    cfg = posix_config(str(tmp_path), {}, tiers=("nvme", "lustre"))
    run_saves(cfg, "runs/a", [1], settle_each=False)
    d = tmp_path / "nvme" / checkpoint_key("runs/a", 1)
    gen = next(p for p in d.iterdir() if p.is_dir())
    for p in gen.iterdir():
        p.unlink()
    crc = crc32c((d / "manifest.json").read_bytes())
    tiers = Tiers(cfg)

    async def scan(known) -> list[int]:
        return sorted(await tiers.committed_on("nvme", "runs/a", known=known))

    assert runtime.run(scan(None)) == []
    assert runtime.run(scan(lambda step, c: (step, c) == (1, crc))) == [1]
    assert runtime.run(scan(lambda step, c: (step, c) == (1, crc + 1))) == []
    runtime.run(tiers.close())
