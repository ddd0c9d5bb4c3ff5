"""The one Store interface every backend implements.

A backend implements eight primitives, all ``async``: :meth:`Store.put`,
:meth:`Store.open_writer`, :meth:`Store.get_range` (``get`` is built on it unless the
backend has something better), :meth:`Store.stat`, :meth:`Store.list`,
:meth:`Store.delete`, :meth:`Store.copy`.  Everything else (``exists``, ``get_ranges`` with
range coalescing, ``delete_many``, ``sub``, ``get_with_meta``, the resumable
``open_part_writer``) is built once here, on top; backends override a built-on call only
where they have something cheaper (one GET that returns metadata, S3 multipart uploads,
``pwrite`` into one temp file).

Guarantees every backend keeps (the conformance suite in :mod:`fmstore.testing` checks them):

* keys are validated by :func:`fmstore.keys.validate_key` before any I/O; no key escapes the
  store's root;
* ``put`` and a committed ``open_writer`` are atomic: no reader ever observes a partially
  written object, and an overwrite shows readers either the old or the new bytes;
* a writer that is aborted, or whose ``async with`` block raises, leaves nothing visible
  (and on S3 no orphaned multipart upload);
* ``list`` yields keys in lexicographic (UTF-8 byte) order, relative to the store's root;
* errors are the classes of :mod:`fmstore.errors`, carrying this store's tier and the key.
"""

from __future__ import annotations

import abc
import builtins
import dataclasses
import os
import stat
from collections.abc import AsyncIterator, Iterable, Sequence

from .. import keys as _keys
from ..errors import InvalidRange, NotFound, PermissionDenied
from .parts import TempPartsWriter
from .types import (  # re-exported: the interface is imported from here
    Buffer,
    ByteRange,
    Consumer,
    Leftover,
    ObjectMeta,
    PartStream,
    PartWriter,
    Pieces,
    PutOptions,
    Writer,
    as_pieces,
    joined,
    nbytes,
    part_bounds,
    part_count,
    views_of,
)

__all__ = [
    "Leftover",
    "as_pieces",
    "Buffer",
    "ByteRange",
    "Consumer",
    "joined",
    "nbytes",
    "ObjectMeta",
    "part_bounds",
    "part_count",
    "PartStream",
    "PartWriter",
    "Pieces",
    "PrefixStore",
    "PutOptions",
    "Store",
    "views_of",
    "Writer",
]


class Store(abc.ABC):
    """Async object store rooted at a URL; see the module docstring for the guarantees."""

    #: Name used in errors and metrics: a configured tier name (``nvme``) or the scheme.
    tier: str
    #: The URL this store is rooted at.
    url: str

    # ---- primitives -----------------------------------------------------------------

    @abc.abstractmethod
    async def put(self, key: str, data: Buffer, options: PutOptions = PutOptions()) -> ObjectMeta:
        """Write ``data`` to ``key`` atomically."""

    @abc.abstractmethod
    async def open_writer(self, key: str, options: PutOptions = PutOptions()) -> Writer:
        """Start a streamed write (multipart on S3); nothing is visible before commit."""

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (``end=None``: to the end of the object).

        ``start`` past the end of the object, or ``end`` past it, raise
        :class:`~fmstore.errors.InvalidRange` (``start == size`` with ``end`` None or equal to
        the size returns ``b""``).
        """

    @abc.abstractmethod
    async def stat(self, key: str) -> ObjectMeta:
        """Size, mtime, etag and metadata of ``key``; :class:`NotFound` when absent."""

    @abc.abstractmethod
    def list(
        self,
        prefix: str = "",
        *,
        recursive: bool = True,
        start_after: str | None = None,
        page_size: int = 1000,
    ) -> AsyncIterator[ObjectMeta]:
        """Objects under ``prefix`` (a directory-like key prefix), in key order.

        Non-recursive listings also yield the immediate sub-prefixes as ``is_dir`` entries
        (key ending in ``/``).  Backends fetch ``page_size`` entries per request and page on
        transparently; ``start_after`` resumes a listing after a given key.
        """

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""

    @abc.abstractmethod
    async def copy(self, src: str, dst: str, options: PutOptions = PutOptions()) -> ObjectMeta:
        """Copy ``src`` to ``dst`` within this store (server-side where possible)."""

    async def stored_crc32c(self, key: str) -> tuple[int, int | None]:
        """The size of ``key`` and the CRC32C of its bytes as the storage system itself
        computed them, where it keeps one: on S3, the checksum the server checked against
        the bytes it received when they were uploaded (asked for with
        ``x-amz-checksum-mode``).  None for the CRC where the store has none to give (this
        default: a plain ``stat``): a caller that needs proof must read the bytes.

        Never a checksum from user metadata (``fmstore-crc32c``): that is a writer's claim,
        not the storage's evidence.
        """
        return (await self.stat(key)).size, None

    async def sync(self) -> None:
        """Make every earlier ``durable=False`` write durable (a no-op where writes are
        durable when they return, as on S3)."""

    @property
    def local_root(self) -> str | None:
        """The directory on this machine that holds this store's objects (key ``k`` is the
        file ``local_root/k``), or None where objects are not local files (S3, fsspec,
        memory).  Every wrapper answers for the store it wraps: callers ask this instead of
        probing a store's type, so a prefixed or metered POSIX tier memory-maps and reads
        with ``pread`` like a bare one, and an S3 tier is never taken for a local one."""
        return None

    async def leftovers(self, under: str = "") -> builtins.list[Leftover]:
        """What writers that died left below the prefix ``under``: unfinished multipart
        uploads (S3), temp files (POSIX).  Stores whose writes leave nothing behind
        (fsspec): none."""
        return []

    async def remove_leftover(self, item: Leftover) -> None:
        """Remove one of :meth:`leftovers` (an upload is aborted); one gone already is fine."""
        raise NotImplementedError(f"{type(self).__name__} lists no leftovers")

    async def close(self) -> None:
        """Release connections and pools; the store is unusable afterwards."""

    # ---- built on top, once ---------------------------------------------------------

    async def cleanup_temp(
        self, older_than: float = 3600.0, under: str = "", *, dry_run: bool = False
    ) -> int:
        """Remove the temp files of :meth:`leftovers` (below ``under``) idle for at least
        ``older_than`` seconds; returns how many (``dry_run``: how many it would)."""
        n = 0
        for item in await self.leftovers(under):
            if item.kind == "temp" and item.idle >= older_than:
                if not dry_run:
                    await self.remove_leftover(item)
                n += 1
        return n

    async def get(self, key: str) -> bytes:
        """The whole object."""
        return await self.get_range(key, 0, None)

    async def get_range_pieces(self, key: str, start: int, end: int) -> builtins.list[Buffer]:
        """Bytes ``[start, end)`` of ``key`` as :data:`Pieces`, for a caller that writes them
        on (a copy) and so need not have them joined.

        Backends that receive a range in pieces (S3: what each socket read delivered)
        override it; this default is one piece, :meth:`get_range`'s.
        """
        return [await self.get_range(key, start, end)]

    async def get_into(self, key: str, start: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[start, start + len(out))`` of ``key``.

        Backends that can read straight into caller memory (POSIX ``preadv``) override it;
        this default costs one copy.
        """
        data = await self.get_range(key, start, start + len(out))
        out[:] = data

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
        """Hand bytes ``[start, end)`` of ``key`` to ``consume``, in order.

        The bytes passed are only valid during the call (or until its awaitable is done).
        Backends that stream (S3) call it as bytes arrive, from a buffer small enough to
        stay in the CPU's cache (``ring`` when given, at least 64 KiB: a consumer that
        writes with ``O_DIRECT`` passes an aligned one, so what it is handed needs no
        copy), so a copy to a file never holds a whole range in memory; this default reads
        the range, then hands over its pieces.  What ``consume`` raises
        is raised as is.  With ``etag`` (from an earlier :meth:`stat`), the bytes must come
        from that version: another one is :class:`~fmstore.errors.StoreUnavailable` (S3
        asks with ``If-Match``; this default compares the etag after the read), so a caller
        reading an object as several ranges never splices two versions.
        """
        for piece in await self.get_range_pieces(key, start, end):
            pending = consume(memoryview(piece))
            if pending is not None:
                await pending
        if etag is not None and (await self.stat(key)).etag != etag:
            from ..errors import StoreUnavailable

            raise StoreUnavailable("object changed while it was read", tier=self.tier, key=key)

    async def get_with_meta(self, key: str) -> tuple[ObjectMeta, bytes]:
        """The whole object and its metadata (user metadata included).

        Backends whose GET returns metadata override this with one request; the default
        stats, reads and re-checks the size, so a concurrent overwrite is reported rather
        than pairing one version's metadata with another's bytes (etags are compared where
        the backend has them).
        """
        from ..errors import StoreUnavailable

        meta = await self.stat(key)
        data = await self.get(key)
        after = await self.stat(key)
        if len(data) != after.size or meta.etag != after.etag:
            raise StoreUnavailable("object changed while being read", tier=self.tier, key=key)
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
        """Start (or, with ``token``, continue) a resumable write of ``size`` bytes.

        The default keeps each part as a hidden temporary object and concatenates them with
        a streamed write on commit; POSIX writes parts into one temp file with ``pwrite``.
        """
        return await TempPartsWriter.open(self, self._key(key), size, part_size, token, options)

    def local_path(self, key: str) -> str | None:
        """The local file behind ``key`` (validated) where :attr:`local_root` is set, else
        None.  A symbolic link on the way (inside the root) raises
        :class:`~fmstore.errors.PermissionDenied`, as the store's own calls do; callers
        that open the path should still open it with ``O_NOFOLLOW`` (a link could be
        planted after this check)."""
        root = self.local_root
        if root is None:
            return None
        k = self._key(key)
        p = root
        for name in k.split("/"):
            p = os.path.join(p, name)
            try:
                st = os.lstat(p)
            except OSError:
                break  # missing: the caller's open says so
            if stat.S_ISLNK(st.st_mode):
                raise PermissionDenied(
                    "a symbolic link in the key's path: links inside a tier are not followed",
                    tier=self.tier,
                    key=key,
                )
        return os.path.join(root, k)

    async def exists(self, key: str) -> bool:
        try:
            await self.stat(key)
        except NotFound:
            return False
        return True

    async def get_ranges(
        self, key: str, ranges: Sequence[ByteRange], *, coalesce: int = 1 << 20
    ) -> builtins.list[bytes]:
        """Several ranges of one object, merging neighbours closer than ``coalesce`` bytes
        into one request (fewer round trips on S3), fetched concurrently."""
        import asyncio

        if not ranges:
            return []
        order = sorted(range(len(ranges)), key=lambda i: ranges[i].start)
        groups: builtins.list[list[int]] = [[order[0]]]
        for i in order[1:]:
            last = ranges[groups[-1][-1]]
            if ranges[i].start - last.end <= coalesce:
                groups[-1].append(i)
            else:
                groups.append([i])

        async def fetch(group: builtins.list[int]) -> builtins.list[tuple[int, bytes]]:
            lo = min(ranges[i].start for i in group)
            hi = max(ranges[i].end for i in group)
            blob = await self.get_range(key, lo, hi)
            view = memoryview(blob)
            return [(i, bytes(view[ranges[i].start - lo : ranges[i].end - lo])) for i in group]

        out: builtins.list[bytes] = [b""] * len(ranges)
        for part in await asyncio.gather(*(fetch(g) for g in groups)):
            for i, b in part:
                out[i] = b
        return out

    async def delete_many(self, keys: Iterable[str]) -> None:
        """Delete several keys (backends batch where they can).  Where a recursive listing
        gives directory entries (S3 folder markers), such an entry's key (ending in "/")
        deletes the marker; other stores refuse such a key."""
        import asyncio

        await asyncio.gather(*(self.delete(k) for k in keys))

    async def list_keys(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[str]:
        return [m.key async for m in self.list(prefix, recursive=recursive) if not m.is_dir]

    def sub(self, prefix: str) -> Store:
        """A view of this store rooted at ``prefix`` (keys are relative to it)."""
        return PrefixStore(self, prefix)

    # ---- helpers for backends -------------------------------------------------------

    def _key(self, key: str) -> str:
        return _keys.validate_key(key, tier=self.tier)

    def _prefix(self, prefix: str) -> str:
        return _keys.validate_prefix(prefix, tier=self.tier)

    def _check_range(self, key: str, size: int, start: int, end: int | None) -> int:
        """Validate ``[start, end)`` against ``size``; returns the resolved end."""
        if end is None:
            end = size
        if start < 0 or end < start:
            raise InvalidRange(f"bad range [{start}, {end})", tier=self.tier, key=key)
        if start > size or end > size:
            raise InvalidRange(
                f"range [{start}, {end}) is past the end of a {size}-byte object",
                tier=self.tier,
                key=key,
            )
        return end

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, tier={self.tier!r})"


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
        return dataclasses.replace(meta, key=meta.key[len(self.prefix) :])

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

    async def leftovers(self, under: str = "") -> builtins.list[Leftover]:
        items = await self.inner.leftovers(self.prefix + self._prefix(under))
        n = len(self.prefix)
        return [
            dataclasses.replace(i, key=i.key[n:]) for i in items if i.key.startswith(self.prefix)
        ]

    async def remove_leftover(self, item: Leftover) -> None:
        await self.inner.remove_leftover(dataclasses.replace(item, key=self.prefix + item.key))

    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        return await self.inner.get_range(self._full(key), start, end)

    async def get_range_pieces(self, key: str, start: int, end: int) -> list[Buffer]:
        return await self.inner.get_range_pieces(self._full(key), start, end)

    async def get_into(self, key: str, start: int, out: memoryview) -> None:
        await self.inner.get_into(self._full(key), start, out)

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
        await self.inner.read_to(self._full(key), start, end, consume, etag=etag, ring=ring)

    async def stat(self, key: str) -> ObjectMeta:
        return self._strip(await self.inner.stat(self._full(key)))

    async def stored_crc32c(self, key: str) -> tuple[int, int | None]:
        return await self.inner.stored_crc32c(self._full(key))

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

    def _full_entry(self, key: str) -> str:
        # a directory entry's key (an S3 folder marker) keeps its trailing "/"
        return self.prefix + self._prefix(key) if key.endswith("/") else self._full(key)

    async def delete(self, key: str) -> None:
        await self.inner.delete(self._full(key))

    async def delete_many(self, keys: Iterable[str]) -> None:
        await self.inner.delete_many([self._full_entry(k) for k in keys])

    async def copy(self, src: str, dst: str, options: PutOptions = PutOptions()) -> ObjectMeta:
        return self._strip(await self.inner.copy(self._full(src), self._full(dst), options))

    async def sync(self) -> None:
        await self.inner.sync()

    async def close(self) -> None:
        await self.inner.close()
