"""Shared benchmark plumbing: timing, cold caches, the machine, tables and JSON results."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "out"


def drop_caches() -> bool:
    """Drop the page cache (cold reads); False when this machine does not allow it."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dirty_bytes() -> int:
    """Dirty + Writeback bytes in the page cache, from /proc/meminfo (0 where unreadable)."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(("Dirty:", "Writeback:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


def busy_cpu_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (user, nice, system,
    irq, softirq from /proc/stat; 0.0 where unreadable): the difference over a timed span
    is what everything on the machine, servers included, used in it."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (a SeaweedFS server) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for children (and theirs)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


_REPORTED = "/sys/module/page_reporting/parameters/reported_kib"


def _reported_kib() -> int | None:
    try:
        with open(_REPORTED) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def settle(max_dirty: int = 32 << 20, timeout: float = 60.0) -> bool:
    """Bring the machine to the state every timed case starts from: no dirty pages left by
    the case before (written back, waited for until under ``max_dirty``: other processes
    may keep a little dirty), the page cache dropped, and, on a VM whose balloon reports
    free memory to the host, that reporting finished (quiet for 3 s): a page freed by the
    drop costs a host fault on its next use once reported, so a case must not start while
    part of the memory is reported and part not.  False when caches cannot be dropped here
    (the case then starts warm)."""
    deadline = time.monotonic() + timeout
    os.sync()
    while dirty_bytes() > max_dirty and time.monotonic() < deadline:
        time.sleep(0.1)
        os.sync()
    dropped = drop_caches()
    last, quiet_since = _reported_kib(), time.monotonic()
    while last is not None and time.monotonic() - quiet_since < 3.0:
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)
        now = _reported_kib()
        if now != last:
            last, quiet_since = now, time.monotonic()
    return dropped


def timed(fn: Callable[[], Any], repeat: int = 1) -> float:
    """Best wall time of ``repeat`` runs of ``fn`` (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def machine() -> dict[str, Any]:
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) // (1024 * 1024)
    except OSError:
        pass
    cpu = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "mem_gib": mem,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6 if seconds > 0 else float("nan")


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Print rows as an aligned text table (also returned, for RESULTS.md)."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
        for i, c in enumerate(columns)
    ]
    lines = [
        f"## {title}",
        "",
        "| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |",
    ]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        lines.append("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |")
    text = "\n".join(lines)
    print(text + "\n", flush=True)
    return text


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def save_json(name: str, payload: dict[str, Any]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    payload = {"machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"results: {path}")
    return path


def have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def disk_of(path: str) -> str:
    try:
        return subprocess.run(
            ["df", "-h", path], capture_output=True, text=True
        ).stdout.splitlines()[-1]
    except Exception:
        return "?"
