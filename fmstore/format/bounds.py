"""Checks of sizes, offsets and views read from a manifest or index, before anything is
allocated, read or decompressed.

Every figure in a checkpoint's manifest or a dataset's index comes from outside and may be
hostile: a storage declared 6 GiB over 200 KB of blobs, a tensor view reaching past its
storage, a shard "holding" 10 TB.  These helpers bound each declared size by the bytes that
really back it.  They cost O(dimensions) per tensor and O(1) per chunk: never a pass over
the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: No zstd frame decodes to more than this many bytes per stored byte: a block (at most
#: 128 KiB of output) costs at least 4 bytes (an RLE block), before the frame header.
MAX_ZSTD_RATIO = 1 << 15
#: Deepest nesting accepted in a manifest's state tree or free-form values.
MAX_DEPTH = 128


def is_int(v: Any) -> bool:
    """A JSON integer (``bool`` is not one)."""
    return type(v) is int


def chunk_problem(
    codec: str, offset: int, length: int, raw: int, blob_size: int | None
) -> str | None:
    """Why a chunk's figures cannot be true (None: plausible).  ``blob_size``: the size of
    the blob holding it, where known."""
    if offset < 0 or length < 0 or raw < 0:
        return f"negative offset/length/raw ({offset}, {length}, {raw})"
    if blob_size is not None and offset + length > blob_size:
        return f"bytes {offset}..{offset + length} lie past the blob's {blob_size} bytes"
    if codec == "raw":
        if length != raw:
            return f"raw chunk stores {length} bytes for {raw}"
    elif raw > max(length, 1) * MAX_ZSTD_RATIO:
        return f"{length} stored bytes cannot decode to {raw} ({codec})"
    return None


def chunk_run_problem(chunks: Sequence[Any], blobs: Sequence[Any]) -> tuple[str | None, int]:
    """Why ``chunks`` (``blob``, ``offset``, ``length``, ``raw``, ``raw_offset``, ``codec``
    each) cannot be the consecutive bytes of one value stored in ``blobs`` (``name``,
    ``size`` each), and how many raw bytes they cover; the caller compares that with the
    value's declared size.  Shared by both checkpoint formats."""
    pos = 0
    for ci, c in enumerate(chunks):
        if not 0 <= c.blob < len(blobs):
            return f"chunks[{ci}].blob {c.blob} is not a blob index", pos
        if c.raw_offset != pos:
            return f"chunks[{ci}].raw_offset {c.raw_offset} != {pos}", pos
        why = chunk_problem(c.codec, c.offset, c.length, c.raw, blobs[c.blob].size)
        if why:
            return f"chunks[{ci}] (blob {blobs[c.blob].name!r}): {why}", pos
        pos += c.raw
    return None, pos


def view_problem(
    shape: Sequence[int], stride: Sequence[int], offset: int, itemsize: int, nbytes: int
) -> str | None:
    """Why a strided view (``offset`` in bytes, ``stride`` in elements) does not fit in a
    storage of ``nbytes`` bytes (None: it fits)."""
    if len(shape) != len(stride):
        return f"shape {list(shape)} and stride {list(stride)} differ in length"
    if any(s < 0 for s in shape):
        return f"negative size in shape {list(shape)}"
    if any(st < 0 for st in stride):
        return f"negative stride {list(stride)}"
    if offset < 0:
        return f"negative offset {offset}"
    if any(s == 0 for s in shape):
        end = offset
    else:
        last = sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
        end = offset + (last + 1) * itemsize
    if end > nbytes:
        return f"view (offset {offset}, shape {list(shape)}, stride {list(stride)}) needs {end} bytes of a {nbytes}-byte storage"
    return None
