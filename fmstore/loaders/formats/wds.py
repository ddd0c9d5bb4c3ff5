"""WebDataset tar shards, read directly.

A sample is the run of consecutive tar members sharing a key (the member's path up to the
first dot of its file name), returned as ``{"__key__": key, ext: bytes, ...}`` like
``webdataset`` does without decoders.  Tar files carry no sample count, so the member table
of each shard is built once by walking its headers with ranged reads (read-ahead keeps that
to few requests) and kept beside the node cache, keyed by the shard's size and etag.
"""

from __future__ import annotations

import io
import re
import tarfile
from typing import Any

from ... import runtime
from ...errors import CorruptData
from ...stores import Store
from .base import DatasetFormat, ShardReader, ShardSpec

_KEY = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")
READ_AHEAD = 1 << 20


class WDSShardReader(ShardReader):
    def __init__(self, path: str, spec: ShardSpec) -> None:
        super().__init__(path)
        self.members: list[list[Any]] = spec.extra["members"]
        end = max((off + size for _k, parts in self.members for _e, off, size in parts), default=0)
        if end > len(self.buf):
            self.close()
            raise CorruptData("tar shard is shorter than its member table", key=spec.key)

    def __len__(self) -> int:
        return len(self.members)

    def get(self, index: int) -> dict[str, Any]:
        key, parts = self.members[index]
        out: dict[str, Any] = {"__key__": key}
        for ext, off, size in parts:
            out[ext] = self.buf[off : off + size].tobytes()
        return out


class WDSFormat(DatasetFormat):
    name = "webdataset"

    def open_shard(self, path: str, spec: ShardSpec) -> ShardReader:
        return WDSShardReader(path, spec)


class _RangeFile(io.RawIOBase):
    """A seekable read-only file over one object, fetched in read-ahead ranged requests."""

    def __init__(self, store: Store, key: str, size: int) -> None:
        self.store, self.key, self.size = store, key, size
        self.pos = 0
        self.buf_start, self.buf = 0, b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.size + pos)
        return self.pos

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self.size - self.pos
        n = max(0, min(n, self.size - self.pos))
        lo = self.pos - self.buf_start
        if lo < 0 or lo + n > len(self.buf):
            want = min(self.size, self.pos + max(n, READ_AHEAD))
            self.buf = runtime.run(self.store.get_range(self.key, self.pos, want))
            self.buf_start, lo = self.pos, 0
        self.pos += n
        return self.buf[lo : lo + n]

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def scan_tar(store: Store, key: str, size: int) -> list[list[Any]]:
    """The member table ``[[key, [[ext, offset, size], ...]], ...]`` of one tar object."""
    members: list[list[Any]] = []
    try:
        with tarfile.open(fileobj=_RangeFile(store, key, size), mode="r:") as tf:  # type: ignore[call-overload]
            for m in tf:
                if not m.isfile():
                    continue
                match = _KEY.match(m.name)
                if not match:
                    continue
                k, ext = match.group(1), match.group(2)
                if members and members[-1][0] == k:
                    members[-1][1].append([ext, m.offset_data, m.size])
                else:
                    members.append([k, [[ext, m.offset_data, m.size]]])
    except (tarfile.TarError, EOFError, ValueError, OverflowError) as e:
        raise CorruptData(f"not a readable tar file: {e}", tier=store.tier, key=key) from None
    return members


def members_ok(members: Any, size: int) -> bool:
    """Whether ``members`` is a member table (as :func:`scan_tar` makes) inside ``size`` bytes."""
    if not isinstance(members, list):
        return False
    for m in members:
        if not (isinstance(m, list) and len(m) == 2 and isinstance(m[0], str)):
            return False
        if not isinstance(m[1], list):
            return False
        for p in m[1]:
            if not (isinstance(p, list) and len(p) == 3 and isinstance(p[0], str)):
                return False
            off, n = p[1], p[2]
            if type(off) is not int or type(n) is not int or off < 0 or n < 0 or off + n > size:
                return False
    return True


def spec_for(key: str, size: int, members: list[list[Any]]) -> ShardSpec:
    return ShardSpec(key=key, samples=len(members), size=size, extra={"members": members})
