"""Tiering of checkpoints in node parts, the rules one process can check: each node's runner
exports its own part, the copy on the shared tier commits when every part is there, crash
points of the protocol, cadence and retention every node decides alike, and the sweep's
idleness and live exports.  The nodes are two state directories and two NVMe directories
beside one shared ``lustre`` directory (and SeaweedFS where S3 is the point); the real
multi-process nodes are in tests/test_tiering_nodes.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from parts_support import EXPORT, NODES, ROOT, Node, ckpt_list, lustre, node_config, save_parts
from prometheus_client import REGISTRY

from fmstore import runtime
from fmstore.checkpoint.dcp.manifest import DcpManifest
from fmstore.checkpoint.dcp.nodes import NODE_ENV
from fmstore.checkpoint.layout import checkpoint_key, new_generation
from fmstore.checkpoint.verify import verify_checkpoint
from fmstore.protocol.env import Env
from fmstore.protocol.records import part_record_key
from fmstore.stores import open_store
from fmstore.tiering.inventory import catalog as cat
from fmstore.tiering.policy.rules import from_config


def test_each_node_exports_its_own_part_and_the_last_one_commits(tmp_path, monkeypatch, capsys):
    raw = save_parts(tmp_path, 10)
    n0, n1 = (Node(tmp_path, n, EXPORT) for n in NODES)
    for n in (n0, n1):
        n.record(10)
    n0.step(monkeypatch)
    # n0's part is there and recorded; no manifest yet, and n0 says whom it waits for.
    gen = DcpManifest.loads(raw).generation
    assert (lustre(tmp_path, 10) / part_record_key(gen, "n0")).exists()
    assert not (lustre(tmp_path, 10) / "manifest.json").exists()
    assert n0.state(10, "lustre") == cat.EXPORTING
    assert "waiting for the parts of n1" in (n0.catalog.copy(ROOT, 10, "lustre").error or "")
    # The daemon's /metrics carries it, labelled with the node.
    assert (
        REGISTRY.get_sample_value(
            "fmstore_parts", {"node": "n0", "tier": "lustre", "state": "waiting"}
        )
        == 1
    )
    assert (
        REGISTRY.get_sample_value("fmstore_parts", {"node": "n0", "tier": "nvme", "state": "held"})
        == 1
    )
    lag = {"node": "n0", "dest": "lustre"}
    assert REGISTRY.get_sample_value("fmstore_node_export_lag_seconds", lag) is not None
    out = ckpt_list(tmp_path, "n0", capsys, monkeypatch)
    assert "exporting parts 1/2 (n0) waiting for n1" in out, out  # in the table
    assert "waiting for the parts of n1" in out, out
    n1.step(monkeypatch)
    # n1 found the set complete: the manifest is the save's, byte for byte, and verifies.
    assert (lustre(tmp_path, 10) / "manifest.json").read_bytes() == raw
    res = runtime.run(verify_checkpoint(open_store(str(lustre(tmp_path, 10)))))
    assert res.ok and res.chunks == 2, res.problems
    assert n1.state(10, "lustre") == cat.PRESENT
    assert not list(lustre(tmp_path, 10).glob("*/export-*.json"))  # leases dropped
    n0.step(monkeypatch)  # n0's next step sees the commit
    assert n0.state(10, "lustre") == cat.PRESENT
    assert "present✓ parts 2/2 (n0,n1)" in ckpt_list(tmp_path, "n0", capsys, monkeypatch)
    assert n0.catalog.copy(ROOT, 10, "lustre").verified is not None


def test_a_node_dying_between_its_part_and_the_commit_is_finished_by_any_node(
    tmp_path, monkeypatch
):
    raw = save_parts(tmp_path, 10)
    gen = DcpManifest.loads(raw).generation
    n0, n1 = (Node(tmp_path, n, EXPORT) for n in NODES)
    for n in (n0, n1):
        n.record(10)
    n0.step(monkeypatch)
    n1.step(monkeypatch)
    # n1 "died" after its part record, before the commit: take the manifest away again.
    (lustre(tmp_path, 10) / "manifest.json").unlink()
    n1.catalog.set_copy(ROOT, 10, "lustre", cat.EXPORTING)
    # A reader sees no checkpoint meanwhile; n0's next step (not n1's) commits.
    n0.step(monkeypatch)
    assert (lustre(tmp_path, 10) / "manifest.json").read_bytes() == raw
    assert (lustre(tmp_path, 10) / part_record_key(gen, "n1")).exists()


def test_a_reader_never_sees_a_manifest_while_a_part_is_missing(tmp_path, monkeypatch):
    save_parts(tmp_path, 10, nodes=("n0", "n1", "n2"))
    nodes = [Node(tmp_path, n, EXPORT) for n in ("n0", "n1", "n2")]
    for n in nodes:
        n.record(10)
    for n in nodes[:2]:
        n.step(monkeypatch)
        n.step(monkeypatch)
        assert not (lustre(tmp_path, 10) / "manifest.json").exists()
    nodes[2].step(monkeypatch)
    assert (lustre(tmp_path, 10) / "manifest.json").exists()


def sweep_lustre(base: Path, grace: float, dry_run: bool = False) -> dict[str, str]:
    from fmstore.tiering.policy.sweep import sweep

    cfg = node_config(base, "n1", EXPORT)
    store = open_store(str(base / "lustre"))
    rep = runtime.run(sweep(cfg, {"lustre": store}, grace=grace, dry_run=dry_run))
    runtime.run(store.close())
    return {o.where.rsplit("/", 1)[-1]: o.action for o in rep.orphans if o.kind == "generation"}


def test_an_export_of_an_old_save_is_young_on_the_shared_tier_and_a_live_one_is_kept(
    tmp_path, monkeypatch
):
    # The save is two hours old (its generation's name and its files' mtimes), and the copy
    # carries the source's mtime: the sweep measured it "idle for 2 h" and removed a part
    # exported a second ago.  Idle is now counted from when the copy was written.
    raw = save_parts(tmp_path, 10, age=7200)
    gen = DcpManifest.loads(raw).generation
    n0 = Node(tmp_path, "n0", EXPORT)
    n0.record(10)
    n0.step(monkeypatch)
    blob = lustre(tmp_path, 10) / gen / "000000.bin"
    assert time.time() - blob.stat().st_mtime > 7000  # the copy kept the source's mtime
    # A live lease (n0 waits for n1's part) keeps it whatever the grace period...
    assert sweep_lustre(tmp_path, grace=0, dry_run=True) == {gen: "kept: live export"}
    # ... and without the lease (its exporter gone), it is young: written just now.
    for lease in (lustre(tmp_path, 10) / gen).glob("export-*.json"):
        lease.unlink()
    assert sweep_lustre(tmp_path, grace=3600, dry_run=True) == {gen: "kept: young"}


def test_a_lease_past_its_ttl_keeps_nothing_and_records_go_with_the_blobs(
    tmp_path, monkeypatch, capsys
):
    from fmstore.protocol.records import ExportLease, lease_key

    ttl, skew = Env().lease_ttl, Env().clock_skew

    raw = save_parts(tmp_path, 10)
    gen = DcpManifest.loads(raw).generation
    n0 = Node(tmp_path, "n0", EXPORT)
    n0.record(10)
    n0.step(monkeypatch)
    # Past the TTL by less than the allowed clock skew: the writer's clock may be behind
    # ours, so its exporter may still be alive (and committing): the sweep keeps it all.
    near = ExportLease("elsewhere", 1, time.time() - ttl - skew / 2)
    (lustre(tmp_path, 10) / lease_key(gen, "n0")).write_bytes(near.dumps())
    assert sweep_lustre(tmp_path, grace=0) == {gen: "kept: live export"}
    # n0's exporter on another host died long ago: its lease was last renewed past the TTL.
    dead = ExportLease("elsewhere", 1, time.time() - ttl - skew - 1)
    (lustre(tmp_path, 10) / lease_key(gen, "n0")).write_bytes(dead.dumps())
    assert sweep_lustre(tmp_path, grace=0) == {gen: "removed"}
    assert not (lustre(tmp_path, 10) / gen).exists() or not any(
        (lustre(tmp_path, 10) / gen).iterdir()
    )


def test_ckpt_gc_keeps_what_a_live_export_on_this_node_writes(tmp_path, monkeypatch, capsys):
    """``fmstore ckpt gc`` consulted no journals: with no grace it removed the blobs of an
    export in flight on its own node."""
    from fmstore import config as fm_config
    from fmstore.cli.main import main
    from fmstore.tiering.copy.journal import Journal

    dst = tmp_path / "lustre" / "run" / "step_000000000010"
    gen = new_generation()
    (dst / gen).mkdir(parents=True)
    (dst / gen / "000000.bin").write_bytes(b"x" * 100)
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[tiers.lustre]\nurl = "{tmp_path / "lustre"}"\n'
    )
    monkeypatch.setenv("FMSTORE_CONFIG", str(cfg))
    fm_config.set_config(None)
    jpath = tmp_path / "state" / "transfers" / "ckpt-x.jsonl"
    jpath.parent.mkdir(parents=True)

    def gc_cli() -> str:
        capsys.readouterr()
        try:
            main(["ckpt", "gc", str(tmp_path / "lustre"), "--older-than", "0"])
        except SystemExit as e:
            assert not e.code
        return capsys.readouterr().out

    async def hold() -> Journal:
        j = await Journal.open(str(jpath), fsync=True, dest=open_store(str(dst)).url)
        await j.flush()  # as the copy's first record does
        return j

    j = runtime.run(hold())
    try:
        out = gc_cli()
        assert "kept (an export writes there now)" in out
        assert (dst / gen / "000000.bin").exists()
    finally:
        runtime.run(j.close())
    gc_cli()  # the copy is gone (its journal released): now it is garbage
    assert not (dst / gen / "000000.bin").exists()


# ---- cadence and retention every node decides alike (pure rules) ------------------------


def _ck(step: int) -> Any:
    return cat.Checkpoint(ROOT, step, step, float(step), 10, 1)


def _cp(step: int, tier: str, st: str = cat.PRESENT, verified: float | None = 1.0) -> Any:
    return cat.Copy(ROOT, step, tier, st, 10, float(step), float(step), None, verified)


def _policies(data: dict[str, Any]) -> Any:
    from fmstore.tiering.policy import policies as pol

    return pol.from_dict(data, tiers=["nvme", "lustre"], node_tiers=["nvme"])


def test_every_seconds_is_refused_for_checkpoints_on_a_node_local_tier():
    from fmstore.errors import ConfigError

    data = {"export": [{"to": "lustre", "every_seconds": "10m"}]}
    with pytest.raises(ConfigError, match="every_seconds cannot be decided alike.*'nvme'"):
        _policies(data)
    with pytest.raises(ConfigError, match="every_seconds"):
        from_config(node_config(Path("/x"), "n0", data))
    from fmstore.tiering.policy import policies as pol

    assert pol.from_dict(data, tiers=["nvme", "lustre"])  # every tier shared: as before


def test_every_saves_counts_only_checkpoints_committed_on_the_shared_tier():
    from fmstore.tiering.policy import policies as pol

    p = _policies({"export": [{"to": "lustre", "every_saves": 2}]})
    steps = [_ck(i) for i in range(1, 7)]
    nvme = [_cp(i, "nvme") for i in range(1, 7)]
    # Node a holds a half-made export of step 1 (a row node b, replaced, never had).
    a = pol.wanted_tiers(p, steps, [*nvme, _cp(1, "lustre", cat.EXPORTING)])
    b = pol.wanted_tiers(p, steps, nvme)
    assert a == b
    assert sorted(k[1] for k, v in a.items() if v) == [2, 4, 6]
    # A committed copy on the destination restarts the count on every node alike.
    c = pol.wanted_tiers(p, steps, [*nvme, _cp(3, "lustre")])
    assert sorted(k[1] for k, v in c.items() if v) == [2, 3, 5]


def test_keep_latest_on_a_node_local_tier_is_the_same_window_on_a_node_that_released():
    from fmstore.tiering.policy import policies as pol

    p = _policies(
        {
            "export": [{"to": "lustre", "every_steps": 10}],
            "retention": {"nvme": {"keep_latest": 2}},
        }
    )
    steps = [_ck(s) for s in (10, 20, 30)]
    shared = [_cp(s, "lustre") for s in (10, 20, 30)]
    a = [_cp(10, "nvme"), _cp(20, "nvme", cat.RELEASED), _cp(30, "nvme")]  # released 20
    b = [_cp(s, "nvme") for s in (10, 20, 30)]
    deletes = []
    for copies in (a, b):
        acts = pol.plan_retention(p, pol.State(steps, [*copies, *shared], now=100.0))
        deletes.append(sorted((d.step, d.tier) for d in acts))
    assert deletes[0] == deletes[1] == [(10, "nvme")]


def test_the_newest_step_is_never_deleted_from_a_node_while_no_shared_tier_holds_it():
    from fmstore.tiering.policy import policies as pol

    p = _policies(
        {
            "export": [{"to": "lustre", "every_steps": 1000}],
            "retention": {"nvme": {"keep_latest": 0}},
        }
    )
    steps = [_ck(10), _ck(20)]
    copies = [_cp(10, "nvme"), _cp(20, "nvme")]
    acts = pol.plan_retention(p, pol.State(steps, copies, now=100.0))
    assert [(d.step, d.tier) for d in acts] == [(10, "nvme")]
    acts = pol.plan_retention(p, pol.State(steps, [*copies, _cp(20, "lustre")], now=100.0))
    assert sorted(d.step for d in acts if d.tier == "nvme") == [10, 20]


# ---- backlog, release, resume -------------------------------------------------------------

BACKLOG = {
    "ladder": ["nvme", "lustre"],
    "export": [{"to": "lustre", "every_steps": 10}],
    "retention": {"lustre": {"keep_latest": 1}},
}


def test_a_superseded_export_removes_this_nodes_part_only_and_every_node_ends_alike(
    tmp_path, monkeypatch
):
    nodes3 = ("n0", "n1", "n2")
    raw10 = save_parts(tmp_path, 10, nodes=nodes3)
    gen10 = DcpManifest.loads(raw10).generation
    n0, n1, n2 = (Node(tmp_path, n, BACKLOG) for n in nodes3)
    for n in (n0, n1, n2):
        n.record(10)
    n0.step(monkeypatch)
    n1.step(monkeypatch)  # n2 is behind: step 10 is not committed
    save_parts(tmp_path, 20, nodes=nodes3)
    for n in (n0, n1, n2):
        n.record(20)
    n0.step(monkeypatch)  # supersedes its export of 10 (lustre keeps 1), exports 20
    d10 = lustre(tmp_path, 10) / gen10
    assert n0.state(10, "lustre") == cat.SUPERSEDED
    # n1's export lease of step 10 is alive (its next attempt may commit, with n0's part
    # counted): n0 leaves its part as it was, to the sweep once no lease is alive.
    assert (d10 / "part-n0.json").exists() and (d10 / "000000.bin").exists()
    # n1's part of step 10 is n1's: a commit of step 10 could still need it.
    assert (d10 / "part-n1.json").exists() and (d10 / "000001.bin").exists()
    n1.step(monkeypatch)
    n2.step(monkeypatch)
    for n in (n0, n1, n2):
        n.step(monkeypatch)
        present = [
            cp.step for cp in n.catalog.copies(ROOT, states=[cat.PRESENT]) if cp.tier == "lustre"
        ]
        assert present == [20], (n.name, present)
    assert not (lustre(tmp_path, 10) / "manifest.json").exists()
    assert (lustre(tmp_path, 20) / "manifest.json").exists()


def test_a_node_releases_its_part_only_once_the_shared_copy_is_committed(tmp_path, monkeypatch):
    pol = {**EXPORT, "release": {"nvme": {"after": "1s"}}}
    save_parts(tmp_path, 10)
    now = [time.time()]
    n0, n1 = (Node(tmp_path, n, pol, clock=lambda: now[0]) for n in NODES)
    for n in (n0, n1):
        n.record(10)
    now[0] += 10  # unused for longer than "after"
    part = tmp_path / "n0" / "nvme" / checkpoint_key(ROOT, 10) / "manifest.json"
    n0.step(monkeypatch)
    n0.step(monkeypatch)
    assert n0.state(10, "nvme") == cat.PRESENT and part.exists()  # n1's part is not there
    n1.step(monkeypatch)  # commits
    n0.step(monkeypatch)  # sees the commit
    n0.step(monkeypatch)
    assert n0.state(10, "nvme") == cat.RELEASED and not part.exists()


def test_a_node_killed_mid_export_resumes_from_its_journal(tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys

    raw = save_parts(tmp_path, 10, size=256 << 10, blobs_per_rank=6)
    gen = DcpManifest.loads(raw).generation
    cfg = tmp_path / "n0.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "n0" / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / "n0" / "nvme"}"\nscope = "node"\n'
        f'[tiers.lustre]\nurl = "{tmp_path / "lustre"}"\n'
        '[policies]\nladder = ["nvme", "lustre"]\n'
        '[[policies.export]]\nto = "lustre"\nevery_steps = 10\n'
        '[daemon]\nconcurrency = 1\nbwlimit = "500KB"\n'
    )
    n0 = Node(tmp_path, "n0", EXPORT)
    n0.record(10)
    env = {**os.environ, "FMSTORE_CONFIG": str(cfg), NODE_ENV: "n0"}
    p = subprocess.Popen(
        [sys.executable, "-m", "fmstore", "daemon", "--once", "--no-http"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    journals = tmp_path / "n0" / "state" / "transfers"
    try:
        # Killed once its journal records a finished blob (bwlimit keeps the rest going).
        while not any(b'"f"' in j.read_bytes() for j in journals.glob("ckpt-*.jsonl")):
            assert p.poll() is None, "the export ended before it could be killed"
            time.sleep(0.01)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    done = [f for f in (lustre(tmp_path, 10) / gen).glob("*.bin")]
    assert done and not (lustre(tmp_path, 10) / gen / "part-n0.json").exists()
    inodes = {f.name: f.stat().st_ino for f in done}
    n0.step(monkeypatch)
    # The blobs the killed run finished were not written again; the part is complete.
    for name, ino in inodes.items():
        assert (lustre(tmp_path, 10) / gen / name).stat().st_ino == ino, name
    assert (lustre(tmp_path, 10) / gen / "part-n0.json").exists()
    assert len(list((lustre(tmp_path, 10) / gen).glob("*.bin"))) == 6


def test_two_nodes_committing_at_once_leave_the_saves_manifest(tmp_path, monkeypatch, s3_server):
    """Both find the set complete and write the manifest: create-only lets one win, the
    other reads back the same bytes (on POSIX and on S3)."""
    import asyncio

    from fmstore.tiering.exports.parts import _Lease, commit_if_complete

    raw = save_parts(tmp_path, 10)
    n0, n1 = (Node(tmp_path, n, EXPORT) for n in NODES)
    for n in (n0, n1):
        n.record(10)
        n.step(monkeypatch)
    manifest = DcpManifest.loads(raw)
    (lustre(tmp_path, 10) / "manifest.json").unlink()  # both died before seeing the commit
    store = open_store(str(lustre(tmp_path, 10)))

    async def race_on(st: Any) -> list[list[str]]:
        leases = [_Lease(st, manifest.generation, n, Env()) for n in NODES]
        return list(
            await asyncio.gather(*(commit_if_complete(st, manifest, raw, x) for x in leases))
        )

    async def race() -> list[list[str]]:
        return await race_on(store)

    assert runtime.run(race()) == [[], []]
    assert (lustre(tmp_path, 10) / "manifest.json").read_bytes() == raw

    # S3: the same through the store's create-only put.
    bucket = s3_server.create_bucket(f"t-parts-{os.getpid()}-{int(time.time())}")
    try:
        s3 = open_store(f"s3://{bucket}/run/step_000000000010", **s3_server.store_options())

        async def copy_and_race() -> list[list[str]]:
            src = lustre(tmp_path, 10)
            for f in src.rglob("*"):
                if f.is_file() and f.name != "manifest.json":
                    await s3.put(str(f.relative_to(src)), f.read_bytes())
            return await race_on(s3)

        assert runtime.run(copy_and_race()) == [[], []]
        assert runtime.run(s3.get("manifest.json")) == raw
        runtime.run(s3.close())
    finally:
        s3_server.delete_bucket(bucket)


def test_the_sweep_stops_before_the_blobs_when_an_exporter_comes_back(tmp_path, monkeypatch):
    """Between removing a generation's records and its blobs the sweep looks again: a lease
    renewed meanwhile keeps the blobs (a node that listed the records before they went may
    be committing)."""
    from fmstore.checkpoint.gc import orphan_generations, remove_generation
    from fmstore.protocol.records import ExportLease, lease_key

    raw = save_parts(tmp_path, 10)
    gen = DcpManifest.loads(raw).generation
    n0 = Node(tmp_path, "n0", EXPORT)
    n0.record(10)
    n0.step(monkeypatch)
    d = lustre(tmp_path, 10) / gen
    for lease in d.glob("export-*.json"):
        lease.unlink()  # its exporter is gone: an orphan
    store = open_store(str(tmp_path / "lustre"))
    gens, _, _ = runtime.run(orphan_generations(store, env=Env()))
    (g,) = gens
    assert not g.exporting
    (d / "export-n1.json").write_bytes(ExportLease("n1", 1, time.time()).dumps())
    assert lease_key(gen, "n1").endswith("export-n1.json")
    assert runtime.run(remove_generation(store, g, Env())) is False
    assert (d / "000000.bin").exists() and not (d / "part-n0.json").exists()


def test_node_names_in_part_records_are_checked_and_escaped_in_ckpt_list(
    tmp_path, monkeypatch, capsys
):
    """A part record's node reaches ``ckpt list``: one holding rich markup crashed it,
    another (under another node's name) faked a complete set of parts."""
    raw = save_parts(tmp_path, 10)
    n0, n1 = (Node(tmp_path, n, EXPORT) for n in NODES)
    for n in (n0, n1):
        n.record(10)
    n0.step(monkeypatch)
    gen = DcpManifest.loads(raw).generation
    good = (lustre(tmp_path, 10) / part_record_key(gen, "n0")).read_text()
    for name, node in (("n9", "[/]"), ("n8", "n1"), ("n7", "n0\n"), ("n6", "..")):
        (lustre(tmp_path, 10) / part_record_key(gen, name)).write_text(
            good.replace('"node":"n0"', f'"node":{json.dumps(node)}')
        )
    out = ckpt_list(tmp_path, "n0", capsys, monkeypatch)
    assert "exporting parts 1/2 (n0)" in out, out


def test_a_drain_that_times_out_names_the_nodes_it_waited_for(tmp_path, monkeypatch, caplog):
    from fmstore.tiering.service.daemon import _gave_up

    save_parts(tmp_path, 10)
    n0 = Node(tmp_path, "n0", EXPORT)
    n0.record(10)
    rep = n0.step(monkeypatch)
    assert rep.waiting_for == ["n1"], rep
    with caplog.at_level("ERROR", logger="fmstore.tiering.service.daemon"):
        _gave_up(5.0, rep)
    line = caplog.records[-1].getMessage()
    assert "drain timed out after 5.0s" in line and "waiting for the parts of node n1" in line


def test_a_node_local_tiers_usage_counts_the_replicas_it_holds(tmp_path, monkeypatch):
    """The replicas of other nodes' parts (``.replicas/``) are space the node's NVMe holds
    and no retention or release removes: its usage says how much, and /metrics shows it."""
    n0 = Node(tmp_path, "n0", EXPORT)
    nvme = tmp_path / "n0" / "nvme"
    rep = nvme / ".replicas" / ROOT / "step_000000000010" / "g1"
    rep.mkdir(parents=True)
    (rep / "000001.bin").write_bytes(b"x" * 5000)
    (rep / "rank-000001.json").write_bytes(b"{}")
    outside = tmp_path / "big"
    outside.write_bytes(b"y" * 100_000)
    (rep / "link").symlink_to(outside)  # counted as the link, never its target
    (nvme / ROOT).mkdir(parents=True)
    (nvme / ROOT / "own.bin").write_bytes(b"z" * 7000)  # the node's own part: not a replica
    u = n0.runner.tiers.usage("nvme")
    assert u is not None and u.replicas == 5002 + len(str(outside))
    assert u.used >= u.replicas
    (tmp_path / "lustre").mkdir(exist_ok=True)
    shared = n0.runner.tiers.usage("lustre")
    assert shared is not None and shared.replicas == 0
    n0.step(monkeypatch)
    assert REGISTRY.get_sample_value("fmstore_tier_replica_bytes", {"tier": "nvme"}) == u.replicas
