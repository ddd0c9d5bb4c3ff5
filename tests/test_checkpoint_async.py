"""async_save: snapshot semantics, one save in flight, errors surfacing on result()."""

from __future__ import annotations

import pytest
import torch

import fmstore
from fmstore.checkpoint.snapshot import STAGING


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
