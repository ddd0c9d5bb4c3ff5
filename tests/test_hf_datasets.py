"""Hugging Face ``datasets`` through ``fmstore://`` URLs (:mod:`fmstore.fsspec`), the real
library on data built here: ``load_dataset("parquet")`` from a POSIX tier, from S3 and from a
lazily staged tier, streaming in offline mode, ``to_parquet``, and ``save_to_disk`` /
``load_from_disk`` with spawned workers.

Nothing is downloaded: the caches are under ``tmp_path`` and the Hub's endpoint is a closed
loopback port, so a request to it fails instead of fetching.  ``datasets``' offline mode
refuses every URL that is not a local path in a non-streaming ``load_dataset`` (it counts
them as reaching out), so those tests run online against that dead endpoint; the offline
test streams."""

from __future__ import annotations

import socket

import numpy as np
import pandas as pd
import pytest

from fmstore import runtime
from fmstore.stores import open_store
from tests.stage_data import write_s3_config

datasets = pytest.importorskip("datasets")
fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def dead_hub(monkeypatch) -> str:
    """An endpoint nothing answers: a bound loopback socket that never listens."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    import huggingface_hub.constants as hub_constants

    # Read at import time (the test process may have imported them already): set both the
    # environment (spawned workers) and the imported modules.
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", url)
    monkeypatch.setattr(hub_constants, "ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    yield url
    sock.close()


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, dead_hub):
    """``datasets``' caches under ``tmp_path``; the Hub unreachable."""
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache / "datasets"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache / "datasets")
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", cache / "downloads")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    return cache

    fsspec.AbstractFileSystem.clear_instance_cache()


@pytest.fixture
def s3_opts(tmp_path, s3_server, s3_bucket, monkeypatch):
    cfg = tmp_path / "s3.toml"
    write_s3_config(cfg, s3_server.endpoint_url, s3_bucket)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    yield {"config": str(cfg)}
    fsspec.AbstractFileSystem.clear_instance_cache()


def _frame(n: int, start: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(start)
    return pd.DataFrame(
        {
            "i": np.arange(start, start + n),
            "x": rng.random(n),
            "text": [f"row {k}" for k in range(start, start + n)],
        }
    )


def _write_parts(base: str, parts: int = 2, rows: int = 300, **opts) -> pd.DataFrame:
    frames = [_frame(rows, k * rows) for k in range(parts)]
    for k, df in enumerate(frames):
        df.to_parquet(f"{base}/train-{k:05d}-of-{parts:05d}.parquet", storage_options=opts)
    return pd.concat(frames, ignore_index=True)


def _same(ds, want: pd.DataFrame) -> None:
    got = ds.to_pandas().sort_values("i", ignore_index=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False)


def test_load_dataset_parquet_glob_from_a_posix_tier(posix_cfg, hf_cache, tmp_path):
    want = _write_parts("fmstore://nvme/corpus/data")
    ds = datasets.load_dataset(
        "parquet",
        data_files={"train": "fmstore://nvme/corpus/data/train-*.parquet"},
        split="train",
        cache_dir=str(hf_cache / "datasets"),
    )
    assert ds.num_rows == len(want)
    _same(ds, want)

    # datasets keys its download cache by URL alone; a file rewritten on the tier is read
    # again when asked to (what the documentation tells users to do).
    changed = _frame(10, 10_000)
    changed.to_parquet("fmstore://nvme/corpus/data/train-00001-of-00002.parquet")
    again = datasets.load_dataset(
        "parquet",
        data_files={"train": "fmstore://nvme/corpus/data/train-*.parquet"},
        split="train",
        cache_dir=str(hf_cache / "datasets"),
        download_mode="force_redownload",
    )
    _same(again, pd.concat([want[want["i"] < 300], changed], ignore_index=True))


@pytest.mark.s3
def test_load_dataset_to_parquet_and_save_to_disk_on_s3(s3_opts, hf_cache, s3_server, s3_bucket):
    want = _write_parts("fmstore://s3/corpus", **s3_opts)
    ds = datasets.load_dataset(
        "parquet",
        data_files="fmstore://s3/corpus/*.parquet",
        split="train",
        cache_dir=str(hf_cache / "datasets"),
        storage_options=s3_opts,
    )
    _same(ds, want)

    # Written back: one Parquet file and a save_to_disk directory in two shards, each shard
    # written by its own spawned worker with the storage options pickled to it.
    small = ds.filter(lambda r: r["i"] % 3 == 0)
    small.to_parquet("fmstore://s3/out/small.parquet", storage_options=s3_opts)
    small.save_to_disk("fmstore://s3/out/saved", num_proc=2, storage_options=s3_opts)

    raw = open_store(f"s3://{s3_bucket}/ds", **s3_server.store_options())  # the tier's prefix
    keys = sorted(m.key for m in runtime.run(_listing(raw, "out/")))
    assert keys == [
        "out/saved/data-00000-of-00002.arrow",
        "out/saved/data-00001-of-00002.arrow",
        "out/saved/dataset_info.json",
        "out/saved/state.json",
        "out/small.parquet",
    ]
    assert runtime.run(raw.leftovers()) == []  # no multipart upload left behind
    back = pd.read_parquet("fmstore://s3/out/small.parquet", storage_options=s3_opts)
    pd.testing.assert_frame_equal(
        back.sort_values("i", ignore_index=True),
        want[want["i"] % 3 == 0].reset_index(drop=True),
        check_dtype=False,
    )
    loaded = datasets.load_from_disk("fmstore://s3/out/saved", storage_options=s3_opts)
    assert loaded.num_rows == small.num_rows
    _same(loaded, want[want["i"] % 3 == 0].reset_index(drop=True))


async def _listing(store, prefix: str) -> list:
    return [m async for m in store.list(prefix, recursive=True)]


def test_save_to_disk_and_load_from_disk_on_a_posix_tier(posix_cfg, hf_cache, tmp_path):
    want = _frame(500)
    ds = datasets.Dataset.from_pandas(want)
    ds.save_to_disk("fmstore://lustre/saved", num_proc=2)
    shards = sorted(p.name for p in (tmp_path / "lustre" / "saved").iterdir())
    assert shards == [
        "data-00000-of-00002.arrow",
        "data-00001-of-00002.arrow",
        "dataset_info.json",
        "state.json",
    ]
    _same(datasets.load_from_disk("fmstore://lustre/saved"), want)


def test_lazily_staged_parquet_is_fetched_on_first_read(posix_cfg, hf_cache, tmp_path):
    from fmstore.tiering.copy.transfer import CopyItem
    from fmstore.tiering.staging.lazy import write_index

    src = tmp_path / "lustre" / "source"  # an index may name only tiers (or lazy_sources)
    (src / "train").mkdir(parents=True)
    frames = [_frame(200, k * 200) for k in range(2)]
    items = []
    for k, df in enumerate(frames):
        rel = f"train/p{k}.parquet"
        df.to_parquet(src / rel)
        items.append(CopyItem(rel, rel, (src / rel).stat().st_size))
    (tmp_path / "nvme" / "ds").mkdir(parents=True)
    runtime.run(write_index(open_store(str(tmp_path / "nvme" / "ds")), str(src), items))
    local = tmp_path / "nvme" / "ds" / "train"
    assert not local.exists()  # listed, nothing fetched yet

    ds = datasets.load_dataset(
        "parquet",
        data_files="fmstore://nvme/ds/train/*.parquet",  # the glob sees the listed files
        split="train",
        cache_dir=str(hf_cache / "datasets"),
    )
    _same(ds, pd.concat(frames, ignore_index=True))
    for k in range(2):  # fetched on first read and kept on the tier
        rel = f"train/p{k}.parquet"
        assert (tmp_path / "nvme" / "ds" / rel).read_bytes() == (src / rel).read_bytes()


def test_streaming_reads_fmstore_urls_in_offline_mode(posix_cfg, hf_cache, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    want = _write_parts("fmstore://nvme/corpus", parts=2, rows=50)
    stream = datasets.load_dataset(
        "parquet",
        data_files="fmstore://nvme/corpus/*.parquet",
        split="train",
        streaming=True,
    )
    rows = sorted((r["i"], r["text"]) for r in stream)
    assert rows == [(int(i), t) for i, t in zip(want["i"], want["text"])]


def test_the_file_system_pickles_to_an_equal_one(posix_cfg, tmp_path):
    import pickle

    import dill

    fs = fsspec.filesystem("fmstore", config=str(posix_cfg), block_size=1 << 16)
    fs.pipe("nvme/p.bin", b"payload")
    for dumps, loads in ((pickle.dumps, pickle.loads), (dill.dumps, dill.loads)):
        back = loads(dumps(fs))
        assert back.storage_options == fs.storage_options
        assert back.cat("nvme/p.bin") == b"payload"
    assert fs.unstrip_protocol("nvme/p.bin") == "fmstore://nvme/p.bin"
