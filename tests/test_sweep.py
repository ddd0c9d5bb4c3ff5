"""The orphan sweep (``fmstore gc``, the daemon's sweep): what killed writers leave is
removed, what live writers and committed checkpoints hold is not."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
from stage_data import fm, kill9_when, proxied, s3_env
from tiering_helpers import on_tier

import fmstore
from fmstore import runtime
from fmstore.checkpoint import find_checkpoints
from fmstore.config import from_dict, load_config
from fmstore.format.manifest import Manifest
from fmstore.stores import open_store
from fmstore.stores.posix import TMP_MARK
from fmstore.testing.ckpt_kill import make_state, save_forever, tie
from fmstore.testing.faultproxy import Rule
from fmstore.tiering import metrics as m
from fmstore.tiering.policy.sweep import sweep


@pytest.fixture
def s3env(s3_server, s3_bucket, tmp_path):
    return s3_env(s3_server, s3_bucket, tmp_path)


def _parts_to(home: str, dest: str, field: str | None = None) -> int:
    """Parts journaled by the copies writing under ``dest`` (a URL suffix); with
    ``field="n"``, their bytes."""
    d = os.path.join(home, "state", "transfers")
    n = 0
    for name in os.listdir(d) if os.path.isdir(d) else []:
        with open(os.path.join(d, name), "rb") as f:
            recs = []
            for line in f.read().split(b"\n"):
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    continue
        if any(str(r.get("to", "")).endswith(dest) for r in recs):
            n += sum(r[field] if field else 1 for r in recs if "p" in r)
    return n


def _journals(home: str) -> dict[str, str]:
    """``{destination URL: journal path}`` of the journals in the state directory."""
    d = os.path.join(home, "state", "transfers")
    out = {}
    for name in os.listdir(d) if os.path.isdir(d) else []:
        with open(os.path.join(d, name), "rb") as f:
            for line in f.read().split(b"\n"):
                if line.startswith(b'{"to"'):
                    out[json.loads(line)["to"]] = os.path.join(d, name)
    return out


def _listed(doc: dict) -> list[tuple[str, str]]:
    """``(kind, where)`` of a sweep's orphans; a journal by the last name of the
    destination it was for."""
    return sorted(
        (o["kind"], o["where"].rsplit("/", 1)[-1] if o["kind"] == "journal" else o["where"])
        for o in doc["orphans"]
    )


def _uploads(s3_server, bucket: str) -> list[str]:
    c = s3_server.boto3_client()
    return sorted(u["Key"] for u in c.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def _gc(*args: str, env: dict) -> dict:
    r = fm("gc", *args, "--json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.s3
def test_a_killed_stage_upload_goes_and_a_live_one_stays(s3env, s3_server, tmp_path):
    """Two copies to S3, each with two parts uploaded and the third held by the proxy: one
    killed with SIGKILL, one still running.  A sweep with no grace period aborts the dead
    one's upload and removes its journal; the live one's upload, older than the grace
    period, stays because its journal is held.  Once that copy dies too, it goes."""
    env, home, bucket = s3env["env"], s3env["home"], s3env["bucket"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(40 << 20))
    plan = [
        Rule("stall", method="PUT", path=r"/ds/dead/big\.bin\?", skip=2),
        Rule("stall", method="PUT", path=r"/ds/live/big\.bin\?", skip=2),
    ]
    common = ["--part-size", "8MiB", "--concurrency", "2", "--no-progress", "--shard", "none"]
    # A copy that finished: what it staged must survive every sweep.
    done = tmp_path / "done"
    done.mkdir()
    (done / "small.bin").write_bytes(b"kept" * 1000)
    assert (
        fm("stage", str(done), "s3:done", "--no-progress", "--shard", "none", env=env).returncode
        == 0
    )
    with proxied(s3env, s3_server, plan):
        kill9_when(
            ["stage", str(src), "proxied:dead", *common],
            lambda: _parts_to(home, "/ds/dead") >= 2,
            env=env,
        )
        live = subprocess.Popen(
            [sys.executable, "-m", "fmstore", "stage", str(src), "proxied:live", *common],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **env},
        )
        try:
            while _parts_to(home, "/ds/live") < 2:
                assert live.poll() is None, live.communicate()[1]
                time.sleep(0.05)
            assert _uploads(s3_server, bucket) == ["ds/dead/big.bin", "ds/live/big.bin"]
            journaled = _parts_to(home, "/ds/dead", "n")
            dry = _gc("s3:", "--older-than", "0", "--dry-run", env=env)
            assert _listed(dry) == [("journal", "dead"), ("upload", "dead/big.bin")]
            assert {o["action"] for o in dry["orphans"]} == {"would remove"}
            assert _uploads(s3_server, bucket) == ["ds/dead/big.bin", "ds/live/big.bin"]

            doc = _gc("s3:", "--older-than", "0", "--show-kept", env=env)
            got = {(o["kind"], o["where"]): o for o in doc["orphans"] if o["kind"] != "journal"}
            assert ("journal", "dead") in _listed(doc)
            assert got["upload", "dead/big.bin"]["action"] == "removed"
            # At least the parts the killed run journaled (the server may also keep the
            # bytes of a part cut short by the kill).
            assert got["upload", "dead/big.bin"]["size"] >= journaled > 0
            assert got["upload", "live/big.bin"]["action"] == "kept: live copy"
            assert _uploads(s3_server, bucket) == ["ds/live/big.bin"]
            journals = _journals(home)
            assert not any(d.endswith("/ds/dead") for d in journals)
            assert any(d.endswith("/ds/live") for d in journals)
        finally:
            live.send_signal(signal.SIGKILL)
            live.wait()
    doc = _gc("s3:", "--older-than", "0", env=env)
    assert _listed(doc) == [("journal", "live"), ("upload", "live/big.bin")]
    assert _uploads(s3_server, bucket) == []
    assert not any("/ds/dead" in d or "/ds/live" in d for d in _journals(home))
    assert any(d.endswith("/ds/done") for d in _journals(home))  # a finished copy's stays
    got = s3_server.boto3_client().get_object(Bucket=bucket, Key="ds/done/small.bin")
    assert got["Body"].read() == b"kept" * 1000


@pytest.mark.s3
def test_a_replaced_node_finds_uploads_by_listing(s3env, s3_server, tmp_path):
    """No state directory at all (a new node): an upload a predecessor left is found by
    listing the tier, kept within the grace period, removed after it."""
    env, bucket = s3env["env"], s3env["bucket"]
    c = s3_server.boto3_client()
    up = c.create_multipart_upload(Bucket=bucket, Key="ds/orphan/x.bin")
    c.upload_part(
        Bucket=bucket,
        Key="ds/orphan/x.bin",
        UploadId=up["UploadId"],
        PartNumber=1,
        Body=b"x" * (5 << 20),
    )
    assert not os.path.exists(s3env["home"])
    doc = _gc("s3:", "--show-kept", env=env)  # the default grace period: an hour
    assert [(o["where"], o["action"]) for o in doc["orphans"]] == [("orphan/x.bin", "kept: young")]
    doc = _gc("s3:orphan", "--older-than", "0", env=env)
    assert [(o["kind"], o["where"], o["size"]) for o in doc["orphans"]] == [
        ("upload", "x.bin", 5 << 20)
    ]
    assert doc["bytes"] == 5 << 20
    assert _uploads(s3_server, bucket) == []


def test_a_killed_save_leaves_only_committed_checkpoints_after_a_sweep(tmp_path):
    """``fmstore.save`` in a loop, killed with SIGKILL: a sweep with no grace period leaves
    exactly the committed checkpoints (their manifests and the blobs they name), which still
    load bit for bit, and counts what it removed in the metrics."""
    root = tmp_path / "nvme"
    root.mkdir()
    # A generation no manifest names, as a crash mid-save leaves it, planted so the sweep
    # surely has one to remove besides whatever the kill left.
    planted = root / "step-999999" / "g0000000000ff-deadbeef"
    planted.mkdir(parents=True)
    (planted / "000000.bin").write_bytes(b"x" * 1000)
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=save_forever, args=(str(root),))
    child.start()
    try:
        while not (root / "step-000003" / "manifest.json").exists():
            assert child.is_alive()
            time.sleep(0.01)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    committed = find_checkpoints(str(root))
    config = from_dict({"tiers": {"nvme": {"url": str(root)}}, "state_dir": str(tmp_path / "st")})
    before = {k: m.ORPHANS_REMOVED.labels("nvme", k)._value.get() for k in ("generation", "temp")}
    store = open_store(str(root))
    rep = runtime.run(sweep(config, {"nvme": store}, grace=0))
    assert not rep.errors
    removed = {k: sum(1 for o in rep.removed if o.kind == k) for k in before}
    assert removed["generation"] >= 1
    for k, n in removed.items():
        assert m.ORPHANS_REMOVED.labels("nvme", k)._value.get() == before[k] + n
    assert find_checkpoints(str(root)) == committed
    referenced = set()
    for p in committed:
        man = Manifest.loads((root / p / "manifest.json").read_bytes())
        referenced.add(os.path.join(p, "manifest.json"))
        referenced.update(os.path.join(p, man.generation, b.name) for b in man.blobs)
    left = {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}
    left = {f for f in left if not f.endswith(".fmstore-lock")}
    assert left == referenced
    assert not any(TMP_MARK in f for f in left)
    newest = max(p for p in committed if p.startswith("step-"))
    got = fmstore.load(str(root / newest))
    want = tie(make_state(int(newest.split("-")[1])))
    assert got["step"] == want["step"]
    assert all(
        got["model"][k].view(-1).to(float).equal(want["model"][k].view(-1).to(float))
        for k in want["model"]
    )


# ---- the daemon killed mid-export, then started again with no grace period --------------


def _daemon_config(tmp_path, s3: str, daemon: str) -> str:
    """nvme and lustre directories and ``s3`` (a tier table's body); every save exported
    to lustre and to s3."""
    base = tmp_path
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f"""
state_dir = "{base}/state"
[tiers.nvme]
url = "{base}/nvme"
[tiers.lustre]
url = "{base}/lustre"
[tiers.s3]
{s3}
[[policies.export]]
to = "lustre"
every_saves = 1
[[policies.export]]
to = "s3"
every_saves = 1
[daemon]
interval = "0.05s"
{daemon}
"""
    )
    return str(cfg)


def _save_big(cfg: str) -> None:
    """One checkpoint of ~72 MiB (one blob above the multipart threshold) on nvme."""
    import torch

    with fmstore.CheckpointManager("run", config=load_config(cfg), run_policies=False) as mgr:
        mgr.save(1, {"w": torch.randn(18 << 20, generator=torch.Generator().manual_seed(1))})
        mgr.wait()


def _daemon(cfg: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fmstore", "daemon", "--config", cfg, "--no-http", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _temp_files(root) -> list[str]:
    return [f for _, _, fs in os.walk(root) for f in fs if f.startswith(TMP_MARK)]


def _drain_and_sweep_events(cfg: str, env: dict | None = None) -> list[dict]:
    p = _daemon(cfg, "--drain", "--timeout", "240", env=env)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    return [e for e in map(json.loads, err.splitlines()) if e.get("event") == "sweep"]


def _kill_when(p: subprocess.Popen, ready) -> None:
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert p.poll() is None, p.communicate()[1]
            assert time.monotonic() < deadline, "not ready in time"
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()


@pytest.mark.s3
def test_a_daemon_killed_mid_export_to_s3_leaves_no_upload(
    tmp_path, s3_server, s3_bucket, monkeypatch
):
    from fmstore.testing.faultproxy import FaultProxy

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)

    with FaultProxy(s3_server.endpoint_url) as proxy:
        s3 = (
            f'url = "s3://{s3_bucket}/fm"\nendpoint_url = "{proxy.endpoint_url}"\n'
            'addressing_style = "path"\nregion = "us-east-1"\nmax_attempts = 20'
        )
        cfg = _daemon_config(tmp_path, s3, 'orphan_grace = "0"')
        _save_big(cfg)
        # Lustre first, then S3, whose upload passes one part and holds the next.
        proxy.set_plan([Rule("stall", method="PUT", path=r"/fm/run/.*\?.*partNumber", skip=1)])
        _kill_when(
            _daemon(cfg),
            lambda: proxy.injected["stall"] >= 1,
        )
        assert _uploads(s3_server, s3_bucket)  # the killed export's upload is there
        proxy.clear()
        sweeps = _drain_and_sweep_events(cfg)
        assert sweeps and sweeps[0]["removed"] >= 1 and not sweeps[0]["errors"]
        assert _uploads(s3_server, s3_bucket) == []
        assert not _temp_files(tmp_path / "lustre")
        config = load_config(cfg)
        assert on_tier(config, "s3", "run") == {1: True}
        assert on_tier(config, "lustre", "run") == {1: True}


def test_a_daemon_killed_mid_export_to_lustre_leaves_no_temp_file(tmp_path):
    s3 = f'url = "{tmp_path}/s3"'
    cfg = _daemon_config(tmp_path, s3, 'orphan_grace = "0"\nbwlimit = "4MB"\nconcurrency = 1')
    _save_big(cfg)
    # ~72 MiB at 4 MB/s: the copy to lustre takes ~18 s after its temp file appears.
    _kill_when(_daemon(cfg), lambda: _temp_files(tmp_path / "lustre"))
    assert _temp_files(tmp_path / "lustre")
    # The limit only kept the killed copy open; the drain copies at full speed.
    _daemon_config(tmp_path, s3, 'orphan_grace = "0"\nconcurrency = 1')
    sweeps = _drain_and_sweep_events(cfg)
    assert sweeps and sweeps[0]["removed"] >= 1 and not sweeps[0]["errors"]
    assert not _temp_files(tmp_path / "lustre") and not _temp_files(tmp_path / "s3")
    config = load_config(cfg)
    assert on_tier(config, "lustre", "run") == {1: True}
    assert on_tier(config, "s3", "run") == {1: True}


def test_steps_moved_aside_go_after_the_grace_period(tmp_path):
    """The steps a restore fell back from (``.aside/TOKEN`` on a node-local tier) are kept
    while the token is younger than the grace period and removed after it; a name that is
    not a token, and what a link points to, stay."""
    from fmstore.tiering.inventory import aside

    root = tmp_path / "nvme"
    now_ms = int(time.time() * 1000)
    old = root / ".aside" / f"{now_ms - 7_200_000:013d}-0123abcd"
    young = root / ".aside" / f"{now_ms:013d}-89abcdef"
    stranger = root / ".aside" / "notatoken"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"k")
    for d in (old, young, stranger):
        step = d / "run" / "step_000000000080" / "g0000000000ff-deadbeef"
        step.mkdir(parents=True)
        (step / "000000.bin").write_bytes(b"x" * 100)
    (old / "link").symlink_to(outside)
    config = from_dict({"tiers": {"nvme": {"url": str(root)}}, "state_dir": str(tmp_path / "st")})
    rep = runtime.run(sweep(config, {"nvme": open_store(str(root))}, grace=3600))
    assert not rep.errors
    got = {o.where: o.action for o in rep.orphans if o.kind == "aside"}
    assert got == {
        f".aside/{old.name}": "removed",
        f".aside/{young.name}": "kept: young",
    }
    assert not old.exists() and young.exists() and stranger.exists()
    assert (outside / "keep.bin").read_bytes() == b"k"
    assert aside.moved_aside(open_store(str(root)), now=time.time())[0][1] == 100
