"""A read-through cache of one checkpoint copy: lazy restore from a slow tier.

:class:`ReadThroughStore` reads a checkpoint from ``slow`` (S3, say) and keeps every blob it
fetches on ``fast`` (NVMe), so a lazy ``load`` fetches chunks on first access and later
reads come from the fast tier.  Once every blob of the manifest is on ``fast``, it writes
the manifest there too, byte for byte: the fast copy becomes a committed checkpoint (the
same commit convention as every other copy) and ``on_complete`` is called.  It is
read-only (every write raises :class:`~fmstore.errors.NotSupported`, after the keys are
checked like any store's); the checkpoint reader checks every chunk's CRC32C whichever tier
served it.  Where ``slow`` holds no manifest, reads are still served and cached, and no
copy is committed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from ...checkpoint.commit import commit_manifest, read_bounded_manifest
from ...errors import NotFound, NotSupported
from ...format.manifest import MANIFEST_KEY, Manifest
from ...stores.base import Buffer, Consumer, ObjectMeta, PartWriter, PutOptions, Store, Writer


class ReadThroughStore(Store):
    def __init__(
        self,
        fast: Store,
        slow: Store,
        *,
        on_complete: Callable[[Manifest, bytes], None] | None = None,
    ) -> None:
        self.fast, self.slow = fast, slow
        self.tier = slow.tier
        self.url = slow.url
        self.on_complete = on_complete
        self._manifest: tuple[bytes, Manifest] | None = None
        self._have: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self.fetched_bytes = 0
        self.completed = False

    async def _load_manifest(self) -> tuple[bytes, Manifest]:
        if self._manifest is None:
            data = await read_bounded_manifest(self.slow)
            self._manifest = (data, Manifest.loads(data, where=self.slow.url))
        return self._manifest

    async def _ensure(self, key: str) -> Store:
        """The store to read blob ``key`` from: fast once cached, after fetching it."""
        if key == MANIFEST_KEY:
            return self.slow
        if key in self._have:
            return self.fast
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self._have:
                return self.fast
            try:
                _, manifest = await self._load_manifest()
            except NotFound:
                manifest = None  # no checkpoint there: serve and cache, commit nothing
            want = (
                {}
                if manifest is None
                else {manifest.blob_key(i): b.size for i, b in enumerate(manifest.blobs)}
            )
            try:
                meta = await self.fast.stat(key)
                cached = meta.size == want.get(key, -1)
            except NotFound:
                cached = False
            if not cached:
                data = await self.slow.get(key)
                await self.fast.put(key, data)
                self.fetched_bytes += len(data)
            self._have.add(key)
            if manifest is not None and not self.completed and all(k in self._have for k in want):
                await self._commit()
            return self.fast

    async def _commit(self) -> None:
        data, manifest = await self._load_manifest()
        # replace: the fast tier's copy is a cache of the slow one, whose manifest wins
        await commit_manifest(self.fast, data, "replace")
        self.completed = True
        if self.on_complete is not None:
            self.on_complete(manifest, data)

    async def hydrate(self) -> None:
        """Fetch every blob now (turns a lazy restore into a complete fast copy)."""
        _, manifest = await self._load_manifest()
        await asyncio.gather(
            *(self._ensure(manifest.blob_key(i)) for i in range(len(manifest.blobs)))
        )

    # ---- Store interface (read side) -------------------------------------------------

    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        store = await self._ensure(self._key(key))
        return await store.get_range(key, start, end)

    async def get(self, key: str) -> bytes:
        store = await self._ensure(self._key(key))
        return await store.get(key)

    async def get_into(self, key: str, start: int, out: memoryview) -> None:
        store = await self._ensure(self._key(key))
        await store.get_into(key, start, out)

    async def read_to(
        self,
        key: str,
        start: int,
        end: int,
        consume: Consumer,
        *,
        etag: str | None = None,
        ring: memoryview | None = None,
    ) -> None:
        if etag is not None:
            # The etags are the slow tier's and the cache keeps no versions: a read pinned
            # to one is the slow tier's to serve.
            await self.slow.read_to(key, start, end, consume, etag=etag, ring=ring)
            return
        store = await self._ensure(self._key(key))
        await store.read_to(key, start, end, consume, ring=ring)

    async def stat(self, key: str) -> ObjectMeta:
        return await self.slow.stat(key)

    def list(
        self,
        prefix: str = "",
        *,
        recursive: bool = True,
        start_after: str | None = None,
        page_size: int = 1000,
    ) -> AsyncIterator[ObjectMeta]:
        return self.slow.list(
            prefix, recursive=recursive, start_after=start_after, page_size=page_size
        )

    # ---- read-only ---------------------------------------------------------------------

    def _ro(self, key: str) -> NotSupported:
        self._key(key)  # a bad key is InvalidKey, as on every store
        return NotSupported("a read-through restore is read-only", tier=self.tier, key=key)

    async def put(self, key: str, data: Buffer, options: PutOptions = PutOptions()) -> ObjectMeta:
        raise self._ro(key)

    async def open_writer(self, key: str, options: PutOptions = PutOptions()) -> Writer:
        raise self._ro(key)

    async def open_part_writer(
        self,
        key: str,
        size: int,
        part_size: int,
        *,
        token: str | None = None,
        options: PutOptions = PutOptions(),
    ) -> PartWriter:
        raise self._ro(key)

    async def delete(self, key: str) -> None:
        raise self._ro(key)

    async def copy(self, src: str, dst: str, options: PutOptions = PutOptions()) -> ObjectMeta:
        self._key(src)
        raise self._ro(dst)

    async def close(self) -> None:
        pass  # the tier stores belong to the caller
