"""Small first-day frictions outside the ``fmstore`` command: a manifest's repr in a
notebook, ``python -m fmstore.demo --help``, a benchmark's missing ``--dir``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import fmstore

ROOT = Path(__file__).resolve().parent.parent


def test_save_and_a_handles_result_show_a_one_line_manifest(tmp_path):
    state = {f"layer{i}": {"w": torch.zeros(64, 64), "b": torch.zeros(64)} for i in range(40)}
    m = fmstore.save(state, tmp_path / "a")
    assert len(m.tensors) == 80  # the entries are all there...
    text = repr(m)
    assert "\n" not in text and len(text) < 120, text  # ...and the repr is one short line
    assert text.startswith(f"<Manifest {m.generation}: 80 tensors, ") and "1 blob " in text
    r = fmstore.async_save({"w": torch.ones(3)}, tmp_path / "b").result()
    assert repr(r).startswith(f"<Manifest {r.generation}: 1 tensor, 12 B in 1 blob (")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_the_demo_explains_itself_and_every_option():
    r = run("fmstore.demo", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "a small GPT trained on CPU" in text and "docs/demo.md" in text
    assert "see the package docstring" not in text
    assert "training steps of each run (default: 300)" in text
    assert "save a checkpoint every N steps (default: 25)" in text


def test_a_benchmark_with_a_missing_dir_says_so_without_a_traceback(tmp_path):
    r = run("benchmarks.stage", "--dir", str(tmp_path / "nope"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"--dir {tmp_path / 'nope'}: no such directory" in r.stderr
