"""Run a script under ``torchrun`` on this machine (``--nproc_per_node`` ranks, loopback
rendezvous), for tests and benchmarks of multi-rank jobs.

torchrun starts each rank in a session of its own, so ending torchrun alone would leave
ranks (and their DataLoader workers) running after a hang: past ``timeout`` every process
it started is killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from .seaweed import free_ports


def launch(
    script: str,
    args: list[str],
    *,
    nproc: int,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdout: Any = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """Start ``script args`` on ``nproc`` ranks and return at once (stderr joins stdout);
    end it with :func:`kill_all` (its ranks run in sessions of their own)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_ports(1)[0]}", script, *args,
    ]  # fmt: skip
    return subprocess.Popen(
        cmd,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        env=None if env is None else dict(env),
        cwd=cwd,
    )


def torchrun(
    script: str,
    args: list[str],
    *,
    nproc: int,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """``(exit status, stdout and stderr)`` of ``script args`` on ``nproc`` ranks; the
    status is -1 when it ran past ``timeout`` seconds (and was killed, ranks included)."""
    p = launch(script, args, nproc=nproc, env=env)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(p)
        out, _ = p.communicate()
        return -1, f"{out}\nkilled after {timeout} s"
    return p.returncode, out


def kill_all(p: subprocess.Popen[str]) -> None:
    """SIGKILL torchrun and every process it started (ranks run in sessions of their own)."""
    for pid in [p.pid, *descendants(p.pid)]:  # listed before any is killed and reparented
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{d}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        cur = todo.pop()
        kids = [c for c, pp in parent.items() if pp == cur]
        out += kids
        todo += kids
    return out
