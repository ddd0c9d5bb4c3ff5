"""Chaos: a training loop under ``CheckpointManager`` and a tiering daemon exporting to lustre
and to a real S3 (SeaweedFS) through the fault proxy, each killed with SIGKILL at random
moments, the node replaced once (nvme and catalog wiped).  After every restart the trainer
restores bit for bit a step at least as new as the last one it saw committed (after the wipe:
the newest durable one); at the end every copy the catalog calls present verifies, every tier
holds what its retention says, and no unfinished upload or temp file is left.

``make test`` runs a short schedule: three kills, one of each kind (the trainer a moment
after a commit, the daemon mid-export, then the node replaced), so every restart path and
every final check still runs once; ``make test-chaos`` (``FMSTORE_CHAOS=1``) runs the long
one, ten kills with the replacement at the fifth.

Run as a script (``python test_tiering_chaos.py trainer CFG DIR N MIN_STEP``), this module is
the trainer."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from tiering_helpers import on_tier, state

HERE = os.path.dirname(os.path.abspath(__file__))
N = 50_000  # floats per state: ~200 KB a checkpoint
ROOT = "run"
KEEP = {"nvme": 2, "lustre": 3}
S3_EVERY = 2


# ---- the trainer (a child process) ------------------------------------------------------------


def _committed_steps(path: str) -> list[int]:
    """Steps the trainer appended to ``path`` (a line cut short by a kill is ignored)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return [int(x) for x in text.split("\n")[:-1] if x.strip()]


def _same(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        )
    return type(a) is type(b) and a == b


def trainer(cfg: str, workdir: str, run: int, min_step: int) -> int:
    """Restore (or start at step 0), check the restored state against the state of its step,
    then save every step until ``workdir/stop`` exists; each committed step is appended
    (fsync'd) to ``workdir/committed``.  What the restore found goes to
    ``workdir/start-RUN.json``."""
    from fmstore import CheckpointManager

    committed = os.path.join(workdir, "committed")
    with CheckpointManager(ROOT, config=cfg, run_policies=False) as mgr:
        if mgr.latest_step() is not None:
            got = mgr.restore()
            restored = mgr.restored_step
            assert restored is not None
            report = {
                "restored": restored,
                "tier": mgr.restored_tier,
                "equal": _same(got, state(restored, n=N)),
                "min_step": min_step,
            }
            step = restored + 1
        else:
            report = {"restored": None, "min_step": min_step}
            step = 0
        tmp = os.path.join(workdir, f".start-{run}.json")
        with open(tmp, "w") as f:
            json.dump(report, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(workdir, f"start-{run}.json"))
        fd = os.open(committed, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            while not os.path.exists(os.path.join(workdir, "stop")):
                mgr.save(step, state(step, n=N)).result()
                os.write(fd, f"{step}\n".encode())
                os.fsync(fd)
                step += 1
                time.sleep(0.5)  # pacing only: keeps the number of checkpoints modest
        finally:
            os.close(fd)
    return 0


# ---- the test ----------------------------------------------------------------------------------


def _write_config(path, base: str, s3_table: str, daemon: str) -> str:
    path.write_text(
        f"""
state_dir = "{base}/state"
[tiers.nvme]
url = "{base}/nvme"
[tiers.lustre]
url = "{base}/lustre"
[tiers.s3]
{s3_table}
[policies]
ladder = ["nvme", "lustre", "s3"]
[[policies.export]]
to = "lustre"
every_steps = 1
[[policies.export]]
to = "s3"
every_steps = {S3_EVERY}
[policies.retention.nvme]
keep_latest = {KEEP["nvme"]}
[policies.retention.lustre]
keep_latest = {KEEP["lustre"]}
[daemon]
interval = "0.1s"
max_backoff = "1s"
concurrency = 2
{daemon}
"""
    )
    return str(path)


def _poll(fn, what: str, timeout: float = 180.0, alive=()):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        for p, name in alive:
            assert p.poll() is None, f"{name} exited with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    p.wait(60)


def _temp_files(root: str) -> list[str]:
    from fmstore.stores.posix import TMP_MARK

    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.startswith(TMP_MARK)]


@pytest.mark.slow
@pytest.mark.s3
def test_sigkill_of_trainer_and_daemon_and_a_replaced_node_lose_nothing_short(
    tmp_path, s3_server, s3_bucket, monkeypatch
):
    run_schedule(tmp_path, s3_server, s3_bucket, monkeypatch, kills=3, wipe_at=3)


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.skipif(
    os.environ.get("FMSTORE_CHAOS") != "1", reason="the long schedule: make test-chaos"
)
def test_sigkill_of_trainer_and_daemon_and_a_replaced_node_lose_nothing_long(
    tmp_path, s3_server, s3_bucket, monkeypatch
):
    run_schedule(tmp_path, s3_server, s3_bucket, monkeypatch, kills=10, wipe_at=5)


def run_schedule(tmp_path, s3_server, s3_bucket, monkeypatch, kills: int, wipe_at: int) -> None:
    """``kills`` kills: odd ones the trainer's, even ones the daemon's, the ``wipe_at``-th
    both and the node replaced (nvme and state directory lost)."""
    from fmstore.config import load_config
    from fmstore.testing.faultproxy import FaultProxy, Rule
    from fmstore.tiering.inventory import catalog as cat
    from fmstore.tiering.inventory.catalog import Catalog

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    base = str(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    committed = str(work / "committed")
    rng = random.Random(20240611)

    with FaultProxy(s3_server.endpoint_url, seed=7) as proxy:
        proxy.set_plan(
            [
                Rule("reset", rate=0.03),
                Rule("reset_request", method="PUT", rate=0.03),
                Rule("slowdown", rate=0.03),
                Rule("pause", rate=0.03, delay=0.2),
            ]
        )
        s3_table = (
            f'url = "s3://{s3_bucket}/fm"\nendpoint_url = "{proxy.endpoint_url}"\n'
            'addressing_style = "path"\nregion = "us-east-1"\nmax_attempts = 20'
        )
        # The limit keeps copies open long enough for kills to land in them.
        cfg = _write_config(tmp_path / "fmstore.toml", base, s3_table, 'bwlimit = "2MB"')
        config = load_config(cfg)
        runs = {"trainer": 0, "daemon": 0}

        def start_trainer(min_step: int) -> subprocess.Popen:
            runs["trainer"] += 1
            return subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(HERE, "test_tiering_chaos.py"),
                    "trainer",
                    cfg,
                    str(work),
                    str(runs["trainer"]),
                    str(min_step),
                ],
                stdout=subprocess.DEVNULL,
                stderr=open(work / f"trainer-{runs['trainer']}.log", "w"),
                env=env,
            )

        def start_daemon() -> tuple[subprocess.Popen, str]:
            runs["daemon"] += 1
            log = str(work / f"daemon-{runs['daemon']}.log")
            p = subprocess.Popen(
                [sys.executable, "-m", "fmstore", "daemon", "--config", cfg, "--no-http"],
                stdout=subprocess.DEVNULL,
                stderr=open(log, "w"),
                env=env,
            )
            return p, log

        def daemon_exporting(log: str) -> bool:
            with open(log) as f:
                return '"export_start"' in f.read()

        def check_start(run: int, floor: int | None) -> dict:
            """The trainer's own report of its restore, checked against ``floor``."""
            with open(work / f"start-{run}.json") as f:
                rep = json.load(f)
            if floor is None:
                assert rep["restored"] is None, rep
            else:
                assert rep["restored"] is not None and rep["equal"], (run, rep)
                assert rep["restored"] >= floor, (run, rep)
            return rep

        def wait_commit(p: subprocess.Popen, after: int) -> None:
            _poll(
                lambda: len(_committed_steps(committed)) > after,
                f"trainer run {runs['trainer']} to commit a step",
                alive=[(p, "trainer")],
            )

        lost: set[int] = set()
        trainer_p = start_trainer(-1)
        daemon_p, daemon_log = start_daemon()
        wait_commit(trainer_p, 0)
        check_start(1, None)
        restores = []
        for kill in range(1, kills + 1):
            if kill == wipe_at:
                # Replace the node: both die, nvme and the state directory (catalog,
                # journals) are lost; only lustre and s3 survive.
                wait_commit(trainer_p, len(_committed_steps(committed)))
                time.sleep(rng.uniform(0.0, 0.5))
                _kill(trainer_p)
                _kill(daemon_p)
                durable = {
                    s for t in ("lustre", "s3") for s, ok in on_tier(config, t, ROOT).items() if ok
                }
                assert durable, "nothing reached lustre or s3 before the wipe"
                floor = max(durable)
                # Steps up to the newest durable one that were only on nvme are gone with
                # it (the trainer resumes after ``floor``); every other one must survive.
                lost = {s for s in range(floor + 1) if s not in durable}
                shutil.rmtree(os.path.join(base, "nvme"))
                shutil.rmtree(os.path.join(base, "state"))
                daemon_p, daemon_log = start_daemon()
                seen = len(_committed_steps(committed))
                trainer_p = start_trainer(floor)
                wait_commit(trainer_p, seen)
                restores.append(check_start(runs["trainer"], floor))
            elif kill % 2:
                # The trainer, a random moment after one of its commits.
                wait_commit(trainer_p, len(_committed_steps(committed)))
                time.sleep(rng.uniform(0.0, 0.4))
                _kill(trainer_p)
                done = _committed_steps(committed)
                floor = done[-1]
                trainer_p = start_trainer(floor)
                wait_commit(trainer_p, len(done))
                restores.append(check_start(runs["trainer"], floor))
            else:
                # The daemon, a random moment after it began a copy.
                _poll(
                    lambda log=daemon_log: daemon_exporting(log),
                    "the daemon to start an export",
                    alive=[(daemon_p, "daemon")],
                )
                time.sleep(rng.uniform(0.0, 1.0))
                _kill(daemon_p)
                daemon_p, daemon_log = start_daemon()
        # Let the last daemon work a moment, then stop the trainer cleanly and kill the daemon.
        wait_commit(trainer_p, len(_committed_steps(committed)))
        (work / "stop").write_text("")
        assert trainer_p.wait(120) == 0
        _kill(daemon_p)
        last = _committed_steps(committed)[-1]

        # A final drain, with the faults and the bandwidth limit off (they were the chaos
        # phase's), whose start-up sweep removes every orphan at once.
        proxy.clear()
        drain_cfg = _write_config(tmp_path / "drain.toml", base, s3_table, 'orphan_grace = "0"')
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "fmstore",
                "daemon",
                "--config",
                drain_cfg,
                "--no-http",
                "--drain",
                "--timeout",
                "300",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=400,
        )
        assert r.returncode == 0, r.stderr[-5000:]

        # Every copy the catalog calls present passes its checksums on its tier.
        have = {t: on_tier(config, t, ROOT) for t in ("nvme", "lustre", "s3")}
        with Catalog.for_state_dir(config.state_dir) as c:
            present = c.copies(ROOT, states=[cat.PRESENT])
            assert not c.copies(ROOT, states=[cat.EXPORTING, cat.DELETING, cat.WRITING])
        assert present
        for cp in present:
            assert have[cp.tier].get(cp.step) is True, (cp, sorted(have[cp.tier]))
        v = subprocess.run(
            [sys.executable, "-m", "fmstore", "ckpt", "verify", "--all-tiers", ROOT],
            capture_output=True,
            text=True,
            env={**env, "FMSTORE_CONFIG": cfg},
            timeout=600,
        )
        assert v.returncode == 0, v.stdout[-5000:] + v.stderr[-5000:]

        # Each tier holds what its retention says: the newest saves on nvme and lustre,
        # every S3_EVERY-th step on s3 (no retention there) but those lost with the node.
        assert all(have[t].values() for t in have)
        assert sorted(have["nvme"]) == list(range(last - KEEP["nvme"] + 1, last + 1))
        assert sorted(have["lustre"]) == list(range(last - KEEP["lustre"] + 1, last + 1))
        assert sorted(have["s3"]) == [s for s in range(0, last + 1, S3_EVERY) if s not in lost]

    # Nothing unfinished: no multipart upload, no temp file.
    client = s3_server.boto3_client()
    uploads = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert uploads == [], [u["Key"] for u in uploads]
    assert _temp_files(os.path.join(base, "nvme")) == []
    assert _temp_files(os.path.join(base, "lustre")) == []
    # The chaos did happen: every trainer start after the first restored something (one
    # start after each of the trainer's kills and one after the replacement).
    trainer_kills = sum(1 for k in range(1, kills + 1) if k % 2 and k != wipe_at)
    assert len(restores) == runs["trainer"] - 1 == trainer_kills + 1


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        sys.exit(trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
    raise SystemExit(f"unknown role {sys.argv[1]!r}")
