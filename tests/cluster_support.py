"""What the tests of jobs on a :class:`fmstore.testing.cluster.Cluster` share: the wait on
an event that fails once every node's agent has exited (tests/test_cluster_chaos.py,
tests/test_dcp_replicas.py)."""

from __future__ import annotations

import time
from typing import Any


def wait_on_nodes(cond: Any, procs: list[Any], what: str, timeout: float = 600) -> None:
    """Until ``cond()`` holds (the event), or fail when every agent already exited."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert any(p.poll() is None for p in procs), f"every node exited before {what}"
        assert time.monotonic() < deadline, f"{what}: never happened"
        time.sleep(0.05)
