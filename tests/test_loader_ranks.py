"""Many ranks on one node: 4 ranks under torchrun (gloo, CPU), 2 DataLoader workers each,
one node cache directory, streaming from the real SeaweedFS through proxies that log every
request (tests/loader_rank_worker.py runs in each rank)."""

from __future__ import annotations

import json
import os

import pytest
from loader_helpers import write_jsonl

from fmstore.loaders import ShardCache, write_dataset
from fmstore.loaders.formats import FormatOptions, load_format
from fmstore.stores import open_store
from fmstore.testing.faultproxy import FaultProxy, tally
from fmstore.testing.torchrun import torchrun

pytestmark = [pytest.mark.s3, pytest.mark.filterwarnings("ignore::UserWarning")]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "loader_rank_worker.py")
RANKS, WORKERS, BATCH = 4, 2, 4
SAMPLES = 480  # a multiple of RANKS: no rank pads its share with repeated samples


def make_dataset(tmp_path, s3_server, bucket: str, samples: int) -> tuple[str, list]:
    """``samples`` samples in shards of ~3 kB on S3, and the specs the loader sees."""
    url = f"s3://{bucket}/ds"
    store = open_store(url, **s3_server.store_options())
    write_dataset(write_jsonl(tmp_path / "src.jsonl", samples), store, shard_size=3000)
    shards = load_format(store, FormatOptions()).shards
    assert len(shards) >= 2 * RANKS  # more shards than ranks: workers meet on shared shards
    return url, shards


def run_epochs(tmp_path, s3_server, url, proxies, samples: int, **cfg) -> list[list[int]]:
    """Each epoch through its own proxy; the ids all ranks got, sorted, per epoch."""
    out = tmp_path / "out"
    out.mkdir()
    opts = s3_server.store_options()
    full = {
        "remote": url, "cache": str(tmp_path / "cache"), "out": str(out), "workers": WORKERS,
        "batch": BATCH, "limit": None, "direct_reads": 0, "lockstep": False,
        "epochs": [{**opts, "endpoint_url": p.endpoint_url} for p in proxies], **cfg,
    }  # fmt: skip
    rc, log = torchrun(WORKER, [json.dumps(full)], nproc=RANKS, timeout=300)
    assert rc == 0, log[-6000:]
    seen = []
    for e in range(len(proxies)):
        ranks = [json.loads((out / f"e{e}-r{r}.json").read_text()) for r in range(RANKS)]
        assert all(len(r) == samples // RANKS for r in ranks)
        seen.append(sorted(i for r in ranks for i in r))
    return seen


def test_four_ranks_on_one_node_cache_fetch_each_shard_once_per_epoch(
    tmp_path, s3_server, s3_bucket
):
    url, shards = make_dataset(tmp_path, s3_server, s3_bucket, SAMPLES)
    with FaultProxy(s3_server.endpoint_url) as cold, FaultProxy(s3_server.endpoint_url) as warm:
        seen = run_epochs(tmp_path, s3_server, url, [cold, warm], SAMPLES)
    # Every sample exactly once across the 4 ranks, in both epochs.
    assert seen == [list(range(SAMPLES))] * 2
    # Epoch 1: 8 workers on 4 ranks wanted every shard; each shard's bytes came from the
    # server exactly once (in as many ranged GETs as the cache cuts it into), no more.
    got = cold.fetched()
    for sp in shards:
        t = tally(got.get(f"/{s3_bucket}/ds/{sp.key}", []), sp.start, sp.start + sp.size)
        assert t.once and t.bytes == sp.size, (sp.key, t)
    # Epoch 2: the dataset fits the cache, so no shard is fetched again.
    assert not any(k.startswith(f"/{s3_bucket}/ds/shard") for k in warm.fetched()), warm.fetched()


def test_ranks_far_apart_under_a_small_cache_limit_still_finish(tmp_path, s3_server, s3_bucket):
    # Each rank starts a window's worth of batches after the one before it, so the ranks read
    # four different shuffle windows at once: the shards in use outgrow the smallest limit
    # allowed (twice the window).  Every waiting reader lets go of its shards first, so none
    # waits forever on another: the epochs finish, every sample once, the cache under its
    # limit; shards evicted while another rank still needed them are downloaded again.
    n = 1200
    url, shards = make_dataset(tmp_path, s3_server, s3_bucket, n)
    limit = sum(sorted((sp.cached_size for sp in shards), reverse=True)[:8])  # window 4
    window_batches = n // len(shards) * 4 // RANKS // BATCH
    with FaultProxy(s3_server.endpoint_url) as cold, FaultProxy(s3_server.endpoint_url) as warm:
        seen = run_epochs(
            tmp_path, s3_server, url, [cold, warm], n, limit=limit, stagger=window_batches
        )
    assert seen == [list(range(n))] * 2
    assert ShardCache(str(tmp_path / "cache"), limit).usage() <= limit
    got = cold.fetched()
    for sp in shards:  # every shard came whole at least once
        t = tally(got.get(f"/{s3_bucket}/ds/{sp.key}", []), sp.start, sp.start + sp.size)
        assert t.bytes >= sp.size, (sp.key, t)
