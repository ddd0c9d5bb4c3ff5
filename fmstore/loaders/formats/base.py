"""The shard interface every dataset format implements.

A dataset is an ordered list of :class:`ShardSpec` (what to download, how many samples it
holds, how to verify it) plus a way to read samples out of one cached shard file
(:meth:`DatasetFormat.open_shard`).  Everything above this layer (ordering, caching,
prefetch, resume) sees only these two things, so a new format is one module here.
"""

from __future__ import annotations

import abc
import contextlib
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import CorruptData, FmstoreError, InvalidKey, describe_error
from ...format.bounds import MAX_ZSTD_RATIO
from ...keys import validate_key


@dataclass(frozen=True)
class ShardSpec:
    """One unit of download and caching.

    ``key`` is the object in the remote store; ``[start, start + size)`` the bytes to fetch
    (a large flat token file is split into several virtual shards).  ``checksum`` is
    ``"xxh3_64:<hex>"`` of those stored bytes when the format records one.  A ``compression``
    of ``"zstd"`` means the stored bytes are one zstd frame, cached decompressed
    (``cached_size`` bytes).
    """

    key: str
    samples: int
    size: int
    start: int = 0
    checksum: str | None = None
    compression: str | None = None
    raw_size: int | None = None
    #: Format-specific facts a reader needs (MDS column layout, a tar member table, ...).
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def cached_size(self) -> int:
        return self.size if self.raw_size is None else self.raw_size

    @property
    def cache_name(self) -> str:
        """A flat, unique file name for this shard in the node cache."""
        name = self.key.replace("/", "__")
        if self.start or self.extra.get("virtual"):
            name += f"@{self.start}-{self.start + self.size}"
        return name


def check_spec(spec: ShardSpec, *, entry: int, where: str) -> ShardSpec:
    """``spec`` when its figures (read from an index) are plausible; CorruptData naming the
    index entry and the field otherwise.  The real object sizes are compared later, by
    :func:`fmstore.loaders.formats.load_format`."""

    def bad(why: str) -> CorruptData:
        return CorruptData(f"index entry {entry} ({spec.key!r}): {why}", key=where)

    try:
        validate_key(spec.key)
    except InvalidKey as e:
        raise bad(f"'key' is not a safe key ({e.message})") from None
    for name in ("samples", "size", "start"):
        if getattr(spec, name) < 0:
            raise bad(f"{name!r} is negative ({getattr(spec, name)})")
    if spec.raw_size is not None and spec.raw_size < 0:
        raise bad(f"'raw_bytes' is negative ({spec.raw_size})")
    if spec.compression is None and spec.raw_size not in (None, spec.size):
        raise bad(
            f"'raw_bytes' {spec.raw_size} differs from 'bytes' {spec.size} of an uncompressed shard"
        )
    if spec.checksum is not None and not isinstance(spec.checksum, str):
        raise bad(f"'checksum' is {spec.checksum!r}, not a string")
    if spec.compression is not None and not isinstance(spec.compression, str):
        raise bad(f"'compression' is {spec.compression!r}, not a string")
    if spec.compression is not None and spec.cached_size > max(spec.size, 1) * MAX_ZSTD_RATIO:
        raise bad(f"{spec.size} compressed bytes cannot hold {spec.cached_size}")
    return spec


@contextlib.contextmanager
def decoding(key: str, index: int) -> Iterator[None]:
    """Turn a sample that does not decode (bad UTF-8, JSON, struct, shape) into CorruptData
    naming the shard and the sample."""
    try:
        yield
    except FmstoreError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, struct.error, RecursionError) as e:
        raise CorruptData(f"sample {index} does not decode: {describe_error(e)}", key=key) from None


def check_offsets(offsets: np.ndarray, lo: int, hi: int, *, key: str, what: str) -> None:
    """An offset table must be non-decreasing and inside ``[lo, hi]`` (O(samples), no data
    read): otherwise a sample could be read from outside the shard's data."""
    if len(offsets) and (
        int(offsets[0]) < lo or int(offsets[-1]) > hi or bool(np.any(offsets[1:] < offsets[:-1]))
    ):
        raise CorruptData(f"{what} offset table is out of order or outside the shard", key=key)


class ShardReader(abc.ABC):
    """Reads samples out of one cached shard file (memory-mapped)."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            self._mm: mmap.mmap | None = (
                mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
            )
        finally:
            os.close(fd)
        self.buf = (
            np.frombuffer(self._mm, np.uint8) if self._mm is not None else np.zeros(0, np.uint8)
        )

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def get(self, index: int) -> Any:
        """Sample ``index`` (0-based within the shard), decoded; never a view of the map."""

    def close(self) -> None:
        self.buf = np.zeros(0, np.uint8)
        if self._mm is not None:
            # A caller may still hold a view; the map then closes when that goes.
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None


class DatasetFormat(abc.ABC):
    """A dataset's shards and the reader for them."""

    #: Short name shown by ``fmstore dataset inspect``.
    name: str = ""

    def __init__(self, shards: list[ShardSpec]) -> None:
        self.shards = shards

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def stored_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @abc.abstractmethod
    def open_shard(self, path: str, spec: ShardSpec) -> ShardReader:
        """A reader over the cached file of ``spec``."""

    # ---- direct reads: samples fetched by byte range while their shard downloads ----------

    def header_size(self, spec: ShardSpec) -> int | None:
        """Bytes at the start of the shard needed to locate samples; None: no direct reads."""
        return None

    def check_header(self, spec: ShardSpec, header: bytes) -> None:
        """Raise :class:`~fmstore.errors.CorruptData` when the header does not match ``spec``."""

    def sample_range(self, spec: ShardSpec, header: bytes, index: int) -> tuple[int, int]:
        """``[start, end)`` of sample ``index`` within the shard's bytes."""
        raise NotImplementedError

    def decode(self, spec: ShardSpec, data: bytes) -> Any:
        """A sample from the bytes of :meth:`sample_range`."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {
            "format": self.name,
            "shards": len(self.shards),
            "samples": self.num_samples,
            "bytes": self.stored_bytes,
        }
