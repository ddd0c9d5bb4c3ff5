"""Hostile peers of a multi-node save (two ranks, each its own node, tests/two_rank_worker.py):
the sizes a peer announces (a rank record, a gathered message, a broadcast, a streamed chunk)
are bounded before anything is allocated; a blob missed because a node-local tier lacks its
``scope`` gets the hint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Rank 0's results of ``tests/two_rank_worker.py`` (a two-node save, then a hostile
    rank 1), run once for the module."""
    import socket
    import subprocess
    import sys

    here, base = Path(__file__).parent, tmp_path_factory.mktemp("two_ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=f"{here.parent}{os.pathsep}{here}", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(here / "two_rank_worker.py"), str(r), str(port), str(base)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    line = next((ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")), None)
    assert line, outs[0][1][-3000:]
    return json.loads(line[7:])


def test_sizes_peers_announce_are_bounded_before_anything_is_allocated(two_ranks):
    res = two_ranks
    assert "announces a rank record of 1099511627776 bytes" in res["recv"], res
    assert res["gather"].startswith("FmstoreError: rank 1 sent a message of 1099511627776"), res
    assert "announced a broadcast of 1099511627776 bytes" in res["broadcast"], res
    assert "sent rank 0: a chunk of 1099511627776 bytes at offset 0" in res["stream"], res


def test_a_node_local_tier_without_its_scope_gets_the_hint_on_a_missed_blob(two_ranks):
    error = two_ranks["save"]
    assert "rank 1's blob is missing; not committing" in error, error
    assert "rank 1 ran on node n1, the coordinator on n0" in error, error
    assert 'set scope = "node" in [tiers.nvme]' in error, error
