"""Bytes <-> tensors: the checkpoint manifest schema, chunk codecs and checksums.

Nothing here does I/O: :mod:`fmstore.checkpoint` reads and writes through a Store and uses
these pieces to describe and transform the bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .checksum import crc32c
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

if TYPE_CHECKING:
    from .codecs import CODECS, choose_codec, decode_into, encode

#: Served by :mod:`.codecs` on first use: it loads numpy and zstandard, which reading a
#: manifest does not need.
_CODEC_NAMES = frozenset({"CODECS", "choose_codec", "decode_into", "encode"})


def __getattr__(name: str) -> Any:
    if name not in _CODEC_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import codecs

    value = getattr(codecs, name)
    globals()[name] = value
    return value


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
