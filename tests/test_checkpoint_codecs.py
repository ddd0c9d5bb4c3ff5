"""Chunk codecs: bit-exact round trips for every float width, through libzstd's direct
bindings and through the public zstandard API (both must read each other's output), and
corrupt or truncated encodings raise CorruptData."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from fmstore.errors import CorruptData
from fmstore.format import codecs, zstdlib
from fmstore.format.codecs import decode_into, encode

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64]


def _bytes(dtype: torch.dtype, n: int) -> memoryview:
    g = torch.Generator().manual_seed(n)
    if dtype.is_complex:
        t = torch.randn(n, dtype=dtype, generator=g) * 0.02
    else:
        t = (torch.randn(n, generator=g) * 0.02).to(dtype)
    return memoryview(t.view(torch.uint8).numpy())


def _round_trip(raw: memoryview, group: int) -> str:
    used, stored = encode("bytegroup+zstd", raw, group)
    out = bytearray(len(raw))
    decode_into(used, stored, memoryview(out), group)
    assert bytes(out) == bytes(raw)
    return used


@pytest.fixture(params=["direct", "public"])
def zstd_path(request, monkeypatch):
    if request.param == "direct" and not zstdlib.AVAILABLE:
        pytest.skip("this zstandard build has no cffi bindings")
    if request.param == "public":
        monkeypatch.setattr(zstdlib, "AVAILABLE", False)
    return request.param


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", [0, 1, 3, 1000, 200_003])
def test_bytegroup_round_trips_bit_exact(zstd_path, dtype, n):
    group = torch.empty(0, dtype=dtype).element_size()
    used = _round_trip(_bytes(dtype, n), group)
    if n >= 1000:
        assert used == "bytegroup+zstd"


def test_bytegroup_shrinks_bf16_to_the_exponent_entropy(zstd_path):
    raw = _bytes(torch.bfloat16, 1 << 20)
    used, stored = encode("bytegroup+zstd", raw, 2)
    assert used == "bytegroup+zstd"
    # The low byte is noise (kept raw), the sign/exponent byte has ~2.7 bits of entropy.
    assert len(raw) / len(stored) > 1.4


def test_direct_and_public_paths_read_each_other(monkeypatch):
    if not zstdlib.AVAILABLE:
        pytest.skip("this zstandard build has no cffi bindings")
    raw = _bytes(torch.float32, 100_000)
    _, direct = encode("bytegroup+zstd", raw, 4)
    direct = bytes(direct)
    monkeypatch.setattr(zstdlib, "AVAILABLE", False)
    _, public = encode("bytegroup+zstd", raw, 4)
    public = bytes(public)
    for stored in (direct, public):
        for available in (True, False):
            monkeypatch.setattr(zstdlib, "AVAILABLE", available)
            out = bytearray(len(raw))
            decode_into("bytegroup+zstd", stored, memoryview(out), 4)
            assert bytes(out) == bytes(raw)


def test_plain_zstd_chunk_decodes_through_both_paths(zstd_path):
    raw = memoryview(np.zeros(100_000, dtype=np.int64).view(np.uint8))
    used, stored = encode("zstd", raw, 8)
    assert used == "zstd"
    out = bytearray(len(raw))
    decode_into(used, stored, memoryview(out), 8)
    assert bytes(out) == bytes(raw)


def test_noise_planes_are_kept_raw():
    raw = memoryview(np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8))
    assert encode("bytegroup+zstd", raw, 2)[0] == "raw"


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_damaged_bytegroup_chunk_raises_corrupt_data(zstd_path, damage):
    raw = _bytes(torch.bfloat16, 50_000)
    used, stored = encode("bytegroup+zstd", raw, 2)
    data = bytearray(stored)
    if damage == "flip":
        # Garble the compressed exponent plane (the second payload, after the raw one).
        flag, length = codecs._HDR.unpack_from(data, codecs._HDR.size)
        assert flag == 1
        start = 2 * codecs._HDR.size + len(raw) // 2
        data[start + 4 : start + length] = bytes(length - 4)
    elif damage == "truncate":
        data = data[:-10]
    else:
        data += b"\x00"
    with pytest.raises(CorruptData):
        decode_into(used, bytes(data), memoryview(bytearray(len(raw))), 2)


def test_frames_are_standard_zstd():
    """A plane written by the fast path is an ordinary zstd frame with its content size."""
    if not zstdlib.AVAILABLE:
        pytest.skip("this zstandard build has no cffi bindings")
    raw = _bytes(torch.bfloat16, 100_000)
    _, stored = encode("bytegroup+zstd", raw, 2)
    flag, length = codecs._HDR.unpack_from(stored, codecs._HDR.size)
    start = 2 * codecs._HDR.size + len(raw) // 2
    frame = bytes(stored[start : start + length])
    plane = zstandard.ZstdDecompressor().decompress(frame)
    assert plane == bytes(raw[1::2])
