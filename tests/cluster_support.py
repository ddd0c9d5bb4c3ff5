"""What the tests of jobs on a :class:`fmstore.testing.cluster.Cluster` share: the wait on
an event that fails once the processes it depends on have exited (tests/test_cluster_chaos.py,
tests/test_dcp_replicas.py, tests/test_aside_nodes.py)."""

from __future__ import annotations

import time
from typing import Any


def wait_on_nodes(
    cond: Any, procs: list[Any], what: str, timeout: float = 600, *, each: bool = False
) -> None:
    """Until ``cond()`` holds (the event), or fail when every one of ``procs`` already
    exited (``each``: when any one did, e.g. a daemon the event needs)."""
    deadline = time.monotonic() + timeout
    while not cond():
        running = [p.poll() is None for p in procs]
        assert all(running) if each else any(running), f"{what}: the processes exited first"
        assert time.monotonic() < deadline, f"{what}: never happened"
        time.sleep(0.05)
