"""A replica holder takes from each source only what the save plan gives it: blob numbers
in its range and bytes up to its items', refused as they arrive; a failed source's blobs
are removed at once, not left for the sweep (one pair of gloo ranks, real sockets)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fmstore.checkpoint.dcp.replica_stream import Part, parts_held

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    base = tmp_path_factory.mktemp("replica_plan")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=f"{HERE.parent}{os.pathsep}{HERE}", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "replica_plan_worker.py"), str(r), str(port), str(base)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0 and (base / f"{r}.json").exists(), outs[r][1][-3000:]
    return [json.loads((base / f"{r}.json").read_text()) for r in (0, 1)]


def test_an_honest_save_streams_both_kinds_of_part_within_their_plan(ranks):
    for r, res in enumerate(ranks):
        assert res["save"] == "", res["save"]
        other = 1 - r
        assert "manifest.json" in res["replica"], res
        assert any(p.endswith(f"rank-{other:06d}.json") for p in res["replica"]), res


def test_a_chunk_outside_the_sources_planned_blobs_is_refused_unwritten(ranks):
    got = ranks[0]["blob"]
    assert "a chunk that names blob 10, outside its planned blobs 8..9" in got["error"], got
    assert got["left"] == [], got  # written before


def test_bytes_beyond_the_sources_plan_are_refused_and_its_blobs_removed_at_once(ranks):
    got = ranks[0]["bytes"]
    assert "takes its part to 12288 bytes, more than the 8192 its plan holds" in got["error"]
    assert got["left"] == [], got  # blob 8 was whole and committed: left for the sweep before


def test_a_source_that_fails_on_arrival_leaves_no_blob_behind(ranks):
    got = ranks[0]["crc"]
    assert "fails its CRC32C on arrival" in got["error"], got
    assert got["left"] == [], got


def test_each_holder_is_given_the_parts_of_the_ranks_it_holds():
    nodes = ["n0", "n0", "n1", "n1"]
    parts = [(0, 3, 100), (3, 3, None), (6, 3, 50), (9, 4, 70)]
    held = parts_held(nodes, 1, [None] * 4, parts)
    # the ring: n0's ranks are held on n1 and n1's on n0, each rank's part beside it
    assert sorted(s for h in held[2:] for s, *_ in h) == [0, 1]
    assert sorted(s for h in held[:2] for s, *_ in h) == [2, 3]
    for h in held:
        for s, *bound in h:
            assert tuple(bound) == parts[s]
    assert parts_held(nodes, 0, [None] * 4, parts) == [(), (), (), ()]
    assert Part(3, 3, None).refuses(5, 1 << 40) == ""
    assert "outside" in Part(3, 3, None).refuses(6, 0)
