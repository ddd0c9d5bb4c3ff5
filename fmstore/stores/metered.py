"""A wrapper store that records Prometheus metrics for every operation of another store."""

from __future__ import annotations

import builtins
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..errors import FmstoreError
from ..metrics import STORE_BYTES, STORE_ERRORS, STORE_INFLIGHT, STORE_LATENCY, STORE_OPS
from .base import (
    Buffer,
    Consumer,
    Leftover,
    ObjectMeta,
    PartStream,
    PartWriter,
    Pieces,
    PutOptions,
    Store,
    Writer,
    nbytes,
)


class MeteredStore(Store):
    """Counts operations, bytes, errors and latency per tier; otherwise transparent."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.tier = inner.tier
        self.url = inner.url
        # Labelled children, looked up once: ``labels()`` validates and locks on every
        # call, several microseconds, four times per operation.
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        child = self._children.get((metric, *labels))
        if child is None:
            child = self._children[(metric, *labels)] = metric.labels(self.tier, *labels)
        return child

    @contextmanager
    def _op(self, op: str) -> Iterator[None]:
        t0 = time.perf_counter()
        gauge = self._child(STORE_INFLIGHT)
        gauge.inc()
        try:
            yield
        except GeneratorExit:  # a listing the caller stopped early is not an error
            self._child(STORE_OPS, op, "ok").inc()
            raise
        except BaseException as e:
            name = type(e).__name__ if isinstance(e, FmstoreError) else "other"
            self._child(STORE_ERRORS, op, name).inc()
            self._child(STORE_OPS, op, "error").inc()
            raise
        else:
            self._child(STORE_OPS, op, "ok").inc()
        finally:
            gauge.dec()
            self._child(STORE_LATENCY, op).observe(time.perf_counter() - t0)

    def _bytes(self, op: str, n: int) -> None:
        self._child(STORE_BYTES, op).inc(n)

    async def put(self, key: str, data: Buffer, options: PutOptions = PutOptions()) -> ObjectMeta:
        with self._op("put"):
            meta = await self.inner.put(key, data, options)
        self._bytes("put", memoryview(data).nbytes)
        return meta

    async def open_writer(self, key: str, options: PutOptions = PutOptions()) -> Writer:
        with self._op("open_writer"):
            return _MeteredWriter(self, await self.inner.open_writer(key, options))

    async def get(self, key: str) -> bytes:
        with self._op("get"):
            data = await self.inner.get(key)
        self._bytes("get", len(data))
        return data

    async def get_with_meta(self, key: str) -> tuple[ObjectMeta, bytes]:
        with self._op("get"):
            meta, data = await self.inner.get_with_meta(key)
        self._bytes("get", len(data))
        return meta, data

    async def open_part_writer(
        self,
        key: str,
        size: int,
        part_size: int,
        *,
        token: str | None = None,
        options: PutOptions = PutOptions(),
    ) -> PartWriter:
        with self._op("open_writer"):
            inner = await self.inner.open_part_writer(
                key, size, part_size, token=token, options=options
            )
        return _MeteredPartWriter(self, inner)

    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        with self._op("get_range"):
            data = await self.inner.get_range(key, start, end)
        self._bytes("get", len(data))
        return data

    async def get_range_pieces(self, key: str, start: int, end: int) -> list[Buffer]:
        with self._op("get_range"):
            pieces = await self.inner.get_range_pieces(key, start, end)
        self._bytes("get", nbytes(pieces))
        return pieces

    async def get_into(self, key: str, start: int, out: memoryview) -> None:
        with self._op("get_range"):
            await self.inner.get_into(key, start, out)
        self._bytes("get", out.nbytes)

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
        with self._op("get_range"):
            await self.inner.read_to(key, start, end, consume, etag=etag, ring=ring)
        self._bytes("get", end - start)

    async def stat(self, key: str) -> ObjectMeta:
        with self._op("stat"):
            return await self.inner.stat(key)

    async def list(
        self,
        prefix: str = "",
        *,
        recursive: bool = True,
        start_after: str | None = None,
        page_size: int = 1000,
    ) -> AsyncIterator[ObjectMeta]:
        with self._op("list"):
            async for meta in self.inner.list(
                prefix, recursive=recursive, start_after=start_after, page_size=page_size
            ):
                yield meta

    async def delete(self, key: str) -> None:
        with self._op("delete"):
            await self.inner.delete(key)

    async def delete_many(self, keys: Iterable[str]) -> None:
        with self._op("delete_many"):
            await self.inner.delete_many(keys)

    async def copy(self, src: str, dst: str, options: PutOptions = PutOptions()) -> ObjectMeta:
        with self._op("copy"):
            return await self.inner.copy(src, dst, options)

    async def stored_crc32c(self, key: str) -> tuple[int, int | None]:
        with self._op("stat"):
            return await self.inner.stored_crc32c(key)

    async def sync(self) -> None:
        await self.inner.sync()

    async def close(self) -> None:
        await self.inner.close()

    @property
    def local_root(self) -> str | None:
        return self.inner.local_root

    def local_path(self, key: str) -> str | None:
        return self.inner.local_path(key)

    async def leftovers(self, under: str = "") -> builtins.list[Leftover]:
        return await self.inner.leftovers(under)

    async def remove_leftover(self, item: Leftover) -> None:
        await self.inner.remove_leftover(item)


class _MeteredWriter(Writer):
    def __init__(self, store: MeteredStore, inner: Writer) -> None:
        self.store, self.inner = store, inner

    async def write(self, data: Buffer | Pieces) -> None:
        with self.store._op("write"):
            await self.inner.write(data)
        self.store._bytes("put", nbytes(data))

    async def commit(self) -> ObjectMeta:
        with self.store._op("commit"):
            return await self.inner.commit()

    async def abort(self) -> None:
        await self.inner.abort()


class _MeteredPartWriter(PartWriter):
    def __init__(self, store: MeteredStore, inner: PartWriter) -> None:
        self.store, self.inner = store, inner
        self.token, self.resumed = inner.token, inner.resumed

    async def write_part(self, index: int, data: Buffer | Pieces) -> None:
        with self.store._op("write"):
            await self.inner.write_part(index, data)
        self.store._bytes("put", nbytes(data))

    async def read_part(self, index: int) -> bytes | None:
        return await self.inner.read_part(index)

    def stream_part(self, index: int) -> PartStream | None:
        inner = self.inner.stream_part(index)
        return None if inner is None else _MeteredPartStream(self.store, inner)

    async def commit(
        self,
        metadata: Mapping[str, str] | None = None,
        *,
        part_crc32c: Mapping[int, int] | None = None,
    ) -> ObjectMeta:
        with self.store._op("commit"):
            return await self.inner.commit(metadata, part_crc32c=part_crc32c)

    async def abort(self) -> None:
        await self.inner.abort()


class _MeteredPartStream(PartStream):
    def __init__(self, store: MeteredStore, inner: PartStream) -> None:
        self.store, self.inner, self.n = store, inner, 0

    def write(self, data: memoryview) -> Awaitable[None] | None:
        self.n += data.nbytes
        return self.inner.write(data)

    async def close(self) -> None:
        with self.store._op("write"):
            await self.inner.close()
        self.store._bytes("put", self.n)
