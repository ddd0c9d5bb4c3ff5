"""Two stages into one destination at once: the second waits for the first (shards of one
stage run side by side), so neither undoes the other's work."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HOLD = """
import sys
from fmstore import runtime
from fmstore.tiering.staging.stagelock import lock_destination
shard = None if sys.argv[3] == "-" else tuple(map(int, sys.argv[3].split("/")))
lock = runtime.run(lock_destination(sys.argv[1], sys.argv[2], shard))
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("FMSTORE_HOME", str(h))
    monkeypatch.delenv("FMSTORE_CONFIG", raising=False)
    for var in ("SLURM_PROCID", "SLURM_NTASKS", "RANK", "WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"f{i}").write_bytes(bytes([i]) * 1000)
    return h


def _hold(home, dst: str, shard: str = "-") -> subprocess.Popen:
    """A process holding the lock a stage into ``dst`` takes (as a running stage would)."""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(home / "state"), dst, shard],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def _stage(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fmstore", "stage", *args, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _release(holder: subprocess.Popen) -> None:
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait(60) == 0


def test_a_second_stage_into_a_destination_waits_for_the_first(home, tmp_path):
    dst = str(tmp_path / "dst")
    holder = _hold(home, dst)
    try:
        # Spelt differently, the same destination: a tier-less path and its file:// URL.
        stage = _stage(str(tmp_path / "src"), "file://" + dst)
        assert stage.stderr is not None
        line = stage.stderr.readline()  # blocks until the stage says it waits
        assert "is writing into file://" in line and "waiting until it is done" in line, line
        assert f"(pid {holder.pid})" in line
        assert stage.poll() is None and not os.path.exists(os.path.join(dst, "f0"))
    finally:
        _release(holder)
    out, err = stage.communicate(timeout=120)
    assert stage.returncode == 0, err
    assert sorted(os.listdir(dst)) == [f"f{i}" for i in range(8)]


def test_shards_of_one_stage_run_side_by_side_and_a_whole_stage_waits_for_them(home, tmp_path):
    dst = str(tmp_path / "dst")
    holder = _hold(home, dst, "0/2")
    try:
        r = subprocess.run(  # the other shard does not wait (it would hang here if it did)
            [
                sys.executable,
                "-m",
                "fmstore",
                "stage",
                str(tmp_path / "src"),
                dst,
                "--shard",
                "1/2",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and "waiting" not in r.stderr, r.stderr
        stage = _stage(str(tmp_path / "src"), dst)
        assert stage.stderr is not None
        line = stage.stderr.readline()
        assert "sharded stages are writing into" in line, line
    finally:
        _release(holder)
    assert stage.wait(120) == 0
    assert len(os.listdir(dst)) == 8
