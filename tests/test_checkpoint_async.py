"""async_save: snapshot semantics, one save in flight, errors surfacing on result()."""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import gc
import mmap
import sys
import weakref

import pytest
import torch

import fmstore
from fmstore.checkpoint import api
from fmstore.checkpoint.snapshot import STAGING, _layout


def test_checkpoint_keeps_values_of_the_moment_of_the_call(tmp_path):
    w = torch.randn(1000, 100)
    b = torch.arange(10)
    meta = {"lr": 0.1, "names": ["a"]}
    want_w, want_b = w.clone(), b.clone()
    state = {"w": w, "b": b, "view": w[5], "meta": meta}
    h = fmstore.async_save(state, tmp_path / "c")
    w.mul_(0).add_(7)  # the caller reuses its tensors at once
    b.zero_()
    meta["lr"] = 99.0
    meta["names"].append("b")
    m = h.result()
    assert h.done() and h.exception() is None and m.generation
    out = fmstore.load(tmp_path / "c")
    assert (
        torch.equal(out["w"], want_w)
        and torch.equal(out["b"], want_b)
        and torch.equal(out["view"], want_w[5])
    )
    assert out["meta"] == {"lr": 0.1, "names": ["a"]}


def test_staging_buffer_is_reused_across_saves(tmp_path):
    w = torch.randn(100_000)
    fmstore.async_save({"w": w}, tmp_path / "a").result()
    buf = STAGING._buf
    assert buf is not None
    fmstore.async_save({"w": w * 2}, tmp_path / "b").result()
    assert STAGING._buf is buf
    assert torch.equal(fmstore.load(tmp_path / "b")["w"], w * 2)


def test_second_call_waits_for_the_first_and_both_commit(tmp_path):
    states = [{"w": torch.full((200_000,), float(i))} for i in range(3)]
    handles = [fmstore.async_save(s, tmp_path / f"c{i}") for i, s in enumerate(states)]
    for i, h in enumerate(handles):
        h.result()
        assert torch.equal(fmstore.load(tmp_path / f"c{i}")["w"], states[i]["w"])


def test_error_surfaces_on_result(tmp_path):
    fmstore.save({"w": torch.ones(1)}, tmp_path / "c")
    h = fmstore.async_save({"w": torch.zeros(1)}, tmp_path / "c")
    with pytest.raises(fmstore.AlreadyExists):
        h.result()
    assert isinstance(h.exception(), fmstore.AlreadyExists)
    # The next save is not blocked by the failed one.
    fmstore.async_save({"w": torch.zeros(1)}, tmp_path / "c", overwrite=True).result()
    assert fmstore.load(tmp_path / "c")["w"].item() == 0.0


def test_unsupported_value_raises_at_call_time(tmp_path):
    with pytest.raises(TypeError, match=r"state\['x'\]"):
        fmstore.async_save({"x": object()}, tmp_path / "c")
    fmstore.async_save({"x": 1}, tmp_path / "c").result()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_through_pinned_staging(tmp_path):
    w = torch.randn(4096, 1024, device="cuda")
    want = w.cpu()
    h = fmstore.async_save({"w": w, "t": w}, tmp_path / "c")
    w.add_(1)  # queued on the current stream after the snapshot
    h.result()
    assert STAGING._pinned
    out = fmstore.load(tmp_path / "c", map_location="cpu")
    assert torch.equal(out["w"], want) and out["t"].data_ptr() == out["w"].data_ptr()
    back = fmstore.load(tmp_path / "c")
    assert back["w"].is_cuda


def _resident(t: torch.Tensor) -> float:
    """Share of the pages under ``t`` that are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    lo = (t.data_ptr() + page - 1) & ~(page - 1)
    hi = (t.data_ptr() + t.numel()) & ~(page - 1)
    vec = ctypes.create_string_buffer((hi - lo) // page)
    assert libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / len(vec.raw)


def _staging_size(state):
    return _layout(api._plan(state, api.SaveOptions()))[1]


@pytest.mark.skipif(sys.platform != "linux", reason="mincore and MADV_POPULATE_WRITE: Linux")
def test_prepare_faults_the_staging_buffer_in_before_the_first_save(tmp_path):
    STAGING.release()
    state = {"w": torch.randn(8 << 20), "step": 3}  # 32 MiB
    fresh = STAGING.get(_staging_size(state), pinned=False)
    if _resident(fresh) == 1.0:
        pytest.skip("the allocator handed back memory already in use: nothing to tell apart")
    del fresh
    STAGING.release()
    size = fmstore.prepare_async_save(state).result(timeout=60)
    buf = STAGING._buf
    assert buf is not None and size == buf.numel() == _staging_size(state)
    assert _resident(buf) == 1.0
    h = fmstore.async_save(state, tmp_path / "c")
    state["w"].zero_()
    h.result()
    assert STAGING._buf is buf  # the save copied into the prepared buffer
    assert fmstore.load(tmp_path / "c")["w"].abs().sum() > 0


def test_staging_stays_one_buffer_the_size_of_the_largest_state(tmp_path):
    STAGING.release()
    small, big = {"w": torch.ones(1 << 20)}, {"w": torch.ones(4 << 20)}
    fmstore.prepare_async_save(small).result(timeout=60)
    first = weakref.ref(STAGING._buf)
    fmstore.prepare_async_save(big).result(timeout=60)
    gc.collect()
    assert first() is None, "the smaller buffer must be freed when the buffer grows"
    buf = STAGING._buf
    assert STAGING.nbytes == _staging_size(big)
    fmstore.prepare_async_save(small).result(timeout=60)
    fmstore.async_save(small, tmp_path / "s").result()
    fmstore.async_save(big, tmp_path / "b").result()
    assert STAGING._buf is buf and STAGING.nbytes == _staging_size(big)


def test_save_during_prepare_stops_it_and_snapshots_all_the_same(tmp_path):
    STAGING.release()
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    want = state["w"].clone()
    STAGING.lock.acquire()  # a save in flight: the populate thread queues behind it
    try:
        fut = fmstore.prepare_async_save(state)
        stop = STAGING._stop
        saver = cf.ThreadPoolExecutor(1)
        pending = saver.submit(fmstore.async_save, state, tmp_path / "c")
        assert stop.wait(timeout=60)  # the snapshot has asked the populate to stop
    finally:
        STAGING.lock.release()
    assert fut.result(timeout=60) == 0
    h = pending.result(timeout=60)
    state["w"].zero_()
    h.result()
    saver.shutdown()
    assert torch.equal(fmstore.load(tmp_path / "c")["w"], want)
