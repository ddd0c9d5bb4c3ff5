"""CRC32C of chunk bytes (hardware-accelerated by the ``crc32c`` package; releases the GIL)."""

from __future__ import annotations

import crc32c as _crc32c

from ..stores.base import Buffer


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C (Castagnoli) of ``data`` as an unsigned 32-bit int; pass the CRC of the bytes
    before ``data`` as ``value`` to continue a running checksum."""
    return int(_crc32c.crc32c(data, value))
