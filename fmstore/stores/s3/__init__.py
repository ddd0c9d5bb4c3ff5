"""The S3 backend (the ``s3`` tier): :class:`S3Store` and its options.

The store and its guarantees are described in :mod:`.store`; the modules below it are
:mod:`.options`, :mod:`.client`, :mod:`.core`, :mod:`.transport` with :mod:`.lean`,
:mod:`.reads`, :mod:`.uploads`, :mod:`.writers` and :mod:`.retry`.
"""

from __future__ import annotations

from .options import (
    MAX_COPY,
    MAX_PART,
    MAX_PARTS,
    META_CRC,
    META_PART_SIZE,
    META_PUT_TOKEN,
    MIN_PART,
    STREAM_RING,
    S3Options,
    parse_s3_url,
    put_part_size,
    writer_part_size,
)
from .store import S3Store
from .uploads import etag_is_md5, landed_ours
from .util import crc32c
from .writers import S3PartWriter, S3Writer

__all__ = [
    "MAX_COPY",
    "MAX_PART",
    "MAX_PARTS",
    "META_CRC",
    "META_PART_SIZE",
    "META_PUT_TOKEN",
    "MIN_PART",
    "STREAM_RING",
    "S3Options",
    "S3PartWriter",
    "S3Store",
    "S3Writer",
    "crc32c",
    "etag_is_md5",
    "landed_ours",
    "parse_s3_url",
    "put_part_size",
    "writer_part_size",
]
