"""CRC32C of copied bytes: computed per part, combined into the whole object's checksum.

Parts of a big object are checksummed concurrently; :func:`combine` joins two CRCs the
way zlib's ``crc32_combine`` does (GF(2) matrix powers, cost logarithmic in the length),
so the whole-object CRC never needs the bytes in order.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import crc32c as _crc32c

from .types import Buffer, Pieces, as_pieces

#: Reflected Castagnoli polynomial.
_POLY = 0x82F63B78


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data`` (continuing from ``value``); releases the GIL on big buffers."""
    return _crc32c.crc32c(data, value)


def crc32c_of(data: Buffer | Pieces) -> int:
    """CRC32C of a buffer or of pieces in order."""
    value = 0
    for piece in as_pieces(data):
        value = crc32c(piece, value)
    return value


def to_hex(crc: int) -> str:
    return f"{crc:08x}"


def from_hex(text: str | None) -> int | None:
    """The CRC recorded as 8 hex digits, or None when absent or malformed."""
    if not text:
        return None
    try:
        value = int(text, 16)
    except ValueError:
        return None
    return value if 0 <= value <= 0xFFFFFFFF and len(text) <= 8 else None


def _times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``."""
    if len2 <= 0:
        return crc1
    return _times(_zeros_operator(len2), crc1) ^ crc2


@functools.lru_cache(maxsize=256)
def _zeros_operator(len2: int) -> list[int]:
    """The GF(2) matrix that advances a CRC over ``len2`` zero bytes (parts mostly share
    one length, so each is built once)."""
    op = [1 << n for n in range(32)]  # identity
    step = [_POLY] + [1 << n for n in range(31)]  # operator for one zero bit
    for _ in range(3):
        step = _square(step)  # one zero byte
    while True:  # square-and-multiply over the bits of len2
        if len2 & 1:
            op = [_times(step, v) for v in op]
        len2 >>= 1
        if not len2:
            return op
        step = _square(step)


def combine_all(parts: Iterable[tuple[int, int]]) -> int:
    """CRC32C of the concatenation of parts given as ``(crc, length)`` in order."""
    total = 0
    for crc, length in parts:
        total = combine(total, crc, length)
    return total


def from_b64(text: str | None) -> int | None:
    """A CRC32C as S3 writes it (base64 of its 4 big-endian bytes), or None when absent or
    malformed."""
    if not text:
        return None
    import base64
    import binascii

    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


def composite_of(part_crcs: Iterable[int]) -> int:
    """S3's composite checksum of a multipart object (without its ``-N`` suffix): the
    CRC32C of its parts' CRC32Cs, each as 4 big-endian bytes."""
    return crc32c(b"".join(c.to_bytes(4, "big") for c in part_crcs))
