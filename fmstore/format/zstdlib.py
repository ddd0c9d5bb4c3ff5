"""Direct libzstd calls for byte planes: compress and decompress into caller-owned buffers.

The ``zstandard`` package ships libzstd's full API through its cffi module.  Two things it
offers there and not through its public classes matter for checkpoints:

* **literal-only speed on byte planes.**  The sign/exponent plane of a float tensor has
  ~2.7 bits of entropy per byte but almost no repeated strings: zstd's match finder burns
  most of the time and finds nothing worth having (level 1 runs at ~130-250 MB/s on such a
  plane).  With literal (Huffman) compression forced on and a high acceleration on the
  ``fast`` strategy, zstd skips through the plane and Huffman-codes it: ratio at the
  entropy bound (0.34 vs 0.37 at level 1) at 3-4x the speed.  The output is an ordinary zstd
  frame; any zstd decoder reads it.
* **no intermediate ``bytes``.**  Compressing into, and decompressing out of, memory we
  already own saves one copy of every plane.

cffi releases the GIL around each call, so planes of different chunks compress in parallel
on :func:`fmstore.runtime.to_cpu`.  When the cffi module is missing (another build of
``zstandard``), :data:`AVAILABLE` is False and callers use the public API instead.
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import CorruptData
from ..stores.base import Buffer

try:  # pragma: no branch - depends on the zstandard build
    from zstandard import _cffi  # type: ignore[attr-defined]

    _lib: Any = _cffi.lib
    _ffi: Any = _cffi.ffi
    for _name in (
        "ZSTD_c_literalCompressionMode",
        "ZSTD_compress2",
        "ZSTD_decompressDCtx",
        "ZSTD_error_dstSize_tooSmall",
    ):
        getattr(_lib, _name)
    AVAILABLE = True
except Exception:  # ImportError, or an older libzstd without these names
    _lib = _ffi = None
    AVAILABLE = False

#: zstd ``fast`` strategy parameters for byte planes (measured on bf16 and fp32 planes:
#: small hash table, acceleration high enough that match search costs ~nothing, Huffman on).
_PLANE_PARAMS = (
    ("ZSTD_c_strategy", 1),  # ZSTD_fast
    ("ZSTD_c_windowLog", 17),
    ("ZSTD_c_hashLog", 12),
    ("ZSTD_c_minMatch", 7),
    ("ZSTD_c_targetLength", 1024),  # acceleration for ZSTD_fast
    ("ZSTD_c_literalCompressionMode", 1),  # ZSTD_ps_enable: Huffman even when accelerated
    ("ZSTD_c_checksumFlag", 0),  # chunks carry their own CRC32C
    ("ZSTD_c_contentSizeFlag", 1),
)

_local = threading.local()


def _check(r: int) -> int:
    if _lib.ZSTD_isError(r):
        raise RuntimeError(_ffi.string(_lib.ZSTD_getErrorName(r)).decode())
    return r


def _cctx() -> Any:
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _ffi.gc(_lib.ZSTD_createCCtx(), _lib.ZSTD_freeCCtx)
        for name, value in _PLANE_PARAMS:
            _check(_lib.ZSTD_CCtx_setParameter(c, getattr(_lib, name), value))
        _local.cctx = c
    return c


def _dctx() -> Any:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = _ffi.gc(_lib.ZSTD_createDCtx(), _lib.ZSTD_freeDCtx)
    return d


def compress_plane_into(src: Buffer, dst: memoryview) -> int | None:
    """Compress ``src`` as one zstd frame into ``dst``; the frame's length, or None when it
    does not fit in ``dst`` (size ``dst`` to the largest output worth keeping)."""
    n = len(memoryview(src))
    r = _lib.ZSTD_compress2(
        _cctx(),
        _ffi.from_buffer(dst, require_writable=True),
        len(dst),
        _ffi.from_buffer(src),
        n,
    )
    if _lib.ZSTD_isError(r):
        if _lib.ZSTD_getErrorCode(r) == _lib.ZSTD_error_dstSize_tooSmall:
            return None
        _check(r)
    return int(r)


def decompress_into(src: Buffer, dst: memoryview) -> None:
    """Decode the zstd frame(s) ``src`` into exactly ``dst``; CorruptData otherwise."""
    n = len(dst)
    r = _lib.ZSTD_decompressDCtx(
        _dctx(),
        _ffi.from_buffer(dst, require_writable=True),
        n,
        _ffi.from_buffer(src),
        len(memoryview(src)),
    )
    if _lib.ZSTD_isError(r):
        msg = _ffi.string(_lib.ZSTD_getErrorName(r)).decode()
        raise CorruptData(f"zstd data does not decode: {msg}")
    if r != n:
        raise CorruptData(f"zstd data decodes to {r} bytes, expected {n}")
