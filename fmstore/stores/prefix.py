"""A wrapper store that roots another store at a sub-prefix."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable

from .. import keys as _keys
from .base import Buffer, Consumer, ObjectMeta, PartWriter, PutOptions, Store, Writer


class PrefixStore(Store):
    """Every key ``k`` maps to ``prefix/k`` in ``inner``; listings strip the prefix again."""

    def __init__(self, inner: Store, prefix: str) -> None:
        self.inner = inner
        self.prefix = _keys.validate_prefix(prefix, tier=inner.tier)
        self.tier = inner.tier
        self.url = inner.url.rstrip("/") + "/" + self.prefix.rstrip("/")

    def _full(self, key: str) -> str:
        return self.prefix + self._key(key)

    def _strip(self, meta: ObjectMeta) -> ObjectMeta:
        from dataclasses import replace

        return replace(meta, key=meta.key[len(self.prefix) :])

    async def put(self, key: str, data: Buffer, options: PutOptions = PutOptions()) -> ObjectMeta:
        return self._strip(await self.inner.put(self._full(key), data, options))

    async def open_writer(self, key: str, options: PutOptions = PutOptions()) -> Writer:
        return await self.inner.open_writer(self._full(key), options)

    async def get(self, key: str) -> bytes:
        return await self.inner.get(self._full(key))

    async def get_with_meta(self, key: str) -> tuple[ObjectMeta, bytes]:
        meta, data = await self.inner.get_with_meta(self._full(key))
        return self._strip(meta), data

    async def open_part_writer(
        self,
        key: str,
        size: int,
        part_size: int,
        *,
        token: str | None = None,
        options: PutOptions = PutOptions(),
    ) -> PartWriter:
        return await self.inner.open_part_writer(
            self._full(key), size, part_size, token=token, options=options
        )

    @property
    def local_root(self) -> str | None:
        inner = self.inner.local_root
        return None if inner is None else os.path.join(inner, self.prefix.rstrip("/"))

    def local_path(self, key: str) -> str | None:
        # Through the inner store, so its checks cover the prefix's directories too.
        return self.inner.local_path(self._full(key))

    async def cleanup_temp(self, older_than: float = 3600.0, under: str = "") -> int:
        return await self.inner.cleanup_temp(older_than, under=self.prefix + self._prefix(under))

    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        return await self.inner.get_range(self._full(key), start, end)

    async def get_range_pieces(self, key: str, start: int, end: int) -> list[Buffer]:
        return await self.inner.get_range_pieces(self._full(key), start, end)

    async def get_into(self, key: str, start: int, out: memoryview) -> None:
        await self.inner.get_into(self._full(key), start, out)

    async def read_to(self, key: str, start: int, end: int, consume: Consumer) -> None:
        await self.inner.read_to(self._full(key), start, end, consume)

    async def stat(self, key: str) -> ObjectMeta:
        return self._strip(await self.inner.stat(self._full(key)))

    async def list(
        self,
        prefix: str = "",
        *,
        recursive: bool = True,
        start_after: str | None = None,
        page_size: int = 1000,
    ) -> AsyncIterator[ObjectMeta]:
        full = self.prefix + self._prefix(prefix)
        after = self.prefix + start_after if start_after else None
        async for meta in self.inner.list(
            full, recursive=recursive, start_after=after, page_size=page_size
        ):
            yield self._strip(meta)

    async def delete(self, key: str) -> None:
        await self.inner.delete(self._full(key))

    async def delete_many(self, keys: Iterable[str]) -> None:
        await self.inner.delete_many([self._full(k) for k in keys])

    async def copy(self, src: str, dst: str, options: PutOptions = PutOptions()) -> ObjectMeta:
        return self._strip(await self.inner.copy(self._full(src), self._full(dst), options))

    async def sync(self) -> None:
        await self.inner.sync()

    async def close(self) -> None:
        await self.inner.close()
