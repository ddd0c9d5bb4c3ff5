"""Many ranks on one node: 4 ranks under torchrun (gloo, CPU), 2 DataLoader workers each,
one node cache directory, streaming from the real SeaweedFS through proxies that log every
request (tests/loader_rank_worker.py runs in each rank).  Both tests' runs share one launch of
the ranks (a module fixture), one after the other."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

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


def make_dataset(tmp_path, s3_server, bucket: str, samples: int, prefix: str) -> tuple[str, list]:
    """``samples`` samples in shards of ~3 kB on S3 under ``prefix``, and the specs the
    loader sees."""
    url = f"s3://{bucket}/{prefix}"
    store = open_store(url, **s3_server.store_options())
    write_dataset(write_jsonl(tmp_path / "src.jsonl", samples), store, shard_size=3000)
    shards = load_format(store, FormatOptions()).shards
    assert len(shards) >= 2 * RANKS  # more shards than ranks: workers meet on shared shards
    return url, shards


def config(tmp_path, s3_server, url, proxies, **cfg) -> dict:
    """The worker's config for one run: each epoch through its own proxy."""
    out = tmp_path / "out"
    out.mkdir()
    opts = s3_server.store_options()
    return {
        "remote": url, "cache": str(tmp_path / "cache"), "out": str(out), "workers": WORKERS,
        "batch": BATCH, "limit": None, "direct_reads": 0, "lockstep": False,
        "epochs": [{**opts, "endpoint_url": p.endpoint_url} for p in proxies], **cfg,
    }  # fmt: skip


def seen(cfg: dict, samples: int) -> list[list[int]]:
    """The ids all ranks got in each epoch of a run, sorted."""
    got = []
    for e in range(len(cfg["epochs"])):
        out = Path(cfg["out"])
        ranks = [json.loads((out / f"e{e}-r{r}.json").read_text()) for r in range(RANKS)]
        assert all(len(r) == samples // RANKS for r in ranks)
        got.append(sorted(i for r in ranks for i in r))
    return got


@pytest.fixture(scope="module")
def launch(tmp_path_factory, s3_server):
    """Both tests' runs in one launch of the ranks, one after the other, each on its own
    dataset, cache and pair of proxies (cold epoch, warm epoch): run name -> (its config,
    its dataset's shards, the cold proxy's and the warm one's fetched requests)."""
    bucket = s3_server.create_bucket()
    runs: dict[str, dict] = {
        "once": {"samples": SAMPLES, "cfg": {}},
        # Each rank starts a window's worth of batches after the one before it.
        "apart": {"samples": 1200, "cfg": {}},
    }
    try:
        with contextlib.ExitStack() as stack:
            cfgs = []
            for name, r in runs.items():
                base = tmp_path_factory.mktemp(name)
                url, r["shards"] = make_dataset(base, s3_server, bucket, r["samples"], name)
                if name == "apart":
                    shards, n = r["shards"], r["samples"]
                    r["limit"] = sum(sorted((sp.cached_size for sp in shards), reverse=True)[:8])
                    window_batches = n // len(shards) * 4 // RANKS // BATCH
                    r["cfg"] = {"limit": r["limit"], "stagger": window_batches}
                r["proxies"] = [
                    stack.enter_context(FaultProxy(s3_server.endpoint_url)) for _ in range(2)
                ]
                r["config"] = config(base, s3_server, url, r["proxies"], **r["cfg"])
                cfgs.append(r["config"])
            rc, log = torchrun(WORKER, [json.dumps(cfgs)], nproc=RANKS, timeout=600)
            assert rc == 0, log[-6000:]
        yield {name: (r, [p.fetched() for p in r["proxies"]], bucket) for name, r in runs.items()}
    finally:
        s3_server.delete_bucket(bucket)


def test_four_ranks_on_one_node_cache_fetch_each_shard_once_per_epoch(launch):
    r, (cold, warm), bucket = launch["once"]
    # Every sample exactly once across the 4 ranks, in both epochs.
    assert seen(r["config"], SAMPLES) == [list(range(SAMPLES))] * 2
    # Epoch 1: 8 workers on 4 ranks wanted every shard; each shard's bytes came from the
    # server exactly once (in as many ranged GETs as the cache cuts it into), no more.
    for sp in r["shards"]:
        t = tally(cold.get(f"/{bucket}/once/{sp.key}", []), sp.start, sp.start + sp.size)
        assert t.once and t.bytes == sp.size, (sp.key, t)
    # Epoch 2: the dataset fits the cache, so no shard is fetched again.
    assert not any(k.startswith(f"/{bucket}/once/shard") for k in warm), warm


def test_ranks_far_apart_under_a_small_cache_limit_still_finish(launch):
    # Each rank starts a window's worth of batches after the one before it, so the ranks read
    # four different shuffle windows at once: the shards in use outgrow the smallest limit
    # allowed (twice the window).  Every waiting reader lets go of its shards first, so none
    # waits forever on another: the epochs finish, every sample once, the cache under its
    # limit; shards evicted while another rank still needed them are downloaded again.
    r, (cold, _), bucket = launch["apart"]
    n = r["samples"]
    assert seen(r["config"], n) == [list(range(n))] * 2
    assert ShardCache(r["config"]["cache"], r["limit"]).usage() <= r["limit"]
    for sp in r["shards"]:  # every shard came whole at least once
        t = tally(cold.get(f"/{bucket}/apart/{sp.key}", []), sp.start, sp.start + sp.size)
        assert t.bytes >= sp.size, (sp.key, t)
