"""Chunk codecs: ``raw``, ``zstd`` and ``bytegroup+zstd``.

``bytegroup+zstd`` splits each element's bytes into planes (all first bytes, then all second
bytes, ...) before compressing: the sign/exponent bytes of floats are highly repetitive while
the low mantissa bytes are noise, so grouping lets zstd find the redundancy.  Each plane is
compressed on its own and kept raw when a probe shows it does not shrink, which skips the
expensive part for noise planes.  Layout of a ``bytegroup+zstd`` chunk (``g`` = group size,
the element size, recorded in the manifest)::

    g x (flag: u8 [0 raw, 1 zstd], length: u64 LE)   header, 9*g bytes
    plane 0 payload, plane 1 payload, ...           concatenated

All functions here are pure CPU work; zstandard and numpy release the GIL, so they run in
parallel in :func:`fmstore.runtime.to_cpu`.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import torch
import zstandard

from ..errors import CorruptData
from ..stores.base import Buffer
from .dtypes import is_floating

#: Every codec this version can read and write.
CODECS = ("raw", "zstd", "bytegroup+zstd")
#: zstd level used for checkpoints: level 1 keeps compression near disk speed.
ZSTD_LEVEL = 1
#: A plane (or chunk) is kept raw unless a probe of this many bytes shrinks by SHRINK.
_PROBE = 64 << 10
_SHRINK = 0.97
_HDR = struct.Struct("<BQ")

_local = threading.local()


def _cctx() -> zstandard.ZstdCompressor:
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def choose_codec(compression: str, dtype: torch.dtype) -> str:
    """The codec to try for a chunk of ``dtype`` under the caller's ``compression`` setting.

    ``auto``: ``bytegroup+zstd`` for multi-byte floating and complex dtypes, ``zstd`` for
    the rest.  ``none`` is a synonym of ``raw``.  The writer still falls back to ``raw`` for
    a chunk whose encoding does not shrink.
    """
    if compression in ("raw", "none", None):
        return "raw"
    if compression == "auto":
        return "bytegroup+zstd" if is_floating(dtype) and dtype.itemsize > 1 else "zstd"
    if compression == "bytegroup+zstd" and dtype.itemsize == 1:
        return "zstd"
    if compression not in CODECS:
        raise ValueError(
            f"unknown compression {compression!r}: use auto, raw, zstd or bytegroup+zstd"
        )
    return compression


def _compressible(data: Buffer) -> bool:
    view = memoryview(data)[:_PROBE]
    if len(view) < 512:
        return True
    return len(_cctx().compress(view)) < len(view) * _SHRINK


def encode(codec: str, data: Buffer, group: int = 1) -> tuple[str, Buffer]:
    """Encode one chunk; returns ``(codec actually used, stored bytes)``.

    Falls back to ``("raw", data)`` (no copy) when the chunk does not shrink.
    """
    raw = memoryview(data).cast("B")
    n = len(raw)
    if codec == "raw" or n == 0:
        return "raw", raw
    if codec == "zstd":
        if not _compressible(raw):
            return "raw", raw
        out = _cctx().compress(raw)
        return ("zstd", out) if len(out) < n * _SHRINK else ("raw", raw)
    if codec == "bytegroup+zstd":
        if group <= 1 or n % group:
            return encode("zstd", raw)
        out = _bytegroup_encode(raw, group)
        return ("bytegroup+zstd", out) if len(out) < n * _SHRINK else ("raw", raw)
    raise ValueError(f"unknown codec {codec!r}")


def _bytegroup_encode(raw: memoryview, group: int) -> bytes:
    a = np.frombuffer(raw, dtype=np.uint8)
    planes = np.ascontiguousarray(a.reshape(-1, group).T)
    header = bytearray()
    payloads: list[Buffer] = []
    for p in planes:
        pv = memoryview(p)
        if _compressible(pv):
            z = _cctx().compress(pv)
            if len(z) < len(pv) * _SHRINK:
                header += _HDR.pack(1, len(z))
                payloads.append(z)
                continue
        header += _HDR.pack(0, len(pv))
        payloads.append(pv)
    return b"".join([bytes(header), *payloads])


def decode_into(codec: str, stored: Buffer, out: memoryview, group: int = 1) -> None:
    """Decode one chunk's ``stored`` bytes into ``out`` (exactly the chunk's raw length).

    Raises :class:`CorruptData` when the bytes do not decode to the expected length; the
    caller adds tensor, blob and tier to the message.
    """
    out = out.cast("B") if out.format != "B" else out
    n = len(out)
    if codec == "raw":
        if len(stored) != n:
            raise CorruptData(f"raw chunk has {len(stored)} bytes, expected {n}")
        out[:] = stored
        return
    if codec == "zstd":
        _zstd_into(stored, out)
        return
    if codec == "bytegroup+zstd":
        _bytegroup_decode(memoryview(stored).cast("B"), out, group)
        return
    raise CorruptData(f"unknown codec {codec!r} (written by a newer fmstore?)")


def _zstd_into(stored: Buffer, out: memoryview) -> None:
    n = len(out)
    try:
        data = _dctx().decompress(stored, max_output_size=n)
    except zstandard.ZstdError as e:
        raise CorruptData(f"zstd chunk does not decode: {e}") from None
    if len(data) != n:
        raise CorruptData(f"zstd chunk decodes to {len(data)} bytes, expected {n}")
    out[:] = data


def _bytegroup_decode(stored: memoryview, out: memoryview, group: int) -> None:
    n = len(out)
    if group <= 1 or n % group or len(stored) < _HDR.size * group:
        raise CorruptData("bytegroup chunk has a bad header")
    plane_len = n // group
    dst = np.frombuffer(out, dtype=np.uint8).reshape(-1, group)
    pos = _HDR.size * group
    for i in range(group):
        flag, length = _HDR.unpack_from(stored, i * _HDR.size)
        payload = stored[pos : pos + length]
        pos += length
        if len(payload) != length:
            raise CorruptData("bytegroup chunk is truncated")
        if flag == 0:
            if length != plane_len:
                raise CorruptData("bytegroup raw plane has the wrong length")
            plane = np.frombuffer(payload, dtype=np.uint8)
        elif flag == 1:
            buf = bytearray(plane_len)
            _zstd_into(payload, memoryview(buf))
            plane = np.frombuffer(buf, dtype=np.uint8)
        else:
            raise CorruptData(f"bytegroup plane has unknown flag {flag}")
        dst[:, i] = plane
    if pos != len(stored):
        raise CorruptData("bytegroup chunk has trailing bytes")
