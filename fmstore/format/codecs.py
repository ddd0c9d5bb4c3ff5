"""Chunk codecs: ``raw``, ``zstd`` and ``bytegroup+zstd``.

``bytegroup+zstd`` splits each element's bytes into planes (all first bytes, then all second
bytes, ...) before compressing: the sign/exponent bytes of floats are highly repetitive while
the low mantissa bytes are noise, so grouping lets zstd find the redundancy.  Each plane is
compressed on its own and kept raw when a probe shows it does not shrink, which skips the
expensive part for noise planes.  Planes are compressed through :mod:`.zstdlib` (zstd's
``fast`` strategy with Huffman-coded literals: the entropy bound at several times the speed
of level 1) when the zstandard build offers it, through the public API otherwise; both
write standard zstd frames, so either reads the other's output.  Layout of a ``bytegroup+zstd`` chunk (``g`` = group size,
the element size, recorded in the manifest)::

    g x (flag: u8 [0 raw, 1 zstd], length: u64 LE)   header, 9*g bytes
    plane 0 payload, plane 1 payload, ...           concatenated

All functions here are pure CPU work; zstandard and numpy release the GIL, so they run in
parallel in :func:`fmstore.runtime.to_cpu`.
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from ..errors import CorruptData
from ..stores.base import Buffer
from . import zstdlib

if TYPE_CHECKING:
    import torch

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


def choose_codec(compression: str | None, dtype: torch.dtype) -> str:
    """The codec to try for a chunk of ``dtype`` under the caller's ``compression`` setting.

    ``auto`` picks what pays for its CPU time (figures in docs/checkpoint.md):
    ``bytegroup+zstd`` for 2- and 8-byte real floats (bf16/fp16 shrink ~1.5x, fp64 more),
    ``raw`` for 4-byte floats and complex (fp32 optimizer moments shrink only ~1.19x: not
    worth ~4x the write's CPU time), ``zstd`` for the rest (integers, bool, fp8: cheap to
    try, often very compressible).  Whether ``auto`` compresses at all depends on the store
    (see :func:`fmstore.checkpoint.planner.auto_compression`).  ``none`` is a synonym of
    ``raw``.  The writer still falls back to ``raw`` for a chunk whose encoding does not
    shrink.
    """
    if compression in ("raw", "none", None):
        return "raw"
    if compression == "auto":
        if dtype.is_complex or (dtype.is_floating_point and dtype.itemsize == 4):
            return "raw"
        if dtype.is_floating_point and dtype.itemsize > 1:
            return "bytegroup+zstd"
        return "zstd"
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
        grouped = _bytegroup_encode(raw, group)
        return ("bytegroup+zstd", grouped) if len(grouped) < n * _SHRINK else ("raw", raw)
    raise ValueError(f"unknown codec {codec!r}")


class _Scratch(threading.local):
    """Per-thread buffers reused across chunks (a compressed plane, a widened plane)."""

    def __init__(self) -> None:
        self.bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int, dtype: type = np.uint8) -> np.ndarray:
        b = self.bufs.get(name)
        if b is None or b.dtype != dtype or len(b) < n:
            b = self.bufs[name] = np.empty(n, dtype=dtype)
        return b[:n]


_scratch = _Scratch()


def _split_planes(raw: memoryview, group: int, out: np.ndarray) -> None:
    """Write byte plane ``i`` of ``raw`` to ``out[i]`` (``out``: group x plane_len)."""
    plane_len = out.shape[1]
    if group == 2:
        # Two planes of 16-bit words: truncating casts are vectorized, ~1.5x a strided copy.
        words = np.frombuffer(raw, dtype="<u2")
        np.copyto(out[0], words, casting="unsafe")
        tmp = _scratch.get("words", plane_len, np.uint16)
        np.right_shift(words, 8, out=tmp)
        np.copyto(out[1], tmp, casting="unsafe")
        return
    a = np.frombuffer(raw, dtype=np.uint8).reshape(-1, group)
    for i in range(group):
        np.copyto(out[i], a[:, i])


def _bytegroup_encode(raw: memoryview, group: int) -> Buffer:
    """Planes are split straight into the output buffer; a plane that compresses is
    compressed into scratch memory and its (smaller) frame copied back over it."""
    n = len(raw)
    plane_len = n // group
    hdr = _HDR.size * group
    out = np.empty(hdr + n, dtype=np.uint8)
    _split_planes(raw, group, out[hdr:].reshape(group, plane_len))
    header = bytearray()
    pos = hdr
    for i in range(group):
        src = out[hdr + i * plane_len : hdr + (i + 1) * plane_len]
        size = _compress_plane(src) if _compressible(src.data) else None
        if size is None:
            if pos != hdr + i * plane_len:
                out[pos : pos + plane_len] = src
            header += _HDR.pack(0, plane_len)
            pos += plane_len
        else:
            out[pos : pos + size] = _scratch.get("z", size)
            header += _HDR.pack(1, size)
            pos += size
    out[:hdr] = np.frombuffer(bytes(header), dtype=np.uint8)
    return out.data[:pos]


def _compress_plane(src: np.ndarray) -> int | None:
    """Compress one plane into scratch ``z``; its length, or None when it does not shrink."""
    limit = int(len(src) * _SHRINK)
    if zstdlib.AVAILABLE:
        return zstdlib.compress_plane_into(src.data, _scratch.get("z", max(limit, 1)).data)
    z = _cctx().compress(src.data)
    if len(z) >= limit:
        return None
    _scratch.get("z", len(z))[:] = np.frombuffer(z, dtype=np.uint8)
    return len(z)


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
    if zstdlib.AVAILABLE:
        zstdlib.decompress_into(stored, out)  # libzstd writes at most len(out) bytes
        return
    out[:] = zstd_decompress_exact(stored, len(out))


#: Undeclared-size frames are decoded in pieces of this size (memory held beyond ``n``).
_PIECE = 1 << 20


def zstd_decompress_exact(stored: Buffer, n: int) -> bytes:
    """The zstd data ``stored`` decoded, which must be exactly ``n`` bytes; CorruptData
    otherwise, without ever holding much more than ``n`` bytes.

    python-zstandard's ``decompress`` ignores ``max_output_size`` when the frame declares
    its content size and allocates what the frame says (a 33 KB frame can say 1 GiB), so the
    declared size is checked against ``n`` first; a frame that declares none is streamed
    with a hard bound of ``n + 1`` bytes.
    """
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        raise CorruptData(f"zstd data has a bad frame header: {e}") from None
    if declared >= 0 and declared != n:
        raise CorruptData(f"zstd frame declares {declared} bytes, expected {n}")
    try:
        if declared == n:
            data = _dctx().decompress(stored, max_output_size=n)
        else:
            pieces: list[bytes] = []
            got = 0
            with _dctx().stream_reader(stored, read_across_frames=True) as r:
                while got <= n:
                    piece = r.read(min(_PIECE, n + 1 - got))
                    if not piece:
                        break
                    pieces.append(piece)
                    got += len(piece)
            data = b"".join(pieces)
    except zstandard.ZstdError as e:
        raise CorruptData(f"zstd data does not decode: {e}") from None
    if len(data) != n:
        raise CorruptData(
            f"zstd data decodes to {'more than ' if len(data) > n else ''}{len(data)} bytes, "
            f"expected {n}"
        )
    return data


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
            plane = _scratch.get("plane", plane_len)
            _zstd_into(payload, plane.data)
        else:
            raise CorruptData(f"bytegroup plane has unknown flag {flag}")
        dst[:, i] = plane
    if pos != len(stored):
        raise CorruptData("bytegroup chunk has trailing bytes")
