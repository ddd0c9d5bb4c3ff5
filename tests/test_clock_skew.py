"""Clock skew is loud (issue 60, major 4): a node whose clock runs 3 minutes ahead writes
checkpoints whose manifests say they were created in the future.  Another node (a fresh
catalog, the right clock) does not count them as committed, and says so: the daemon's
rescan logs a warning naming the node and the offset, its metrics count them, ``ckpt
list`` shows them in their rows and, with nothing counted, says they exist but are in the
future.  The skewed node's own tier check sees its clock ahead of the shared tier's.

The seam: the writer is the real ``CheckpointManager`` (and ``fmstore daemon --check``) in
a process whose ``time.time`` runs 180 s ahead, set before fmstore is imported; file
modification times stay the kernel's, as on a node with a wrong clock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

AHEAD = 180.0
ROOT = "runs/cw"
ENV = {**os.environ, "PYTHONPATH": os.getcwd()}
#: Run a module or code with this process's clock AHEAD seconds ahead (argv[1]: code).
SHIFTED = (
    "import sys, time\n"
    "_real = time.time\n"
    f"time.time = lambda: _real() + {AHEAD}\n"
    "sys.argv = sys.argv[1:]\n"
    "exec(compile(sys.argv[0], '<shifted>', 'exec'))\n"
)
SAVE = (
    "import sys, torch\n"
    "from fmstore import CheckpointManager\n"
    f"with CheckpointManager({ROOT!r}, config=sys.argv[1], run_policies=False) as m:\n"
    "    for step in (1, 2, 3):\n"
    "        m.save(step, {'w': torch.full((64,), float(step)), 'step': step})\n"
)
CHECK = "from fmstore.cli.main import main\nmain(['daemon', '--check'])\n"


def ahead_of(tmp: Path, before: float, after: float) -> tuple[float, float]:
    """The bounds of the newest manifest's offset seen by a scan made between ``before``
    and ``after`` (this clock), ±1 s of rounding."""
    created = max(
        json.loads(p.read_text())["created"]
        for p in (tmp / "lustre" / ROOT).glob("*/manifest.json")
    )
    return created - after - 1, created - before + 1


def config(tmp: Path, node: str) -> Path:
    p = tmp / f"{node}.toml"
    p.write_text(
        f'state_dir = "{tmp / node / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp / node / "nvme"}"\n'
        f'[tiers.lustre]\nurl = "{tmp / "lustre"}"\n'
        '[policies]\nladder = ["nvme", "lustre"]\nwrite_tier = "lustre"\n'
        '[protocol]\nlease_ttl = "2m"\nclock_skew = 10\n'
    )
    return p


def shifted(tmp: Path, code: str, node: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**ENV, "FMSTORE_NODE_ID": node, "FMSTORE_CONFIG": str(config(tmp, node))}
    return subprocess.run(
        [sys.executable, "-c", SHIFTED, code, *args],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def skewed(tmp_path, monkeypatch):
    """Steps 1-3 of runs/cw saved on lustre by node n1, 180 s ahead; this process is n0."""
    done = shifted(tmp_path, SAVE, "n1", str(config(tmp_path, "n1")))
    assert done.returncode == 0, done.stderr
    monkeypatch.setenv("FMSTORE_NODE_ID", "n0")
    cfg = config(tmp_path, "n0")
    monkeypatch.setenv("FMSTORE_CONFIG", str(cfg))
    from fmstore import config as fm_config

    fm_config.set_config(None)
    yield tmp_path, cfg
    fm_config.set_config(None)


def test_a_node_three_minutes_ahead_is_named_everywhere_and_not_counted(skewed, capsys):
    tmp, cfg = skewed
    manifest = json.loads(
        (tmp / "lustre" / ROOT / "step_000000000003" / "manifest.json").read_text()
    )
    assert manifest["writer"].endswith(" on n1")

    # ckpt list ROOT: nothing is counted, and it says the checkpoints are in the future
    from fmstore.cli.main import main

    t0 = time.time()
    with pytest.raises(SystemExit) as ex:
        main(["ckpt", "list", ROOT, "-c", str(cfg)])
    lo, hi = ahead_of(tmp, t0, time.time())
    err = capsys.readouterr().err
    assert ex.value.code != 0
    assert "no checkpoint of run root 'runs/cw' on any tier" not in err
    assert "3 checkpoints of it exist with manifests created in the future" in " ".join(err.split())
    text = " ".join(err.split())
    assert "written by node n1 — clock skew?" in text and "steps 1, 2, 3" in text
    offset = int(text.split("up to +")[1].split(" s")[0])
    assert lo <= offset <= hi and offset > 60

    # the daemon (a fresh catalog): a warning naming n1 and the offset on every rescan,
    # the metrics, and the steps not counted (not in the catalog, not on the tier)
    from prometheus_client import REGISTRY

    from fmstore.config import load_config
    from fmstore.tiering.policy import runner
    from fmstore.tiering.service.daemon import Daemon

    warned: list[dict] = []

    class Catch:
        level = 0

        def handle(self, record):
            if getattr(record, "event", None) == "created_in_future":
                warned.append(
                    {"level": record.levelname, "msg": record.getMessage(), **record.fields}
                )

    handler = Catch()
    runner.log.addHandler(handler)  # type: ignore[arg-type]
    try:
        d = Daemon(load_config(str(cfg)))
        t0 = time.time()
        try:
            d.rescan()
            d.rescan()
            assert d._future_rescan is not None  # scanned again until they count
            from fmstore import runtime

            assert runtime.run(d.runner.tiers.steps_on("lustre", ROOT)) == []
            assert d.catalog.checkpoints(ROOT) == []
        finally:
            d.close()
        lo, hi = ahead_of(tmp, t0, time.time())
    finally:
        runner.log.removeHandler(handler)  # type: ignore[arg-type]
    assert len(warned) == 2  # every rescan
    w = warned[0]
    assert w["level"] == "WARNING" and w["node"] == "n1" and w["steps"] == [1, 2, 3]
    assert lo <= w["max_offset_seconds"] <= hi
    assert "clock skew?" in w["msg"] and "n1" in w["msg"] and "+1" in w["msg"]
    get = REGISTRY.get_sample_value
    assert get("fmstore_manifests_in_future", {"tier": "lustre"}) == 3
    assert lo <= get("fmstore_manifest_future_max_seconds", {"tier": "lustre"}) <= hi
    assert get("fmstore_manifests_in_future", {"tier": "nvme"}) == 0

    # the daemon as a process logs the same line (JSON, level warning)
    proc = subprocess.run(
        [sys.executable, "-m", "fmstore", "daemon", "--once", "--no-http", "-c", str(cfg)],
        env={**ENV, "FMSTORE_NODE_ID": "n0"},
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [json.loads(x) for x in proc.stderr.splitlines() if x.startswith("{")]
    skew = [x for x in lines if x.get("event") == "created_in_future"]
    assert len(skew) == 1 and skew[0]["level"] == "warning", proc.stderr
    assert skew[0]["node"] == "n1" and skew[0]["steps"] == [1, 2, 3]

    # ckpt list of every root: the rows say it, in the table and in JSON
    main_rc = 0
    try:
        main(["ckpt", "list", "-c", str(cfg)])
    except SystemExit as e:
        main_rc = int(e.code or 0)
    out = " ".join(capsys.readouterr().out.split())
    assert main_rc == 0
    assert "created in the future (+1" in out and "by node n1 — clock skew?" in out
    t0 = time.time()
    main(["ckpt", "list", "-c", str(cfg), "--json"])
    lo, hi = ahead_of(tmp, t0, time.time())
    doc = json.loads(capsys.readouterr().out)
    cell = {r["step"]: r["tiers"]["lustre"] for r in doc}[3]
    assert cell["why"] == "created_in_future" and cell["node"] == "n1"
    assert lo <= cell["offset_seconds"] <= hi


def test_the_skewed_nodes_tier_check_sees_its_clock_ahead_of_the_shared_tier(tmp_path):
    done = shifted(tmp_path, CHECK, "n1")
    assert done.returncode == 0, done.stderr
    err = " ".join(done.stderr.split())
    assert "this node's clock is 1" in err and "s ahead of tier lustre's" in err, err
    assert "nvme" not in err.split("ahead of tier")[1][:10]


def test_protocol_settings_come_from_the_config_and_the_environment_overrides(
    tmp_path, monkeypatch
):
    from fmstore.config import load_config
    from fmstore.errors import ConfigError
    from fmstore.protocol.env import Env

    monkeypatch.delenv("FMSTORE_EXPORT_LEASE_TTL", raising=False)
    monkeypatch.delenv("FMSTORE_CLOCK_SKEW", raising=False)
    p = tmp_path / "f.toml"
    p.write_text('[protocol]\nlease_ttl = "4m"\n')
    env = Env.from_config(load_config(str(p)))
    assert (env.lease_ttl, env.lease_renew, env.clock_skew) == (240.0, 40.0, 20.0)
    p.write_text('[protocol]\nlease_ttl = 60\nlease_renew = "5s"\nclock_skew = 3\n')
    env = Env.from_config(load_config(str(p)))
    assert (env.lease_ttl, env.lease_renew, env.clock_skew) == (60.0, 5.0, 3.0)
    monkeypatch.setenv("FMSTORE_CLOCK_SKEW", "7")
    assert Env.from_config(load_config(str(p))).clock_skew == 7.0
    monkeypatch.setenv("FMSTORE_EXPORT_LEASE_TTL", "30")
    env = Env.from_config(load_config(str(p)))
    assert (env.lease_ttl, env.lease_renew, env.clock_skew) == (30.0, 5.0, 7.0)
    # No [protocol] table: the environment alone, the rest derived from the lifetime.
    monkeypatch.delenv("FMSTORE_CLOCK_SKEW")
    env = Env.from_config(None)
    assert (env.lease_ttl, env.lease_renew, env.clock_skew) == (30.0, 5.0, 2.5)
    monkeypatch.delenv("FMSTORE_EXPORT_LEASE_TTL")
    p.write_text("[protocol]\nlease_ttl = 60\nlease_renew = 25\n")
    with pytest.raises(ConfigError, match="half of lease_ttl"):
        Env.from_config(load_config(str(p)))
    p.write_text("[protocol]\nclock_skw = 3\n")
    with pytest.raises(ConfigError, match="clock_skew"):
        load_config(str(p))


def test_a_step_no_node_can_complete_is_said_so(tmp_path):
    """``ckpt list``: a shared copy waiting for nodes that exported a later step since
    (their NVMe no longer holds this one's part) with no replicas kept cannot complete."""
    from fmstore.cli.ckpt_tier_cmds import _cannot_lines, _never
    from fmstore.config import load_config

    p = tmp_path / "f.toml"
    p.write_text(
        f'[tiers.nvme]\nurl = "{tmp_path}/nvme"\nscope = "node"\n'
        f'[tiers.lustre]\nurl = "{tmp_path}/lustre"\n'
    )
    parts: dict = {
        ("r", 10, "lustre"): {"present": ["n0", "n2"], "of": 4, "waiting": ["n1", "n3"]},
        ("r", 20, "lustre"): {"present": ["n0", "n1", "n2", "n3"], "of": 4, "waiting": []},
        ("r", 30, "lustre"): {"present": ["n0"], "of": 4, "waiting": ["n1", "n2", "n3"]},
    }
    _never(load_config(str(p)), parts)
    assert parts[("r", 10, "lustre")]["cannot"] == ["n1", "n3"]
    assert "cannot" not in parts[("r", 30, "lustre")]  # they may still export it
    (line,) = _cannot_lines(parts)
    assert "r step 10 on lustre cannot complete: no node holds the parts of n1, n3" in line
    # with replicas kept, a peer may still export them: only waiting
    p.write_text(p.read_text().replace('scope = "node"', 'scope = "node"\nreplicas = 1'))
    parts[("r", 10, "lustre")].pop("cannot")
    _never(load_config(str(p)), parts)
    assert "cannot" not in parts[("r", 10, "lustre")]


def test_every_reader_of_a_lease_decides_by_one_rule(tmp_path):
    """An export lease is alive by :func:`fmstore.protocol.decisions.lease_alive` with the
    reader's Env (its lifetime and skew, its clock) wherever it is read: the lease itself
    (the sweep and gc), the retirement fence's view of renewals, and gc's fallback for a
    lease that does not parse (its file's write time, the skew allowed too: before, that
    one alone ignored the skew).  The pid shortcut only shortens a lease of this very node
    whose process is gone."""
    from fmstore import runtime
    from fmstore.checkpoint.gc import _live_lease
    from fmstore.protocol.decisions import lease_alive
    from fmstore.protocol.env import Env
    from fmstore.protocol.records import ExportLease
    from fmstore.stores import open_store
    from fmstore.tiering.exports.retire import _alive

    now = 1_000_000.0
    env = Env(lease_ttl=60.0, lease_renew=5.0, clock_skew=4.0, clock=lambda: now, node="n0")
    ages = (-70.0, -64.0, -63.9, 0.0, 30.0, 63.9, 64.0, 64.1, 1e9, float("nan"))
    for age in ages:
        renewed = now - age
        want = lease_alive(renewed, now=now, ttl=60.0, skew=4.0)
        assert want == (abs(age) < 64.0), age
        assert ExportLease("n1", 1, renewed).alive(env) is want, age
        assert env.lease_alive(renewed) is want, age
        assert (_alive({"n1": renewed}, now, env) == ["n1"]) is want, age
    # This node's lease whose process is gone: dead at once; another node's: its clock.
    gone = 2**22 + 12345  # above Linux's pid_max: no such process
    assert not ExportLease("n0", gone, now).alive(env)
    assert ExportLease("n1", gone, now).alive(env)
    assert ExportLease("n0", env.process(), now).alive(env)

    # gc's fallback for a lease that does not parse: its write time, by the same rule.
    store = open_store(str(tmp_path))
    key = "g000000000001-00000001/export-n1.json"
    runtime.run(store.put(key, b"{not json"))
    written = (tmp_path / key).stat().st_mtime
    for age, alive in ((0.0, True), (62.0, True), (64.5, False)):
        at = written + age
        seen = Env(lease_ttl=60.0, lease_renew=5.0, clock_skew=4.0, clock=lambda at=at: at)
        assert runtime.run(_live_lease(store, [key], seen)) is alive, age
    runtime.run(store.close())
