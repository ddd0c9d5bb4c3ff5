"""What the training stacks' tests (tests/test_stack_*.py) share: the environment of a
launch, the wait on an event that fails as soon as a launch it needs has exited, the
bit-for-bit comparison of restored state, and the search for files a stack wrote by itself
(fmstore bypassed)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

REPO = str(Path(__file__).resolve().parents[1])
HERE = os.path.dirname(os.path.abspath(__file__))


def rank_env(cfg: Path, **extra: str) -> dict[str, str]:
    """The environment of a launch using the config ``cfg``: fmstore and the tests' worker
    modules importable, one thread a rank."""
    return {
        **os.environ,
        "FMSTORE_CONFIG": str(cfg),
        "PYTHONPATH": os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def _output(p: subprocess.Popen[Any], log: Path | None) -> str:
    if log is not None:
        return log.read_text(errors="replace")[-6000:]
    return (p.communicate()[0] or "") if p.stdout else ""


def wait_for(
    path: Path,
    procs: subprocess.Popen[Any] | Iterable[subprocess.Popen[Any]],
    *,
    gone: bool = False,
    log: Path | None = None,
    timeout: float = 300,
) -> None:
    """Until ``path`` exists (``gone``: until it no longer does): the event; fail at once
    when a process it depends on exited first, with its output (or ``log``'s tail)."""
    procs = [procs] if isinstance(procs, subprocess.Popen) else list(procs)
    deadline = time.monotonic() + timeout
    while path.exists() == gone:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[:4]} exited ({p.returncode}) first:\n"
                                     + _output(p, log))  # fmt: skip
        assert time.monotonic() < deadline, f"{path} never {'went' if gone else 'appeared'}"
        time.sleep(0.05)


def mismatch(a: Any, b: Any, where: str = "") -> str | None:
    """Where ``a`` and ``b`` differ (tensors bit for bit, with their dtypes), or None."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return None if same else where or "."
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{where} (keys)"
        return next((m for k in a if (m := mismatch(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, list | tuple):
        if not isinstance(b, list | tuple) or len(a) != len(b):
            return f"{where} (length)"
        return next((m for i, (x, y) in enumerate(zip(a, b)) if (m := mismatch(x, y, f"{where}[{i}]"))), None)  # fmt: skip
    return None if a == b else where or "."


def same(a: Any, b: Any) -> bool:
    return mismatch(a, b) is None


def assert_same(a: Any, b: Any, where: str = "") -> None:
    m = mismatch(a, b, where)
    assert m is None, f"differs at {m}"


def files(bases: Iterable[Path], stray: Callable[[Path], bool]) -> list[str]:
    """Every file or directory under ``bases`` that ``stray`` picks (what a stack wrote by
    itself when fmstore was bypassed)."""
    return [str(f) for base in bases for f in base.rglob("*") if stray(f)]
