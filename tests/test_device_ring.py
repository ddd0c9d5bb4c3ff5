"""The pipelined path onto a device (fmstore.checkpoint.devring), tested without a GPU:
``route_cpu`` sends loads onto the CPU through the same ring of bounce buffers a CUDA load
uses, and records every copy out of a slot.  With two slots every byte must pass through
them, so a path that bypasses the ring (a plain read into the destination) fails these
tests.  The CUDA tests at the end run where CUDA is present and skip cleanly elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

import fmstore
from fmstore.checkpoint import read_manifest_sync
from fmstore.checkpoint.devring import route_cpu
from fmstore.errors import CorruptData

KIB = 1 << 10


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=g)  # 96 KiB
    return {
        "model": {"w": w, "b": torch.arange(1000, dtype=torch.int64), "wt": w.t()},
        "opt": {"m": torch.randn(40_000, generator=g).to(torch.bfloat16), "step": 3},
        "zeros": torch.zeros(50_000),  # compresses to almost nothing
    }


def _total(uri: str) -> int:
    return sum(s.nbytes for s in read_manifest_sync(uri).storages)


def _same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def test_two_slot_ring_carries_every_byte_with_chunks_straddling_slots(tmp_path):
    state = _state()
    uri = str(tmp_path / "ck")
    fmstore.save(state, uri, compression="raw", chunk_size=64 * KIB)
    with route_cpu(slots=2, slot_bytes=40 * KIB) as rec:  # a 64 KiB chunk is 40 + 24
        out = fmstore.load(uri, map_location="cpu")
    _same(out, state)
    assert out["model"]["wt"].untyped_storage().data_ptr() == (
        out["model"]["w"].untyped_storage().data_ptr()
    )  # views still share their storage
    assert {i for i, _ in rec.uses} == {0, 1}
    assert sum(n for _, n in rec.uses) == _total(uri)
    assert max(n for _, n in rec.uses) == 40 * KIB
    assert 24 * KIB in {n for _, n in rec.uses}  # the tail of a chunk that straddled
    # Each slot is reused many times: a slot comes back only after its copy.
    assert min(sum(1 for i, _ in rec.uses if i == s) for s in (0, 1)) >= 4


@pytest.mark.parametrize("slot_kib", [40, 256])  # smaller than a chunk, and larger
def test_compressed_chunks_decode_through_the_ring(tmp_path, slot_kib):
    state = _state()
    uri = str(tmp_path / "ck")
    fmstore.save(state, uri, compression="bytegroup+zstd", chunk_size=64 * KIB)
    codecs = {c.codec for s in read_manifest_sync(uri).storages for c in s.chunks}
    assert codecs - {"raw"}, codecs
    with route_cpu(slots=2, slot_bytes=slot_kib * KIB) as rec:
        out = fmstore.load(uri, map_location="cpu")
    _same(out, state)
    assert sum(n for _, n in rec.uses) == _total(uri)


def test_lazy_and_keys_loads_go_through_the_ring(tmp_path):
    state = _state()
    uri = str(tmp_path / "ck")
    fmstore.save(state, uri, compression="raw", chunk_size=64 * KIB)
    with route_cpu(slots=2, slot_bytes=48 * KIB) as rec:
        part = fmstore.load(uri, map_location="cpu", keys="opt")
        assert sum(n for _, n in rec.uses) == state["opt"]["m"].nbytes  # type: ignore[index]
        lazy = fmstore.load(uri, map_location="cpu", lazy=True)
        try:
            w = lazy["model"]["w"]
        finally:
            lazy.close()
    _same(part["opt"], state["opt"])
    _same(w, state["model"]["w"])  # type: ignore[index]


def test_checksum_failure_mid_stream_raises_corrupt_data_and_returns_nothing(tmp_path):
    state = {"a": torch.arange(64 * KIB, dtype=torch.float32)}  # 256 KiB: four chunks
    uri = str(tmp_path / "ck")
    fmstore.save(state, uri, compression="raw", chunk_size=64 * KIB)
    m = read_manifest_sync(uri)
    last = m.storages[0].chunks[-1]
    path = os.path.join(uri, m.blob_key(last.blob))
    with open(path, "r+b") as f:  # damage the last chunk's final bytes
        f.seek(last.offset + last.length - 4)
        f.write(b"\xff\xff\xff\xff")
    with route_cpu(slots=2, slot_bytes=32 * KIB) as rec, pytest.raises(CorruptData) as ei:
        fmstore.load(uri, map_location="cpu")
    assert "checksum mismatch" in str(ei.value) and "'a'" in str(ei.value)
    assert rec.uses  # the failure came after copies out of the ring had started


def test_s3_loads_through_the_ring_with_ranged_reads(s3_store):
    state = _state()
    fmstore.save(state, s3_store, compression="zstd", chunk_size=64 * KIB)
    with route_cpu(slots=2, slot_bytes=40 * KIB) as rec:
        out = fmstore.load(s3_store, map_location="cpu")
    _same(out, state)
    assert {i for i, _ in rec.uses} == {0, 1}


def test_manager_restore_goes_through_the_ring(tmp_path):
    from tiering_helpers import posix_config

    from fmstore import CheckpointManager

    config = posix_config(str(tmp_path / "t"), {"ladder": ["nvme", "lustre"]}, ("nvme", "lustre"))
    state = _state()
    with CheckpointManager("runs/r", config=config, run_policies=False) as mgr:
        mgr.save(5, state).result()
        with route_cpu(slots=2, slot_bytes=64 * KIB) as rec:
            out = mgr.restore(map_location="cpu")
    _same(out, state)
    assert {i for i, _ in rec.uses} == {0, 1}


# ---- CUDA (skipped without it) -------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_state() -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(512, 1024, generator=g)
    return {
        "w": base.cuda(),
        "wt": base.cuda().t(),  # non-contiguous
        "bf": base.to(torch.bfloat16).cuda(),
        "i": torch.arange(10_000).cuda(),
        "cpu": torch.ones(7),
    }


@cuda
@pytest.mark.parametrize("codec", ["raw", "zstd", "bytegroup+zstd"])
def test_cuda_every_codec_and_shared_storage(tmp_path, codec):
    state = _cuda_state()
    state["view"] = state["w"][10:20]  # type: ignore[index]
    uri = str(tmp_path / "ck")
    fmstore.save(state, uri, compression=codec, chunk_size=1 << 20)
    out = fmstore.load(uri, map_location="cuda")
    for k, v in state.items():
        assert out[k].device.type == "cuda"
        assert torch.equal(out[k].cpu(), v.cpu())  # type: ignore[union-attr]
    assert out["view"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    assert not out["wt"].is_contiguous()


@cuda
@pytest.mark.parametrize(
    "where",
    ["cuda", torch.device("cuda", 0), {"cpu": "cuda:0", "cuda:0": "cuda:0"}, "callable"],
    ids=["str", "device", "dict", "callable"],
)
def test_cuda_map_location_forms(tmp_path, where):
    state = _cuda_state()
    uri = str(tmp_path / "ck")
    fmstore.save(state, uri)
    if where == "callable":
        where = lambda storage, loc: storage.cuda(0)  # noqa: E731
    out = fmstore.load(uri, map_location=where)
    for k, v in state.items():
        assert out[k].device == torch.device("cuda", 0)
        assert torch.equal(out[k].cpu(), v.cpu())  # type: ignore[union-attr]


@cuda
def test_cuda_load_while_the_default_stream_is_busy(tmp_path):
    state = _cuda_state()
    uri = str(tmp_path / "ck")
    fmstore.save(state, uri)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # queue work on the default stream, do not wait for it
        big = big @ big
        big /= big.norm()
    out = fmstore.load(uri, map_location="cuda", lazy=True)
    try:
        got = out["w"]
        got.add_(0)  # used at once on the caller's stream
        assert torch.equal(got.cpu(), state["w"].cpu())  # type: ignore[union-attr]
    finally:
        out.close()
    torch.cuda.synchronize()


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_dcp_reader_fills_its_destinations_through_the_ring(tmp_path, compression):
    import warnings

    import torch.distributed.checkpoint as dcp

    from fmstore.checkpoint.dcp import Reader, Writer

    g = torch.Generator().manual_seed(5)
    sd = {"w": torch.randn(100, 300, generator=g), "z": torch.zeros(30_000), "i": torch.arange(9)}
    uri = str(tmp_path / "dcp")
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=Writer(uri, compression=compression, chunk_size=64 * KIB),
                 no_dist=True)  # fmt: skip
        with route_cpu(slots=2, slot_bytes=40 * KIB) as rec:
            dcp.load(out, storage_reader=Reader(uri, direct_min=4096), no_dist=True)
    for k in sd:
        assert torch.equal(out[k], sd[k])
    assert {i for i, _ in rec.uses} == {0, 1}
    assert sum(n for _, n in rec.uses) == sum(v.nbytes for v in sd.values())


@cuda
def test_cuda_dcp_reader_into_cuda_tensors_whole_and_resharded(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from fmstore.checkpoint.dcp import Reader, Writer

    sd = {k: v for k, v in _cuda_state().items() if k != "wt"}
    uri = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=Writer(uri, compression="zstd"), no_dist=True)
        out = {k: torch.zeros_like(v) for k, v in sd.items()}  # type: ignore[arg-type]
        dcp.load(out, storage_reader=Reader(uri), no_dist=True)
    for k, v in sd.items():
        assert out[k].device == v.device and torch.equal(out[k].cpu(), v.cpu())  # type: ignore[union-attr]
