"""Run a script under ``torchrun`` on this machine (``--nproc_per_node`` ranks, loopback
rendezvous), for tests and benchmarks of multi-rank jobs: the one launcher of ranks.

torchrun starts in a session of its own, and starts each rank in a session of its own, so
ending torchrun alone (what ``subprocess.run(..., timeout=...)`` does) would leave ranks
(and their DataLoader workers) running after a hang.  :func:`stop` ends the whole tree:
SIGTERM to torchrun's process group and to every process below it (torchrun then stops its
ranks itself), SIGKILL to whatever is left after a grace, and it returns once none of them
is alive.  Past ``timeout``, :func:`torchrun` and :func:`run` stop the tree and say which
timeout fired, with the tail of the log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .seaweed import free_ports

#: Seconds between the SIGTERM of a launch's processes and the SIGKILL of those left.
GRACE = 10.0
#: Characters of a launch's log a failure shows.
TAIL = 6000


class LaunchTimeout(AssertionError):
    """A launch ran past its timeout (its processes were stopped, ranks included)."""


def command(script: str, args: Sequence[str], *, nproc: int) -> list[str]:
    """The venv's torchrun running ``script args`` on ``nproc`` ranks on loopback."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_ports(1)[0]}", script, *args,
    ]  # fmt: skip


def start(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdout: Any = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """Start ``cmd`` (a torchrun command line) in a session of its own, stderr joining
    stdout, and return at once; end it with :func:`stop` (or :func:`kill_all`)."""
    return subprocess.Popen(
        list(cmd),
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        env=None if env is None else dict(env),
        cwd=cwd,
        start_new_session=True,
    )


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
    end it with :func:`stop` or :func:`kill_all` (its ranks run in sessions of their own)."""
    return start(command(script, args, nproc=nproc), env=env, cwd=cwd, stdout=stdout)


def torchrun(
    script: str,
    args: list[str],
    *,
    nproc: int,
    timeout: float,
    env: Mapping[str, str] | None = None,
    grace: float = GRACE,
) -> tuple[int, str]:
    """``(exit status, stdout and stderr)`` of ``script args`` on ``nproc`` ranks; the
    status is -1 when it ran past ``timeout`` seconds (and was stopped, ranks included; the
    output then ends with a line saying so); ``grace``: as :func:`stop`'s."""
    p = launch(script, args, nproc=nproc, env=env)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(p, grace)
        out, _ = p.communicate()
        return -1, f"{out}\n{_timed_out(p, timeout)}"
    return p.returncode, out


def run(
    cmd: Sequence[str],
    *,
    timeout: float,
    log: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    grace: float = GRACE,
) -> int:
    """Run ``cmd`` (a torchrun command line, see :func:`command`) to its end with its output
    in the file ``log``; its exit status.  Past ``timeout`` seconds every process of it is
    stopped (``grace``: as :func:`stop`'s) and :class:`LaunchTimeout` names the timeout,
    with the log's tail."""
    with open(log, "w") as f:
        p = start(cmd, env=env, cwd=cwd, stdout=f)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(p, grace)
    with open(log, errors="replace") as f:
        tail = f.read()[-TAIL:]
    raise LaunchTimeout(f"{_timed_out(p, timeout)}; the tail of {log}:\n{tail}")


def _timed_out(p: subprocess.Popen[Any], timeout: float) -> str:
    args = [os.fsdecode(a) for a in p.args] if isinstance(p.args, list) else [str(p.args)]
    what = " ".join(a for a in args[3:] if not a.startswith("--"))[:200]
    return f"the launch's timeout of {timeout} s fired ({what} ...): every process of it stopped"


def stop(p: subprocess.Popen[Any], grace: float = GRACE) -> None:
    """End the launch ``p`` and every process it started: SIGTERM to its process group and
    to every process below it, SIGKILL to those left after ``grace`` seconds; return once
    none of them is alive (each reaped, by torchrun or once reparented)."""
    seen = _tree(p)
    for pid in seen:
        _signal(pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=grace)
    kill_all(p, seen)


def kill_all(p: subprocess.Popen[Any], known: Sequence[int] = ()) -> None:
    """SIGKILL every process below torchrun (ranks run in sessions of their own; ``known``:
    more, listed earlier), then torchrun's process group, and wait until none is alive.

    The ranks go first, while torchrun lives to reap them: a rank whose parent died is
    reparented to a reaper that may never reap it (a container's init)."""
    below = [pid for pid in dict.fromkeys([*known, *_tree(p)]) if pid != p.pid]
    for pid in below:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while p.poll() is None and any(_exists(pid) for pid in below) and time.monotonic() < deadline:
        time.sleep(0.01)
    below += [pid for pid in _tree(p) if pid != p.pid and pid not in below]
    for pid in [p.pid, *below] if p.returncode is None else below:
        _signal(pid, signal.SIGKILL)
    p.wait()
    _wait_gone(below)


def _tree(p: subprocess.Popen[Any]) -> list[int]:
    return [] if p.returncode is not None else [p.pid, *descendants(p.pid)]


def _signal(pid: int, sig: int) -> None:
    """``sig`` to ``pid`` and to its process group where it leads one (torchrun's, a
    rank's: their DataLoader workers and checkpoint processes)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pids: Sequence[int], within: float = 60.0) -> None:
    """Until no process of ``pids`` is alive (SIGKILLed ones die at once; zombies are
    reaped by their parent or the reaper they were reparented to)."""
    deadline = time.monotonic() + within
    left = [pid for pid in pids if _alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = [pid for pid in left if _alive(pid)]


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
