"""The default resumable part writer: each part a hidden temporary object, joined on commit.

It works on every store through the Store interface alone, at the price of reading the
parts back once on commit.  Backends with something better override
:meth:`~fmstore.stores.base.Store.open_part_writer` (POSIX: ``pwrite`` into one temp file;
S3: a multipart upload whose id is the token).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import InvalidRange, NotFound
from .types import (
    TMP_MARK,
    Buffer,
    ObjectMeta,
    PartWriter,
    Pieces,
    PutOptions,
    joined,
    part_bounds,
    part_count,
)

if TYPE_CHECKING:
    from .base import Store


class TempPartsWriter(PartWriter):
    def __init__(
        self,
        store: Store,
        key: str,
        size: int,
        part_size: int,
        token: str,
        resumed: bool,
        options: PutOptions,
    ) -> None:
        self.store, self.key, self.size, self.part_size = store, key, size, part_size
        self.token, self.resumed, self.options = token, resumed, options
        self._done = False

    @classmethod
    async def open(
        cls,
        store: Store,
        key: str,
        size: int,
        part_size: int,
        token: str | None,
        options: PutOptions,
    ) -> TempPartsWriter:
        if part_size <= 0:
            raise ValueError("part_size must be positive")
        resumed = token is not None and token.endswith(f"-{part_size:x}")
        if not resumed:
            token = f"{os.urandom(16).hex()}-{part_size:x}"
        assert token is not None
        return cls(store, key, size, part_size, token, resumed, options)

    def _part_key(self, index: int) -> str:
        d, _, name = self.key.rpartition("/")
        part = f"{TMP_MARK}parts.{self.token}.{index:06d}.{name[:80]}"
        return f"{d}/{part}" if d else part

    async def write_part(self, index: int, data: Buffer | Pieces) -> None:
        start, end = part_bounds(index, self.size, self.part_size)
        data = joined(data)
        if memoryview(data).nbytes != end - start:
            raise InvalidRange(
                f"part {index} must be {end - start} bytes, not {memoryview(data).nbytes}",
                tier=self.store.tier,
                key=self.key,
            )
        await self.store.put(self._part_key(index), data)

    async def commit(
        self,
        metadata: Mapping[str, str] | None = None,
        *,
        part_crc32c: Mapping[int, int] | None = None,
    ) -> ObjectMeta:
        if self._done:
            raise ValueError("writer is closed")
        meta = {**(self.options.metadata or {}), **(metadata or {})}
        options = PutOptions(
            mode=self.options.mode,
            if_match=self.options.if_match,
            metadata=meta or None,
            preserve_owner=self.options.preserve_owner,
        )
        n = part_count(self.size, self.part_size)
        async with await self.store.open_writer(self.key, options) as w:
            for i in range(n):
                start, end = part_bounds(i, self.size, self.part_size)
                try:
                    data = await self.store.get(self._part_key(i))
                except NotFound:
                    raise NotFound(
                        f"part {i} of a pending write is missing",
                        tier=self.store.tier,
                        key=self.key,
                    ) from None
                if len(data) != end - start:
                    raise InvalidRange(
                        f"part {i} has {len(data)} bytes, expected {end - start}",
                        tier=self.store.tier,
                        key=self.key,
                    )
                await w.write(data)
        self._done = True
        await self.store.delete_many([self._part_key(i) for i in range(n)])
        return await self.store.stat(self.key)

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        n = part_count(self.size, self.part_size)
        await self.store.delete_many([self._part_key(i) for i in range(n)])
