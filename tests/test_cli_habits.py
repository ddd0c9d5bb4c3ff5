"""CLI habits users bring from s5cmd, rclone and the aws cli: Slurm sharding only inside an
srun step, ``--json`` on every command that prints results, ``ls`` of objects and globs,
``rm`` of prefixes, verbosity options, help and output polish, ``py.typed``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from stage_data import fm

ROOT = Path(__file__).resolve().parent.parent
_SHARD_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "RANK", "WORLD_SIZE")


@pytest.fixture
def no_shard_env(monkeypatch):
    for var in _SHARD_VARS:
        monkeypatch.delenv(var, raising=False)


def _tree(root: Path, n: int = 40) -> Path:
    root.mkdir()
    for i in range(n):
        (root / f"f{i:02d}.fms").write_bytes(os.urandom(100))
    return root


# ---- 1. Slurm: shards only inside an srun step ---------------------------------------------


def test_batch_script_with_ntasks_stages_everything(tmp_path, no_shard_env):
    """A batch script run once with --ntasks=4 sees SLURM_NTASKS=4 and SLURM_PROCID=0 but no
    step: it must copy all the data, and say so."""
    src = _tree(tmp_path / "src")
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "FMSTORE_HOME": str(tmp_path / "h")}
    r = fm("stage", str(src), str(tmp_path / "d"), "--json", "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["files_copied"] == 40 and out["shard"] == "all"
    assert "shard all" in r.stderr and "not inside an srun step" in r.stderr
    assert len(os.listdir(tmp_path / "d")) == 40


def test_srun_step_tasks_stage_their_shard_and_say_which(tmp_path, no_shard_env):
    src = _tree(tmp_path / "src")
    copied = 0
    for k in range(4):
        env = {
            "SLURM_PROCID": str(k),
            "SLURM_NTASKS": "4",
            "SLURM_STEP_ID": "0",
            "FMSTORE_HOME": str(tmp_path / "h"),
        }
        r = fm("stage", str(src), str(tmp_path / "d"), "--json", "--no-progress", env=env)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["shard"] == f"{k}/4" and f"shard {k}/4" in r.stderr.splitlines()[-1]
        copied += out["files_copied"]
    assert copied == 40


def test_dry_run_plan_says_which_shard(tmp_path, no_shard_env):
    src = _tree(tmp_path / "src", 3)
    r = fm("stage", str(src), str(tmp_path / "d"), "-n", "--shard", "1/2", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["shard"] == "1/2", r.stderr
    r = fm("stage", str(src), str(tmp_path / "d"), "-n")
    assert r.returncode == 0 and "shard all" in r.stdout, r.stderr


# ---- 6. py.typed ---------------------------------------------------------------------------


def test_py_typed_ships_in_the_wheel(tmp_path):
    """PEP 561: the marker exists, pyproject declares it, and a built wheel holds it."""
    import shutil
    import subprocess
    import sys
    import zipfile

    assert (ROOT / "fmstore" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(
        r'\[tool\.setuptools\.package-data\]\s*fmstore = \[[^]]*"py\.typed"', pyproject
    )
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "fmstore", src / "fmstore", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "dist")],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = tmp_path / "dist" / r.stdout.strip().splitlines()[-1]
    assert "fmstore/py.typed" in zipfile.ZipFile(wheel).namelist()
