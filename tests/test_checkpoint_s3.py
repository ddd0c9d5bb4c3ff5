"""Checkpoints on S3 (a real SeaweedFS), and S3 faults injected by the real fault proxy:
retried, or a clear error, never wrong data and never a visible torn checkpoint."""

from __future__ import annotations

import pytest
import torch

import fmstore
from fmstore.checkpoint import find_checkpoints, gc
from fmstore.errors import CorruptData, FmstoreError, NotFound
from fmstore.stores import open_store
from fmstore.testing.faultproxy import FaultProxy, Rule

pytestmark = pytest.mark.s3

CHUNKING = {"chunk_size": 1 << 20, "blob_size": 6 << 20}


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(1 << 20, generator=g)  # 4 MiB: several chunks
    return {
        "model": {"w": w.to(torch.bfloat16), "tied": w, "t": w, "small": torch.arange(100)},
        "optim": {"state": {0: {"exp_avg": torch.randn(3 << 20, generator=g)}}},  # 12 MiB: 2+ blobs
        "step": seed,
    }


def _check(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    assert torch.equal(got["model"]["w"].view(torch.int16), want["model"]["w"].view(torch.int16))
    assert torch.equal(got["model"]["tied"], want["model"]["tied"])
    assert got["model"]["t"].data_ptr() == got["model"]["tied"].data_ptr()
    assert torch.equal(got["optim"]["state"][0]["exp_avg"], want["optim"]["state"][0]["exp_avg"])


@pytest.fixture
def s3_url(s3_server, s3_bucket):
    opened = []

    def make(path: str, **kw):
        opened.append(open_store(f"s3://{s3_bucket}/{path}", **{**s3_server.store_options(), **kw}))
        return opened[-1]

    yield make
    for s in opened:
        fmstore.runtime.run(s.close(), timeout=30)


def test_s3_round_trip_partial_lazy_overwrite_and_gc(s3_url):
    st = _state(1)
    store = s3_url("run/step-1")
    m = fmstore.save(st, store, **CHUNKING)
    assert len(m.blobs) > 1 and max(len(s.chunks) for s in m.storages) > 1
    _check(fmstore.load(store), st)
    _check(fmstore.load(store, mmap=True), st)  # no local path on S3: read instead
    part = fmstore.load(store, keys="model.small")
    assert torch.equal(part["model"]["small"], torch.arange(100))
    lz = fmstore.load(store, lazy=True)
    assert torch.equal(lz["model"]["tied"], st["model"]["tied"])
    st2 = _state(2)
    fmstore.save(st2, store, overwrite=True, **CHUNKING)
    _check(fmstore.load(store), st2)
    # A crashed save next to it: blobs, no manifest.
    crashed = s3_url("run/step-2")
    m3 = fmstore.save(_state(3), crashed, **CHUNKING)
    fmstore.runtime.run(crashed.delete("manifest.json"))
    root = s3_url("run")
    assert find_checkpoints(root) == ["step-1"]
    rep = gc(root, older_than=0)
    assert len(rep.removed) == len(m3.blobs) and rep.checkpoints == ["step-1"]
    assert fmstore.runtime.run(root.list_keys("step-2/")) == []
    _check(fmstore.load(store), st2)


def test_auto_compression_on_s3_groups_bf16_and_keeps_fp32_raw(s3_url):
    st = _state(4)
    store = s3_url("auto/step-1")
    m = fmstore.save(st, store, **CHUNKING)
    codec_of = {t.name: {c.codec for c in m.storages[t.storage].chunks} for t in m.tensors}
    assert codec_of["model.w"] == {"bytegroup+zstd"}
    assert codec_of["optim.state.0.exp_avg"] == {"raw"}
    _check(fmstore.load(store), st)


def test_s3_no_checkpoint_is_not_found(s3_url):
    with pytest.raises(NotFound, match="no checkpoint"):
        fmstore.load(s3_url("nothing/here"))


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint_url, seed=7) as p:
        yield p


@pytest.fixture
def proxied(s3_server, s3_bucket, proxy):
    def make(path: str, **kw):
        opts = {
            **s3_server.store_options(),
            "endpoint_url": proxy.endpoint_url,
            "max_attempts": 6,
            "retry_deadline": 30.0,
            "read_timeout": 3.0,
            **kw,
        }
        opened.append(open_store(f"s3://{s3_bucket}/{path}", **opts))
        return opened[-1]

    opened: list = []
    yield make
    for s in opened:
        fmstore.runtime.run(s.close(), timeout=30)


@pytest.mark.parametrize(
    "rules",
    [
        [Rule("slowdown", method="PUT", times=4)],
        [Rule("reset_request", method="PUT", times=2)],
        [Rule("corrupt_request", method="PUT", times=2)],
        [Rule("error", method="POST", times=2)],
    ],
    ids=["503-on-put", "reset-mid-upload", "corrupted-upload", "500-on-multipart"],
)
def test_save_through_transient_faults_is_retried_and_loads_exact(proxied, proxy, rules):
    st = _state(4)
    proxy.set_plan(rules)
    # 16 MiB blobs in 5 MiB parts: the big blob is a multipart upload (POSTs).
    store = proxied("ck", part_size=5 << 20)
    fmstore.save(st, store, chunk_size=1 << 20, blob_size=16 << 20)
    assert sum(proxy.injected.values()) > 0
    proxy.clear()
    _check(fmstore.load(store), st)


@pytest.mark.parametrize(
    "rules",
    [
        [Rule("slowdown", method="GET", times=4)],
        [Rule("reset", method="GET", times=3)],
        [Rule("truncate", method="GET", times=3)],
        [Rule("stall", method="GET", times=1, delay=10.0)],
    ],
    ids=["503-on-get", "reset-mid-body", "truncated-body", "stalled-body"],
)
def test_load_through_transient_faults_is_retried_and_exact(proxied, proxy, rules):
    st = _state(5)
    store = proxied("ck")
    fmstore.save(st, store, **CHUNKING)
    proxy.set_plan(rules)
    _check(fmstore.load(store), st)
    assert sum(proxy.injected.values()) > 0


def test_corrupted_download_is_never_returned_as_data(proxied, proxy):
    st = _state(6)
    store = proxied("ck")
    fmstore.save(st, store, **CHUNKING)
    proxy.set_plan([Rule("corrupt_response", method="GET", path=r"\.bin")])  # every blob read
    with pytest.raises(CorruptData):
        fmstore.load(store)
    proxy.clear()
    _check(fmstore.load(store), st)


def test_outage_mid_save_is_a_clear_error_and_nothing_is_visible(proxied, proxy):
    store = proxied("ck", max_attempts=2, retry_deadline=3.0)
    proxy.set_plan(
        [Rule("reset_request", method="PUT", path=r"/0000(0[2-9]|[1-9])")]
    )  # later blobs keep failing
    with pytest.raises(FmstoreError):
        fmstore.save(_state(7), store, **CHUNKING)
    proxy.clear()
    with pytest.raises(NotFound):
        fmstore.load(store)
