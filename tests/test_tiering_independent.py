"""Exports to different destinations proceed independently: a failing destination backs off
on its own, a pending export may be served by any complete, verified copy (so the fast
tier's retention goes on once a slower tier holds one), and ``daemon --drain --timeout``
ends on time."""

from __future__ import annotations

import json
import os
import time

from tiering_helpers import state

from fmstore import CheckpointManager
from fmstore.config import load_config
from fmstore.tiering.inventory.catalog import EXPORTING, PRESENT, Catalog, Checkpoint, Copy
from fmstore.tiering.policy import policies as pol
from fmstore.tiering.policy.backoff import TierBackoff
from fmstore.tiering.service.daemon import Daemon

TIERS = ["nvme", "lustre", "s3"]


def ck(step):
    return Checkpoint("run", step, step, float(step), 10, 1)


def cp(step, tier, st=PRESENT, verified=1.0):
    return Copy("run", step, tier, st, 10, float(step), float(step), None, verified)


def policies(s3_from=None):
    s3 = {"to": "s3", "every_saves": 1, **({"from": s3_from} if s3_from else {})}
    return pol.from_dict(
        {
            "export": [{"to": "lustre", "every_saves": 1}, s3],
            "retention": {"nvme": {"keep_latest": 1}},
        },
        tiers=TIERS,
    )


def test_a_pending_export_is_served_by_a_verified_copy_on_another_tier():
    """Step 1 waits for S3 (its copy there failing: ``exporting``), Lustre holds a verified
    copy: the NVMe copy beyond keep_latest goes; Lustre's stays (S3's only source then)."""
    s = pol.State(
        checkpoints=[ck(1), ck(2)],
        copies=[
            cp(1, "nvme"),
            cp(1, "lustre"),
            cp(1, "s3", EXPORTING, None),
            cp(2, "nvme"),
            cp(2, "lustre"),
            cp(2, "s3", EXPORTING, None),
        ],
    )
    assert pol.plan_retention(policies(), s) == [pol.Delete("run", 1, "nvme")]
    assert {e.source for e in pol.plan_exports(policies(), s)} == {"nvme"}
    # without a verified copy elsewhere (Lustre's not verified yet), NVMe's stays
    unverified = [
        c if c.tier != "lustre" else cp(c.step, "lustre", verified=None) for c in s.copies
    ]
    assert pol.plan_retention(policies(), pol.State(s.checkpoints, unverified)) == []
    # an export whose rule names its source keeps that copy
    assert pol.plan_retention(policies(s3_from="nvme"), s) == []


def test_tier_backoff_is_per_tier():
    now = [0.0]
    b = TierBackoff(limit=4.0, clock=lambda: now[0])
    assert b.failed("s3") == 1.0 and b.waiting(["nvme", "s3"]) and not b.waiting(["lustre"])
    assert b.next_due() == 1.0
    now[0] = 1.5
    assert not b.waiting(["s3"]) and b.failed("s3") == 2.0 and b.failed("s3") == 4.0
    assert b.failed("s3") == 4.0 and b.largest == 4.0
    b.succeeded(["nvme", "s3"])
    assert not b.waiting(["s3"]) and b.next_due() is None and b.largest == 0.0


def write_config(tmp_path, s3_server, bucket):
    path = tmp_path / "fmstore.toml"
    path.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
        f'[tiers.lustre]\nurl = "{tmp_path / "lustre"}"\n'
        f'[tiers.s3]\nurl = "s3://{bucket}/ckpt"\nendpoint_url = "{s3_server.endpoint_url}"\n'
        f'region = "{s3_server.region}"\naddressing_style = "path"\nmax_attempts = 1\n'
        '[daemon]\ninterval = "30s"\nmax_backoff = "30s"\n'
        '[[policies.export]]\nto = "lustre"\nevery_saves = 1\n'
        '[[policies.export]]\nto = "s3"\nevery_saves = 1\n'
        "[policies.retention.nvme]\nkeep_latest = 2\n"
    )
    return str(path)


def test_a_misspelt_bucket_holds_up_neither_lustre_nor_retention_and_drain_ends_on_time(
    tmp_path, s3_server, s3_bucket, monkeypatch
):
    for k, v in s3_server.env().items():
        if k.startswith("AWS_") and "ENDPOINT" not in k:
            monkeypatch.setenv(k, v)
    cfg_path = write_config(tmp_path, s3_server, s3_bucket + "x")
    cfg = load_config(cfg_path)
    with CheckpointManager("run", config=cfg, run_policies=False) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, state(step, n=100))
    d = Daemon(cfg)
    try:
        # A daemon that has been failing a while: S3's back-off has grown.
        for _ in range(5):
            d.run(max_steps=1)
        assert d.backoff >= 1
        t0 = time.monotonic()
        code = d.run(drain=True, timeout=2)
        elapsed = time.monotonic() - t0
    finally:
        d.close()
    assert code == 3  # S3's exports are left (resumable)
    # 2 s means 2 s: no back-off wait runs past the deadline (it slept 30 s here)
    assert elapsed < 2 + 3, elapsed
    with Catalog.for_state_dir(cfg.state_dir) as c:
        on = {t: {x.step for x in c.copies() if x.tier == t and x.state == PRESENT} for t in TIERS}
        s3 = [x for x in c.copies() if x.tier == "s3"]
    assert on["lustre"] == {1, 2, 3, 4}  # every step reached Lustre
    assert on["nvme"] == {3, 4}  # keep_latest = 2, though S3 still waits for steps 1, 2
    assert on["s3"] == set() and all(x.failures >= 1 for x in s3)
    assert len(os.listdir(tmp_path / "nvme" / "run")) == 2  # and so do the directories


# ---- exports go down the ladder only --------------------------------------------------------


def test_exports_go_down_the_ladder_only():
    """A checkpoint found on S3 alone is not pulled into Lustre; an explicit ``from`` may
    carry it up; an export to S3 reads the fastest tier above it."""
    only_s3 = pol.State(checkpoints=[ck(1)], copies=[cp(1, "s3")])
    assert pol.plan_exports(policies(), only_s3) == []
    up = pol.from_dict({"export": [{"to": "lustre", "from": "s3", "every_saves": 1}]}, tiers=TIERS)
    assert pol.plan_exports(up, only_s3) == [pol.Export("run", 1, "s3", "lustre")]
    # Lustre's copy (a restore's cache) may serve S3; never S3 the tiers above it
    on_lustre = pol.State(checkpoints=[ck(1)], copies=[cp(1, "lustre"), cp(1, "s3")])
    assert pol.plan_exports(policies(), on_lustre) == []


def posix_config(tmp_path, name, export_to):
    """Own NVMe and state directory; Lustre and a slow tier named ``s3`` (a directory
    here) shared with the other config."""
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f'state_dir = "{tmp_path / name / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / name / "nvme"}"\n'
        f'[tiers.lustre]\nurl = "{tmp_path / "lustre"}"\n'
        f'[tiers.s3]\nurl = "{tmp_path / "s3"}"\n'
        f'[[policies.export]]\nto = "{export_to}"\nevery_saves = 1\n'
    )
    return str(path)


def test_a_run_found_only_on_a_shared_tier_is_listed_not_pulled(tmp_path, capsys):
    from fmstore.cli.main import main

    def cli(*args):
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        return code, capsys.readouterr().out

    a = posix_config(tmp_path, "a", "s3")
    with CheckpointManager("other", config=load_config(a), run_policies=False) as mgr:
        mgr.save(1, state(1, n=100))
    assert cli("daemon", "--drain", "--timeout", "60", "--no-http", "--config", a)[0] == 0
    assert os.path.isdir(tmp_path / "s3" / "other")
    # another config, exporting its own runs to Lustre, finds 'other' on S3 only
    b = posix_config(tmp_path, "b", "lustre")
    assert cli("daemon", "--drain", "--timeout", "60", "--no-http", "--config", b)[0] == 0
    assert not os.path.exists(tmp_path / "lustre" / "other")
    code, out = cli("ckpt", "list", "--json", "--config", b)
    assert code == 0
    rows = {(r["root"], r["step"]): r["tiers"] for r in json.loads(out)}
    assert rows[("other", 1)]["s3"]["state"] == "present" and "lustre" not in rows[("other", 1)]


# ---- wait_for_policies with a daemon on the node ---------------------------------------------


def test_wait_for_policies_follows_a_daemon_on_the_node(tmp_path):
    import subprocess
    import sys
    import threading

    path = tmp_path / "fmstore.toml"
    path.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
        f'[tiers.lustre]\nurl = "{tmp_path / "lustre"}"\n'
        '[daemon]\ninterval = "0.2s"\n'
        '[[policies.export]]\nto = "lustre"\nevery_saves = 1\n'
    )
    daemon = subprocess.Popen(
        [sys.executable, "-m", "fmstore", "daemon", "--no-http", "--config", str(path)],
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert daemon.stderr is not None
        for line in daemon.stderr:  # it holds the runner lock once it says it started
            if b'"daemon_start"' in line:
                break
        threading.Thread(target=daemon.stderr.read, daemon=True).start()
        cfg = load_config(path)
        with CheckpointManager("run", config=cfg, policy_interval=30) as mgr:
            mgr.save(1, state(1, n=100))
            t0 = time.monotonic()
            res = mgr.wait_for_policies(timeout=120)
            assert res, res.describe()
            # as soon as the daemon is done: not at the timeout, nor at the helper's interval
            assert time.monotonic() - t0 < 20
            assert mgr.steps("lustre") == [1]
            # without a timeout it returns too (it waited forever)
            mgr.save(2, state(2, n=100))
            out: list = []
            waiter = threading.Thread(target=lambda: out.append(mgr.wait_for_policies()))
            waiter.start()
            waiter.join(120)
            assert out and out[0], out
            assert mgr.steps("lustre") == [1, 2]
    finally:
        daemon.terminate()
        daemon.wait(60)
