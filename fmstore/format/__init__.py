"""Bytes <-> tensors: the checkpoint manifest schema, chunk codecs and checksums.

Nothing here does I/O: :mod:`fmstore.checkpoint` reads and writes through a Store and uses
these pieces to describe and transform the bytes.
"""

from __future__ import annotations

from .checksum import crc32c
from .codecs import CODECS, choose_codec, decode_into, encode
from .manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_KEY,
    BlobEntry,
    ChunkEntry,
    Manifest,
    StorageEntry,
    TensorEntry,
)

__all__ = [
    "CODECS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_KEY",
    "BlobEntry",
    "ChunkEntry",
    "Manifest",
    "StorageEntry",
    "TensorEntry",
    "choose_codec",
    "crc32c",
    "decode_into",
    "encode",
]
