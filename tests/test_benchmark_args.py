"""The benchmarks' command lines (``python -m benchmarks.NAME``): a ``--dir`` that does not
exist is said in one line, without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_a_benchmark_with_a_missing_dir_says_so_without_a_traceback(tmp_path):
    r = run("benchmarks.stage", "--dir", str(tmp_path / "nope"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"--dir {tmp_path / 'nope'}: no such directory" in r.stderr
