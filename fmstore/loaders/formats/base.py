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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
