"""Failures nobody hears about, heard: a misspelt bucket, refused credentials and a read-only
identity are named by ``daemon --check`` (probed once per node), failing exports are logged
loud, counted by the error's class, shown by ``ckpt list``, fail ``daemon --once``, reach
the training process through its policy helper, ``wait_for_policies`` and ``close()``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time

import pytest
import yaml
from tiering_helpers import state

from fmstore import CheckpointManager
from fmstore.config import Config, load_config
from fmstore.tiering.inventory.catalog import SCHEMA_VERSION, Catalog
from fmstore.tiering.policy.failures import ActionFailure, FailureLog, warn_due
from fmstore.tiering.policy.policies import from_config
from fmstore.tiering.probe import PROBE_PREFIX, probe_once_per_node
from fmstore.tiering.service.helper import PolicyHelper

ENV = {**os.environ, "PYTHONPATH": os.getcwd()}
DEPLOY = os.path.join(os.path.dirname(__file__), "..", "deploy")


def write_config(tmp_path, s3_server, bucket: str, extra: str = "") -> str:
    """nvme (a directory) exporting every save to ``s3://BUCKET/ckpt``; no retries to wait
    through: a missing bucket is no transient error anyway."""
    path = tmp_path / "fmstore.toml"
    path.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
        f'[tiers.s3]\nurl = "s3://{bucket}/ckpt"\nendpoint_url = "{s3_server.endpoint_url}"\n'
        f'region = "{s3_server.region}"\naddressing_style = "path"\nmax_attempts = 1\n'
        f"[policies]\n{extra}\n"
        '[[policies.export]]\nto = "s3"\nevery_saves = 1\n'
    )
    return str(path)


@pytest.fixture
def aws_env(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        if k.startswith("AWS_") and "ENDPOINT" not in k:
            monkeypatch.setenv(k, v)
    return monkeypatch


def cli(capsys, *args: str) -> tuple[int, str, str]:
    from fmstore.cli.main import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict):
                out.append(doc)
    return out


class Records(logging.Handler):
    """Records of the ``fmstore`` loggers, whatever handlers a daemon run left behind."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@contextlib.contextmanager
def fmstore_records():
    h = Records()
    lg = logging.getLogger("fmstore")
    old = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    try:
        yield h
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)


def failures_metric(reason: str) -> float:
    from prometheus_client import REGISTRY

    labels = {"src": "nvme", "dst": "s3", "reason": reason}
    return REGISTRY.get_sample_value("fmstore_tier_export_failures_total", labels) or 0.0


# ---- item 1: the tier check ----------------------------------------------------------------


def test_check_names_a_misspelt_bucket_and_passes_the_right_one_leaving_nothing(
    tmp_path, capsys, s3_server, s3_bucket, aws_env
):
    bad = write_config(tmp_path, s3_server, s3_bucket + "x")
    code, out, err = cli(capsys, "daemon", "--check", "--config", bad)
    assert code == 1 and out == ""
    assert f"bucket '{s3_bucket}x' does not exist" in err
    assert "tier s3: read failed" in err and "[tiers.s3] url" in err
    # the config it checked, then the error
    assert err.startswith(f"config: {bad} (named by --config)\nerror:"), err

    good = write_config(tmp_path, s3_server, s3_bucket)
    code, out, err = cli(capsys, "daemon", "--check", "--config", good)
    assert code == 0, err
    assert out.startswith("ok: tiers nvme (read+write), s3 (read+write)")
    # the probe object went again (checked through a plain client, not through fmstore)
    listing = s3_server.boto3_client().list_objects_v2(Bucket=s3_bucket)
    assert listing.get("KeyCount", 0) == 0
    assert not os.path.exists(tmp_path / "nvme" / PROBE_PREFIX)


def test_check_names_refused_credentials_and_a_read_only_identity(
    tmp_path, capsys, s3_server, s3_bucket, aws_env
):
    cfg = write_config(tmp_path, s3_server, s3_bucket)
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    code, _, err = cli(capsys, "daemon", "--check", "--config", cfg)
    assert code == 1 and "tier s3: read failed" in err and "AWS_ACCESS_KEY_ID" in err

    aws_env.setenv("AWS_ACCESS_KEY_ID", s3_server.readonly_access_key)
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", s3_server.readonly_secret_key)
    code, _, err = cli(capsys, "daemon", "--check", "--config", cfg)
    assert code == 1 and "tier s3: write failed" in err and "must allow writes" in err
    assert "tier nvme" not in err  # the local tier is fine
    # an export under those credentials fails, counted by the error's class
    save_one(load_config(cfg))
    before = failures_metric("PermissionDenied")
    code, _, err = cli(capsys, "daemon", "--once", "--no-http", "--config", cfg)
    failed = [d for d in json_lines(err) if d.get("event") == "export_failed"]
    assert code == 1 and failed[0]["reason"] == "PermissionDenied"
    assert failures_metric("PermissionDenied") == before + 1


def test_a_node_probes_once_however_many_processes_start(tmp_path):
    """Four processes start at once (ranks starting their policy helpers): one probes,
    the others take its fresh result from the state directory."""
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
        f'[tiers.lustre]\nurl = "{tmp_path / "lustre"}"\n'
        '[[policies.export]]\nto = "lustre"\nevery_saves = 1\n'
    )
    # a probe object left by a process killed between its write and its delete, long ago
    stale = tmp_path / "nvme" / PROBE_PREFIX / "node-1-dead"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    code = (
        "import sys, json; from fmstore.config import load_config; "
        "from fmstore.tiering.policy.policies import from_config; "
        "from fmstore.tiering.probe import probe_once_per_node; "
        "c = load_config(sys.argv[1]); r = probe_once_per_node(c, from_config(c)); "
        "print(json.dumps([r.cached, r.ok]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(cfg)], stdout=subprocess.PIPE, text=True, env=ENV
        )
        for _ in range(4)
    ]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert sorted(results) == [[False, True]] + [[True, True]] * 3
    # both tiers are written (write tier, export destination): created, probed, left
    # clean, the stale probe object removed
    for tier in ("nvme", "lustre"):
        assert os.listdir(tmp_path / tier) == []
    config = load_config(str(cfg))
    assert probe_once_per_node(config, from_config(config), force=True).cached is False


# ---- items 2 and 4: the daemon, its metrics and ckpt list ---------------------------------


def save_one(config: Config, step: int = 1) -> None:
    with CheckpointManager("run", config=config, run_policies=False) as mgr:
        mgr.save(step, state(step, n=100))


def test_failing_export_is_loud_counted_listed_and_fails_once(
    tmp_path, capsys, s3_server, s3_bucket, aws_env
):
    from prometheus_client import REGISTRY

    cfg = write_config(tmp_path, s3_server, s3_bucket + "x")
    save_one(load_config(cfg))
    before = failures_metric("NotFound")

    code, _, err = cli(capsys, "daemon", "--once", "--no-http", "--config", cfg)
    assert code == 1
    lines = json_lines(err)
    failed = [d for d in lines if d.get("event") == "export_failed"]
    assert len(failed) == 1 and failed[0]["level"] == "warning"
    assert failed[0]["reason"] == "NotFound" and failed[0]["failures"] == 1
    assert "does not exist" in failed[0]["error"]
    assert not [d for d in lines if d.get("level") == "info" and "error" in d]
    assert failures_metric("NotFound") == before + 1

    code, _, err = cli(
        capsys, "daemon", "--drain", "--timeout", "0.5", "--no-http", "--config", cfg
    )
    assert code == 3
    lines = json_lines(err)
    again = [d for d in lines if d.get("event") == "export_failed"]
    assert again[0]["level"] == "error" and again[0]["failures"] == 2  # repeated: error
    assert [d for d in lines if d.get("event") == "drain_timeout"][0]["level"] == "error"
    assert failures_metric("NotFound") >= before + 2
    assert REGISTRY.get_sample_value("fmstore_tier_export_failing_seconds", {"dst": "s3"}) > 0

    code, out, _ = cli(capsys, "ckpt", "list", "--config", cfg)
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("failing run step 1 → s3"))
    assert "failures, last at" in line and "UTC" in line
    assert "does not exist" in out.replace("\n", " ")
    code, out, _ = cli(capsys, "ckpt", "list", "--json", "--config", cfg)
    s3 = json.loads(out)[0]["tiers"]["s3"]
    assert s3["state"] == "exporting" and s3["failures"] >= 2
    assert "does not exist" in s3["error"] and s3["error_at"] > 0

    # the bucket fixed: the export goes through, and the failure record is cleared
    fixed = write_config(tmp_path, s3_server, s3_bucket)
    code, _, err = cli(capsys, "daemon", "--once", "--no-http", "--config", fixed)
    assert code == 0, err
    with Catalog.for_state_dir(load_config(fixed).state_dir) as c:
        cp = c.copy("run", 1, "s3")
        assert cp is not None and cp.state == "present" and cp.failures == 0
        assert c.failing() == []


# ---- item 3: the training process hears it --------------------------------------------------


def test_training_process_is_warned_and_told_why_and_what_to_run(
    tmp_path, s3_server, s3_bucket, aws_env
):
    cfg = load_config(write_config(tmp_path, s3_server, s3_bucket + "x", "warn_after_failures = 2"))
    assert from_config(cfg).warn_after_failures == 2
    with fmstore_records() as rec:
        mgr = CheckpointManager("run", config=cfg, policy_interval=0.2)
        try:
            mgr.save(1, state(1, n=100)).result()
            helper = mgr._background
            assert isinstance(helper, PolicyHelper)
            deadline = time.monotonic() + 120
            while not any("has failed 2 times" in w for w in helper.warnings):
                assert time.monotonic() < deadline, helper.warnings
                time.sleep(0.05)
            res = mgr.wait_for_policies(timeout=0.2)
            assert not res
            assert res.pending_steps == [1] and res.pending == ((1, "s3"),)
            assert res.last_error is not None and "does not exist" in res.last_error
            assert "step 1 not yet exported to s3" in res.describe()
            # without a timeout it does not wait forever on an export that keeps failing:
            # it gives up once the export has failed again (the call pokes the helper)
            res = mgr.wait_for_policies(timeout=600)
            assert not res and res.reason == "an export keeps failing"
            assert res.failing[0].failures >= 3 and res.pending_steps == [1]
        finally:
            mgr.close()
    warned = rec.at(logging.WARNING)
    # the helper's tier check at start, the export's failures, and close() naming the fix
    assert any("fmstore tier check: tier s3: read failed" in w for w in warned), warned
    drain = f"fmstore -c {cfg.source} daemon --drain"  # the config this process used
    assert any("has failed 2 times" in w and drain in w for w in warned), warned
    closing = [w for w in warned if "at close" in w]
    assert len(closing) == 1 and "(step 1)" in closing[0]
    assert f"run `{drain}`" in closing[0] and "does not exist" in closing[0]


def test_wait_for_policies_is_truthy_when_done_and_close_is_quiet(tmp_path):
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
        f'[tiers.lustre]\nurl = "{tmp_path / "lustre"}"\n'
        '[[policies.export]]\nto = "lustre"\nevery_saves = 1\n'
    )
    config = load_config(str(cfg))
    with (
        fmstore_records() as rec,
        CheckpointManager("run", config=config, run_policies="thread") as m,
    ):
        m.save(1, state(1, n=100))
        res = m.wait_for_policies(timeout=120)
        assert res and res.pending == () and res.last_error is None
    assert not [w for w in rec.at(logging.WARNING) if "at close" in w]


# ---- pieces -----------------------------------------------------------------------------------


def test_repeated_failures_are_errors_rate_limited():
    now = [0.0]
    log = FailureLog(every=60.0, clock=lambda: now[0])

    def fail(n: int) -> None:
        log.failed(ActionFailure("export", "run", 1, "nvme", "s3", "NotFound", "gone", n))

    with fmstore_records() as rec:
        for n in range(1, 6):
            fail(n)
            now[0] += 1.0
        now[0] += 60.0
        fail(6)
    levels = [(r.levelno, r.getMessage()) for r in rec.records]
    assert [lv for lv, _ in levels] == [logging.WARNING, logging.ERROR, logging.ERROR]
    assert "has failed once" in levels[0][1] and "has failed 2 times" in levels[1][1]
    assert "has failed 6 times" in levels[2][1] and "(3 more failures" in levels[2][1]
    assert [n for n in range(1, 30) if warn_due(n, 3)] == [3, 6, 12, 24]


def test_a_schema_1_catalog_is_migrated_in_place(tmp_path):
    path = tmp_path / "state" / "catalog.sqlite3"
    path.parent.mkdir()
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema', '1');
        CREATE TABLE copies (root TEXT NOT NULL, step INTEGER NOT NULL, tier TEXT NOT NULL,
            state TEXT NOT NULL, bytes INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL,
            updated REAL NOT NULL, last_access REAL, verified REAL,
            attempts INTEGER NOT NULL DEFAULT 0, error TEXT, PRIMARY KEY (root, step, tier));
        INSERT INTO copies VALUES ('run', 1, 's3', 'exporting', 0, 1, 1, 1, NULL, 2, 'old');
        """
    )
    db.commit()
    db.close()
    with Catalog.for_state_dir(str(tmp_path / "state")) as c:
        cp = c.copy("run", 1, "s3")
        assert cp is not None and cp.error == "old" and cp.failures == 0 and cp.attempts == 2
        after = c.record_failure("run", 1, "s3", "bucket gone")
        assert after.failures == 1 and after.error_at == after.failing_since
        assert c.failing() == [after]
        # the next attempt keeps the record (and the error) until it ends
        c.set_copy("run", 1, "s3", "exporting", count_attempt=True)
        again = c.copy("run", 1, "s3")
        assert again is not None and (again.failures, again.error) == (1, "bucket gone")
        c.set_copy("run", 1, "s3", "present")
        assert c.failing() == [] and c.copy("run", 1, "s3").error_at is None  # type: ignore[union-attr]
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)
    db.close()


def test_alerting_rules_name_real_metrics_and_pass_promtool():
    from prometheus_client import REGISTRY

    import fmstore.metrics  # noqa: F401  (registers the store metrics)
    import fmstore.tiering.metrics  # noqa: F401

    path = os.path.join(DEPLOY, "prometheus", "fmstore-alerts.yml")
    with open(path) as f:
        doc = yaml.safe_load(f)
    names = set()
    for fam in REGISTRY.collect():  # a labelled family without children has no samples
        names.update(fam.name + suffix for suffix in ("", "_total", "_bucket", "_sum", "_count"))
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {"FmstoreExportFailing", "FmstoreDaemonDown"}
    for r in rules:
        used = set(re.findall(r"\b(fmstore_[a-z_]+)", r["expr"]))
        assert used and used <= names, (r["alert"], used - names)
        assert r["annotations"]["summary"] and r["labels"]["severity"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (make setup-prometheus)")
    res = subprocess.run([promtool, "check", "rules", path], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
