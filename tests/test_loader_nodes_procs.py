"""Several nodes on loopback: 4 nodes x 2 ranks as plain processes (each node its own cache
directory and its own proxy to the real SeaweedFS, which counts the bytes the node read),
then the same epoch resumed mid-way on 2 nodes (tests/loader_node_worker.py runs in each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from loader_helpers import write_jsonl

from fmstore.loaders import write_dataset
from fmstore.loaders.formats import FormatOptions, load_format
from fmstore.stores import open_store
from fmstore.testing.faultproxy import FaultProxy, tally

pytestmark = [pytest.mark.s3, pytest.mark.filterwarnings("ignore::UserWarning")]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "loader_node_worker.py")
SAMPLES, BATCH, PER_NODE = 1920, 8, 2


def launch(tmp_path, nodes: int, runs_of_node, timeout: float = 240) -> None:
    """``nodes`` x PER_NODE rank processes, as a launcher starts them; waits for all."""
    procs = []
    world = nodes * PER_NODE
    for n in range(nodes):
        cfg = {
            "remote": runs_of_node["remote"], "cache": str(tmp_path / f"cache-n{n}"),
            "out": str(tmp_path / "out"), "batch": BATCH, "runs": runs_of_node["runs"](n),
            # No ranged reads of the first samples: on shards of 2 kB they are whole shards
            # (neighbouring ranges are merged), which would count a shard twice.
            "direct_reads": 0,
        }  # fmt: skip
        for lr in range(PER_NODE):
            env = {
                **os.environ, "RANK": str(n * PER_NODE + lr), "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(lr), "LOCAL_WORLD_SIZE": str(PER_NODE),
                "FMSTORE_NODE_ID": f"node{n}", "PYTHONWARNINGS": "ignore",
            }  # fmt: skip
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, json.dumps(cfg)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )  # fmt: skip
            )
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, out[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def result(tmp_path, tag: str, rank: int) -> dict:
    return json.loads((tmp_path / "out" / f"{tag}-r{rank}.json").read_text())


def test_four_nodes_each_download_their_share_and_a_resume_on_two_nodes_is_exact(
    tmp_path, s3_server, s3_bucket
):
    url = f"s3://{s3_bucket}/ds"
    opts = s3_server.store_options()
    store = open_store(url, **opts)
    write_dataset(write_jsonl(tmp_path / "src.jsonl", SAMPLES), store, shard_size=2000)
    shards = load_format(store, FormatOptions()).shards
    total = sum(sp.size for sp in shards)
    assert len(shards) >= 48
    (tmp_path / "out").mkdir()
    proxies = [FaultProxy(s3_server.endpoint_url).start() for _ in range(4)]
    try:
        # Epoch 0 whole through each node's proxy; epoch 1 stopped after 9 batches.
        launch(tmp_path, 4, {"remote": url, "runs": lambda n: [
            {"tag": "e0", "epoch": 0, "state": None, "stop_after": None,
             "options": {**opts, "endpoint_url": proxies[n].endpoint_url}},
            {"tag": "e1", "epoch": 1, "state": None, "stop_after": 9, "options": opts},
        ]})  # fmt: skip
        fetched = [p.fetched() for p in proxies]
    finally:
        for p in proxies:
            p.stop()
    seen = [result(tmp_path, "e0", r)["ids"] for r in range(8)]
    assert len({len(s) for s in seen}) == 1
    assert Counter(i for s in seen for i in s) == Counter(range(SAMPLES))  # each sample once
    per_node = [
        sum(
            tally(got.get(f"/{s3_bucket}/ds/{sp.key}", []), sp.start, sp.start + sp.size).bytes
            for sp in shards
        )
        for got in fetched
    ]
    # Only the up to 3 shards cut between two canonical partitions are read by two nodes.
    assert sum(per_node) <= 1.1 * total, (per_node, total)
    assert max(per_node) <= 1.3 / 4 * total, (per_node, total)

    # Epoch 1 resumed from rank 0's state on 2 nodes x 2 ranks: the rest, each sample once.
    head = [i for r in range(8) for i in result(tmp_path, "e1", r)["ids"]]
    state = result(tmp_path, "e1", 0)["state"]
    assert state["position"] == 9 * BATCH * 8 and state["canonical"] == 4
    launch(tmp_path, 2, {"remote": url, "runs": lambda n: [
        {"tag": "e1b", "epoch": 1, "state": state, "stop_after": None, "options": opts},
    ]})  # fmt: skip
    rest = [i for r in range(4) for i in result(tmp_path, "e1b", r)["ids"]]
    assert Counter(head + rest) == Counter(range(SAMPLES))
