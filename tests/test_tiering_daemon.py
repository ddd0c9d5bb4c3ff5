"""The tiering daemon: start-up validation, /metrics and /healthz, SIGTERM, kill -9 at random
moments, S3 down through the fault proxy, and the ckpt list / verify --all-tiers commands."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiering_helpers import on_tier, posix_config, state, with_tier

from fmstore import CheckpointManager
from fmstore.config import Config
from fmstore.testing.seaweed import free_ports
from fmstore.tiering.inventory import catalog as cat
from fmstore.tiering.inventory.catalog import Catalog
from fmstore.tiering.policy.policies import Supersede, from_config, plan
from fmstore.tiering.policy.runner import PolicyRunner
from fmstore.tiering.service import priority
from fmstore.tiering.service.daemon import Daemon, DaemonSettings

ENV = {**os.environ, "PYTHONPATH": os.getcwd()}


def write_toml(path, base: str, policies: str, daemon: str = "") -> str:
    text = f"""
state_dir = "{base}/state"
[tiers.nvme]
url = "{base}/nvme"
[tiers.lustre]
url = "{base}/lustre"
[tiers.s3]
url = "{base}/s3"
[policies]
{policies}
[daemon]
{daemon}
"""
    path.write_text(text)
    return str(path)


def fmstore_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fmstore", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run the fmstore CLI in this process (no interpreter start-up); (exit code, out, err)."""
    from fmstore.cli.main import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def drain(config: Config, timeout: float = 120) -> int:
    """Run the policies in this process until every one is satisfied."""
    d = Daemon(config, settings=DaemonSettings(port=0, interval=0.05))
    try:
        return d.run(drain=True, timeout=timeout)
    finally:
        d.close()


def poll(fn, timeout: float = 60.0, every: float = 0.1):
    """Call ``fn`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = fn()
        except OSError:
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(every)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---- start-up validation -------------------------------------------------------------------

BAD = [
    ('[[policies.export]]\nto = "tape"\nevery_saves = 1', "tier 'tape', which is not configured"),
    ('write_tier = "ram"', "write_tier names tier 'ram'"),
    ("[policies.retention.nvme]\nkeep_latest = 0", "its own last copy"),
    ('[policies.release.nvme]\nafter = "1h"', "no export rule copies checkpoints there"),
]


@pytest.mark.parametrize(("policies", "message"), BAD)
def test_bad_config_is_refused_at_start_up_before_any_data_moves(
    tmp_path, capsys, policies, message
):
    base = str(tmp_path / "d")
    cfg = write_toml(tmp_path / "fmstore.toml", base, policies)
    code, _, err = cli(capsys, "daemon", "--config", cfg, "--no-http")
    assert code == 1 and message in err
    assert not os.path.exists(base)  # no state dir, no tier directory was created
    code, _, err = cli(capsys, "daemon", "--check", "--config", cfg)
    assert code == 1 and message in err


def test_bad_config_fails_the_real_command_with_exit_1(tmp_path):
    cfg = write_toml(tmp_path / "f.toml", str(tmp_path / "d"), BAD[0][0])
    r = fmstore_cli("daemon", "--config", cfg)
    assert r.returncode == 1 and BAD[0][1] in r.stderr and r.stderr.startswith("error:")


@pytest.mark.parametrize(
    ("daemon", "message"),
    [("prot = 1", "unknown key 'prot'"), ('priority = "high"', "priority must be one of")],
)
def test_bad_daemon_section_is_refused(tmp_path, capsys, daemon, message):
    cfg = write_toml(tmp_path / "f.toml", str(tmp_path / "d"), "", daemon=daemon)
    code, _, err = cli(capsys, "daemon", "--check", "--config", cfg)
    assert code == 1 and message in err


# ---- a running daemon --------------------------------------------------------------------------

POLICIES = """
[[policies.export]]
to = "lustre"
every_saves = 1
[[policies.export]]
to = "s3"
every_saves = 2
[policies.retention.nvme]
keep_latest = 2
"""


def save_some(config: Config, steps, n: int = 1000) -> None:
    with CheckpointManager("run", config=config, run_policies=False) as mgr:
        for s in steps:
            mgr.save(s, state(s, n=n))


def test_daemon_exports_serves_metrics_and_health_and_exits_0_on_sigterm(tmp_path):
    base = str(tmp_path)
    (port,) = free_ports(1)
    cfg_path = write_toml(
        tmp_path / "fmstore.toml", base, POLICIES, daemon=f'port = {port}\ninterval = "0.2s"'
    )
    from fmstore.config import load_config

    config = load_config(cfg_path)
    save_some(config, [1, 2, 3, 4])
    p = subprocess.Popen(
        [sys.executable, "-m", "fmstore", "daemon", "--config", cfg_path],
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        health = poll(
            lambda: json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").read())
        )
        assert health["status"] == "ok" and health["pid"] == p.pid
        # its copying runs on idle CPU and I/O ([daemon] priority, default "idle")
        assert priority.current(p.pid) == {"nice": 19, "idle_scheduler": True, "io_class": "idle"}

        def settled():
            m = scrape(port)
            done = m.get(
                ("fmstore_tier_copies_total", (("dst", "s3"), ("outcome", "ok"), ("src", "nvme"))),
                0,
            )
            lag = m.get(("fmstore_tier_export_lag_seconds", ()), -1)
            return (
                m
                if done >= 2
                and lag == 0
                and m.get(("fmstore_tier_queue_depth", (("action", "delete"),))) == 0
                else None
            )

        m = poll(settled)
        assert m[("fmstore_tier_copy_bytes_total", (("dst", "lustre"), ("src", "nvme")))] > 0
        assert m[("fmstore_tier_copy_seconds_count", (("dst", "lustre"), ("src", "nvme")))] == 4
        assert m[("fmstore_tier_bytes", (("tier", "lustre"),))] > 0
        assert m[("fmstore_daemon_up", ())] == 1
        assert all(
            name.startswith("fmstore_") or name.startswith(("python_", "process_")) for name, _ in m
        )
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 0
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    kinds = [e.get("event") for e in events]
    assert "daemon_start" in kinds and "export_done" in kinds and kinds[-1] == "daemon_stop"
    assert on_tier(config, "lustre", "run") == {1: True, 2: True, 3: True, 4: True}
    assert on_tier(config, "s3", "run") == {2: True, 4: True}
    assert on_tier(config, "nvme", "run") == {3: True, 4: True}


def test_a_second_daemon_on_the_same_state_dir_is_refused(tmp_path, capsys):
    cfg = write_toml(tmp_path / "f.toml", str(tmp_path), "")
    os.makedirs(tmp_path / "state")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import filelock, sys; l = filelock.FileLock(sys.argv[1]); l.acquire(); "
            "print('held', flush=True); sys.stdin.read()",
            str(tmp_path / "state" / "runner.lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        code, _, err = cli(capsys, "daemon", "--config", cfg, "--no-http")
        assert code == 1 and "another fmstore daemon" in err
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)


# ---- kill -9 at random moments ------------------------------------------------------------------

KILL_POLICIES = """
[[policies.export]]
to = "lustre"
every_saves = 1
[[policies.export]]
to = "s3"
every_saves = 2
[policies.retention.nvme]
keep_latest = 1
[policies.retention.lustre]
keep_latest = 3
"""


def complete_copies(config: Config, steps) -> dict[int, list[str]]:
    """step -> tiers holding a committed copy that passes every checksum (on the tiers)."""
    found = {s: [] for s in steps}
    for tier in ("nvme", "lustre", "s3"):
        for step, ok in on_tier(config, tier, "run").items():
            if ok:
                found.setdefault(step, []).append(tier)
    return found


def _daemon_child(cfg_path: str, ready: str) -> None:
    """A daemon in a child of the forkserver (which imported fmstore once for all trials)."""
    from fmstore.config import load_config
    from fmstore.tiering.service.daemon import Daemon, settings_from_config

    config = load_config(cfg_path)
    d = Daemon(config, settings=settings_from_config(config))
    with open(ready, "w") as f:
        f.write(str(os.getpid()))
    d.run()


def work_left(config: Config) -> bool:
    """Whether the policies still ask for a copy or a delete (the daemon's own plan; a
    superseded export is only a catalog record)."""
    with Catalog.for_state_dir(config.state_dir) as c:
        runner = PolicyRunner(config, from_config(config), c)
        return any(not isinstance(a, Supersede) for a in plan(runner.policies, runner.state()))


def busy_copies(config: Config) -> set[tuple]:
    """Copies being exported or deleted, with when that began."""
    with Catalog.for_state_dir(config.state_dir) as c:
        busy = c.copies("run", states=[cat.EXPORTING, cat.DELETING])
        return {(b.step, b.tier, b.state, b.updated) for b in busy}


def test_kill_9_of_the_daemon_at_random_moments_loses_nothing(tmp_path):
    """Eight kills (``make test``): every one of them lands while the work is far from done
    (8 saves ask for about 24 copies and deletes), so each is a kill mid-copy or mid-delete
    that the next daemon must resume; the long schedule (``make test-chaos``) runs 24, the
    later ones when little or no work is left."""
    _kill_9_schedule(tmp_path, trials=8)


@pytest.mark.skipif(
    os.environ.get("FMSTORE_CHAOS") != "1", reason="the long schedule: make test-chaos"
)
def test_kill_9_of_the_daemon_at_random_moments_loses_nothing_long(tmp_path):
    _kill_9_schedule(tmp_path, trials=24)


def _kill_9_schedule(tmp_path, trials: int) -> None:
    import multiprocessing as mp

    base = str(tmp_path)
    cfg_path = write_toml(
        tmp_path / "fmstore.toml",
        base,
        KILL_POLICIES,
        daemon='interval = "0.05s"\nbwlimit = "4MB"\nconcurrency = 2',
    )
    from fmstore.config import load_config

    config = load_config(cfg_path)
    steps = list(range(1, 9))
    # ~400 KB per checkpoint at 4 MB/s: every copy takes ~0.1 s, so kills land mid-copy.
    save_some(config, steps, n=100_000)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["fmstore.tiering.service.daemon", "fmstore.checkpoint"])
    rng = random.Random(1234)
    interrupted = 0
    for trial in range(trials):
        ready = str(tmp_path / f"ready-{trial}")
        stale = busy_copies(config)  # left by the daemon killed before
        p = ctx.Process(target=_daemon_child, args=(cfg_path, ready), daemon=True)
        p.start()
        poll(lambda ready=ready: os.path.exists(ready), timeout=120, every=0.01)
        if work_left(config):
            # Kill in the middle of the work, however slow the machine: once a copy or a
            # delete is under way, at a random moment of it.
            poll(lambda stale=stale: busy_copies(config) - stale, timeout=120, every=0.005)
            time.sleep(rng.uniform(0.0, 0.1))
        else:
            time.sleep(rng.uniform(0.0, 0.5))
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL, p.exitcode
        with Catalog.for_state_dir(config.state_dir) as c:
            if c.copies("run", states=[cat.EXPORTING, cat.DELETING]):
                interrupted += 1
        # After every kill: no checkpoint that a rule keeps lost its last complete copy
        # (s3 keeps every 2nd save, lustre the latest 3; the odd steps below 7 are kept by
        # no rule once newer saves exist, and may go).
        have = complete_copies(config, steps)
        assert all(have[s] for s in (2, 4, 6, 7, 8)), (trial, have)
    assert interrupted >= 3, interrupted  # the kills did land in the middle of the work
    # Restart and let it finish: every checkpoint on every tier its policy asks for.
    assert drain(config) == 0
    have = complete_copies(config, steps)
    # s3 takes every 2nd save; lustre keeps the latest 3; the odd steps below 7 are kept by
    # no rule, so their last copies went too.
    assert {s for s in steps if "s3" in have[s]} == {2, 4, 6, 8}
    assert {s for s in steps if "lustre" in have[s]} == {6, 7, 8}
    assert {s for s in steps if "nvme" in have[s]} == {8}
    with Catalog.for_state_dir(config.state_dir) as c:
        for cp in c.copies("run", states=[cat.PRESENT]):
            assert cp.tier in have[cp.step], cp
            assert cp.verified is not None
        assert not c.copies("run", states=[cat.EXPORTING, cat.DELETING, cat.WRITING])


# ---- S3 down -----------------------------------------------------------------------------------


@pytest.mark.s3
def test_s3_down_backs_off_grows_the_lag_and_catches_up(tmp_path, s3_server, s3_bucket):
    from prometheus_client import REGISTRY

    from fmstore.testing.faultproxy import FaultProxy

    def lag() -> float:
        return REGISTRY.get_sample_value("fmstore_tier_export_lag_seconds") or 0.0

    with FaultProxy(s3_server.endpoint_url) as proxy:
        opts = {**s3_server.store_options(), "endpoint_url": proxy.endpoint_url}
        opts.update(max_attempts=2, retry_deadline=2.0, connect_timeout=1.0, read_timeout=5.0)
        cfg = with_tier(
            posix_config(
                str(tmp_path), {"export": [{"to": "s3", "every_saves": 1}]}, tiers=("nvme", "s3")
            ),
            "s3",
            f"s3://{s3_bucket}/fm",
            **opts,
        )
        from fmstore.tiering.policy.policies import from_dict

        pol = from_dict(
            {"ladder": ["nvme", "s3"], "export": [{"to": "s3", "every_saves": 1}]},
            tiers=["nvme", "s3"],
        )
        save_some(cfg, [1])
        proxy.down()
        d = Daemon(
            cfg, policies=pol, settings=DaemonSettings(port=0, interval=0.05, max_backoff=0.3)
        )
        t = threading.Thread(target=d.run, daemon=True)
        t.start()
        try:
            poll(lambda: d.backoff > 0, timeout=60)
            lag1 = poll(lag, timeout=30)
            save_some(cfg, [2])
            lag2 = poll(lambda: (v := lag()) > lag1 and v, timeout=30)
            assert lag2 > lag1
            with Catalog.for_state_dir(cfg.state_dir) as c:
                assert c.copy("run", 1, "s3") is None or c.copy("run", 1, "s3").state != cat.PRESENT
            proxy.up()
            poll(lambda: lag() == 0 and d.backoff == 0, timeout=120)
        finally:
            d.stop.set()
            t.join(60)
            d.close()
        assert on_tier(cfg, "s3", "run") == {1: True, 2: True}


# ---- ckpt list / verify --all-tiers ---------------------------------------------------------------


def _two_steps_on_nvme_and_lustre(tmp_path) -> tuple[str, Config]:
    """Steps 1 and 2 of ``run`` saved on nvme and exported to lustre; the config's path."""
    from fmstore.config import load_config

    cfg_path = write_toml(
        tmp_path / "fmstore.toml",
        str(tmp_path),
        '[[policies.export]]\nto = "lustre"\nevery_saves = 1',
    )
    config = load_config(cfg_path)
    save_some(config, [1, 2])
    assert drain(config) == 0
    return cfg_path, config


def test_ckpt_list_and_verify_all_tiers_report_a_corrupt_copy(tmp_path, capsys, monkeypatch):
    cfg_path, config = _two_steps_on_nvme_and_lustre(tmp_path)
    # Flip a byte in one blob of step 2 on lustre.
    blob_dir = tmp_path / "lustre" / "run" / "step_000000000002"
    blob = next(p for p in blob_dir.rglob("*.bin"))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    monkeypatch.setenv("FMSTORE_CONFIG", cfg_path)
    code, out, err = cli(capsys, "ckpt", "verify", "--all-tiers", "run")
    assert code == 1, out + err
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and "lustre" in bad[0] and "step 2" in bad[0]
    assert "fails its checksum" in " ".join(out.split())
    assert sum(line.startswith("ok") for line in out.splitlines()) == 3
    code, out, err = cli(capsys, "ckpt", "verify", "--all-tiers", "run", "--json")
    assert code == 1, out + err
    doc = json.loads(out)
    assert (doc["ok"], doc["good"], doc["bad"]) == (False, 3, 1)
    assert [(c["tier"], c["step"]) for c in doc["copies"] if not c["ok"]] == [("lustre", 2)]
    code, out, err = cli(capsys, "ckpt", "list", "run", "--config", cfg_path, "--json")
    assert code == 0, err
    rows = {row["step"]: row["tiers"] for row in json.loads(out)}
    assert rows[2]["lustre"]["state"] == "corrupt"
    assert rows[1]["lustre"]["state"] == "present" and rows[2]["nvme"]["state"] == "present"
    code, out, _ = cli(capsys, "ckpt", "list", "--config", cfg_path)
    assert code == 0 and "corrupt" in out and "run" in out
    # A restore never reads the corrupt copy; the daemon re-exports it.
    with CheckpointManager("run", config=config, run_policies=False) as mgr:
        assert mgr.restore(2)["step"] == 2
    assert drain(config) == 0
    assert on_tier(config, "lustre", "run") == {1: True, 2: True}


def test_verify_all_tiers_counts_copies_gone_and_checkpoints_lost_and_fixes_the_catalog(
    tmp_path, capsys, monkeypatch
):
    import shutil

    cfg_path, config = _two_steps_on_nvme_and_lustre(tmp_path)
    # Removed outside fmstore: step 1's nvme copy, and every copy of step 2.
    shutil.rmtree(tmp_path / "nvme" / "run" / "step_000000000001")
    shutil.rmtree(tmp_path / "nvme" / "run" / "step_000000000002")
    shutil.rmtree(tmp_path / "lustre" / "run" / "step_000000000002")
    monkeypatch.setenv("FMSTORE_CONFIG", cfg_path)
    code, out, err = cli(capsys, "ckpt", "verify", "--all-tiers", "run", "--json")
    assert code == 1, out + err
    doc = json.loads(out)
    assert (doc["ok"], doc["good"], doc["bad"], doc["lost"]) == (False, 1, 3, [2])
    gone = sorted((c["tier"], c["step"]) for c in doc["copies"] if not c["ok"])
    assert gone == [("lustre", 2), ("nvme", 1), ("nvme", 2)]
    code, out, err = cli(capsys, "ckpt", "list", "run", "--json")
    assert code == 0, err
    rows = {row["step"]: row["tiers"] for row in json.loads(out)}
    assert rows[1]["nvme"]["state"] == "missing" and rows[1]["lustre"]["state"] == "present"
    assert rows[2]["nvme"]["state"] == rows[2]["lustre"]["state"] == "missing"
    # Run again: the copies are known to be missing now, the lost checkpoint is still bad.
    code, out, err = cli(capsys, "ckpt", "verify", "--all-tiers", "run")
    assert code == 1 and "step 2: no good copy on any tier" in out, out + err
    assert "1 good, 0 bad copies of 'run'; 1 checkpoint with no good copy" in out


# ---- a real Prometheus server scrapes the daemon --------------------------------------------


def test_a_real_prometheus_scrapes_the_daemon(tmp_path):
    import shutil

    prom = shutil.which("prometheus")
    if prom is None:
        pytest.skip("Prometheus is not installed (apt-get install -y prometheus; make setup-ci)")
    cfg = posix_config(str(tmp_path), {"export": [{"to": "lustre", "every_saves": 1}]})
    save_some(cfg, [1, 2])
    d = Daemon(cfg, settings=DaemonSettings(port=0, interval=0.1))
    port = d.start_http()
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    (web,) = free_ports(1)
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: fmstore\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
    )
    server = subprocess.Popen(
        [
            prom,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        def query(q: str):
            url = f"http://127.0.0.1:{web}/api/v1/query?" + urllib.parse.urlencode({"query": q})
            body = json.loads(urllib.request.urlopen(url, timeout=5).read())
            return body["data"]["result"]

        res = poll(
            lambda: query('fmstore_tier_copies_total{src="nvme",dst="lustre",outcome="ok"} >= 2'),
            timeout=90,
            every=0.5,
        )
        assert res[0]["metric"]["job"] == "fmstore"
        up = query('up{job="fmstore"}')
        assert up and up[0]["value"][1] == "1"
        lag = query("fmstore_tier_export_lag_seconds")
        assert lag and float(lag[0]["value"][1]) == 0.0
    finally:
        server.terminate()
        server.wait(30)
        d.stop.set()
        t.join(30)
        d.close()
