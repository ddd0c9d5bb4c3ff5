"""CPU and I/O priority for background work (the daemon, the policy helper of a training
process), so that copies, checksums and compression only use what training leaves idle.

``[daemon] priority``:

* ``"idle"`` (default): ``SCHED_IDLE`` (the scheduler runs these threads only on an
  otherwise idle core), nice 19, and the idle I/O class (``ionice -c3``: disk time only
  when nobody else asks for it);
* ``"low"``: nice 19 and the lowest best-effort I/O level (``ionice -c2 -n7``);
* ``"normal"``: unchanged.

On Linux these are per thread: :func:`lower_priority` sets every thread the process has,
and threads started later inherit it.  Elsewhere, or where the kernel refuses, it does what
it can and says what it could not do in one log line.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import sys

log = logging.getLogger("fmstore.tiering")

PRIORITIES = ("idle", "low", "normal")

# ioprio_set(2): no wrapper in libc or in the os module.
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "riscv64": 30, "ppc64le": 273, "s390x": 283}
_IOPRIO_GET = {k: v + 1 for k, v in _IOPRIO_SET.items()}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BE = 2
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_CLASS_SHIFT = 13


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _ioprio_set(tid: int, klass: int, level: int) -> None:
    nr = _IOPRIO_SET.get(platform.machine())
    if nr is None:
        raise OSError(f"ioprio_set is not known on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    value = (klass << _IOPRIO_CLASS_SHIFT) | level
    if libc.syscall(nr, _IOPRIO_WHO_PROCESS, tid, value) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def lower_priority(priority: str, pid: int = 0) -> list[str]:
    """Give process ``pid`` (0: this one), every thread of it, the background ``priority``
    (one of :data:`PRIORITIES`).  Returns what could not be done (empty when all was)."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
    if priority == "normal":
        return []
    pid = pid or os.getpid()
    failed: list[str] = []
    for tid in _threads(pid) if sys.platform.startswith("linux") else [pid]:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except (OSError, AttributeError) as e:
            failed.append(f"nice 19: {e}")
        if priority == "idle" and hasattr(os, "SCHED_IDLE"):
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError as e:
                failed.append(f"SCHED_IDLE: {e}")
        if sys.platform.startswith("linux"):
            klass, level = (_IOPRIO_CLASS_IDLE, 0) if priority == "idle" else (_IOPRIO_CLASS_BE, 7)
            try:
                _ioprio_set(tid, klass, level)
            except OSError as e:
                failed.append(f"I/O priority: {e}")
    failed = list(dict.fromkeys(failed))
    if failed:
        log.warning("background priority %r only in part: %s", priority, "; ".join(failed))
    return failed


def current(pid: int = 0) -> dict[str, object]:
    """Nice value, whether ``SCHED_IDLE`` is on and the I/O class (``"idle"``,
    ``"best-effort"``, ``"realtime"`` or ``"none"``) of ``pid`` (its main thread)."""
    pid = pid or os.getpid()
    out: dict[str, object] = {"nice": os.getpriority(os.PRIO_PROCESS, pid)}
    with contextlib.suppress(OSError, AttributeError):
        out["idle_scheduler"] = os.sched_getscheduler(pid) == os.SCHED_IDLE
    nr = _IOPRIO_GET.get(platform.machine())
    if nr is not None and sys.platform.startswith("linux"):
        value = ctypes.CDLL(None, use_errno=True).syscall(nr, _IOPRIO_WHO_PROCESS, pid)
        if value >= 0:
            names = {0: "none", 1: "realtime", 2: "best-effort", 3: "idle"}
            out["io_class"] = names.get(value >> _IOPRIO_CLASS_SHIFT, "unknown")
    return out
