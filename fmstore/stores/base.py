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
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

from .. import keys as _keys
from ..errors import InvalidRange, NotFound, PermissionDenied

Buffer = bytes | bytearray | memoryview
#: One byte string given as the consecutive pieces a connection delivered, unjoined: a copy
#: writes them on as they are (``pwritev``) instead of paying one more pass to join them.
Pieces = Sequence[Buffer]
#: Takes the bytes of a streamed read (:meth:`Store.read_to`) in order: returns None when
#: done with them, or an awaitable to complete before the next bytes come.
Consumer = Callable[[memoryview], "Awaitable[None] | None"]


def as_pieces(data: Buffer | Pieces) -> Pieces:
    """A buffer or pieces, as pieces."""
    if isinstance(data, bytes | bytearray | memoryview):
        return (data,)
    return data


def nbytes(data: Buffer | Pieces) -> int:
    """Length of a buffer or of pieces together."""
    return sum(memoryview(p).nbytes for p in as_pieces(data))


def joined(data: Buffer | Pieces) -> Buffer:
    """One buffer for a buffer or pieces (a single piece is returned as is, not copied)."""
    pieces = as_pieces(data)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


@dataclass(frozen=True)
class ObjectMeta:
    """What ``stat`` and ``list`` know about an object (or, for ``is_dir``, a sub-prefix)."""

    key: str
    size: int
    mtime: float | None = None
    etag: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    is_dir: bool = False
    #: The file's ``os.stat`` on POSIX tiers (mode, owner, times), where the backend had it.
    stat: os.stat_result | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class PutOptions:
    """How a write behaves.

    ``mode``: ``"overwrite"`` (default) replaces any existing object; ``"create"`` raises
    :class:`~fmstore.errors.AlreadyExists` when the key exists; ``"if_match"`` replaces the
    object only while its etag still equals ``if_match`` (else
    :class:`~fmstore.errors.PreconditionFailed`).  ``metadata``: user metadata stored with the
    object (S3 ``x-amz-meta-*``; POSIX keeps it in a sidecar-free xattr where possible).
    ``content_crc32c``: the CRC32C of the whole object when the caller already has it, so a
    backend that can have the server verify it does.  ``durable=False`` lets a backend that
    caches writes (POSIX: the page cache) return before the bytes are on stable storage;
    :meth:`Store.sync` makes every such earlier write durable.  Bulk copies use it to pay
    one sync per batch instead of one per file; a crash before the sync may lose those
    writes (not corrupt other objects), so their callers must be able to tell.
    ``preserve_owner``: a POSIX backend also restores the owner and group that FSx-style
    ``metadata`` names (see :mod:`.posixmeta`); off by default, as metadata is written by
    whoever may write to the source.
    """

    mode: Literal["overwrite", "create", "if_match"] = "overwrite"
    if_match: str | None = None
    metadata: Mapping[str, str] | None = None
    content_crc32c: int | None = None
    durable: bool = True
    preserve_owner: bool = False


@dataclass(frozen=True)
class ByteRange:
    """``[start, end)`` of an object."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


class Writer(abc.ABC):
    """A streamed write of one object, made visible only by :meth:`commit`.

    Use as ``async with await store.open_writer(key) as w: await w.write(b)``: leaving the
    block normally commits, an exception aborts.
    """

    @abc.abstractmethod
    async def write(self, data: Buffer) -> None: ...

    @abc.abstractmethod
    async def commit(self) -> ObjectMeta:
        """Make the object visible atomically; returns its metadata."""

    @abc.abstractmethod
    async def abort(self) -> None:
        """Discard everything written; safe to call more than once."""

    async def __aenter__(self) -> Writer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.commit()
        else:
            await self.abort()


def part_count(size: int, part_size: int) -> int:
    """How many parts of ``part_size`` bytes an object of ``size`` bytes has (at least 1)."""
    return max(1, -(-size // part_size))


def part_bounds(index: int, size: int, part_size: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index``."""
    start = index * part_size
    return start, min(size, start + part_size)


class PartWriter(abc.ABC):
    """A write of one object of known size in numbered parts, resumable across processes.

    Part ``i`` covers ``[i * part_size, min(size, (i + 1) * part_size))`` of the final
    object; parts may be written in any order and concurrently.  :attr:`token` names the pending write: a later
    process passes it to :meth:`Store.open_part_writer` to continue, and parts written
    before (and made durable by :meth:`write_part` returning) need not be written again.
    :attr:`resumed` says whether the pending write was found; when False every part must
    be written.  Nothing is visible at the key before :meth:`commit`; :meth:`abort` removes
    everything.  A writer dropped without either (a crash, a cancelled copy) leaves its
    parts for resumption; ``cleanup_temp`` on POSIX tiers removes old ones.
    """

    token: str
    resumed: bool

    @abc.abstractmethod
    async def write_part(self, index: int, data: Buffer | Pieces) -> None:
        """Write part ``index`` (exactly its length, in one buffer or as :data:`Pieces`);
        durable when this returns, and ``data`` is not referenced any more: the caller
        may reuse its buffer."""

    @abc.abstractmethod
    async def commit(
        self,
        metadata: Mapping[str, str] | None = None,
        *,
        part_crc32c: Mapping[int, int] | None = None,
    ) -> ObjectMeta:
        """Publish the object atomically, adding ``metadata`` to the options' metadata.

        ``metadata`` exists because some values (a whole-object checksum) are only known
        once every part is written; backends that fix metadata when the write opens (S3)
        pay a server-side copy for it, so pass what is known at open.  ``part_crc32c``:
        the CRC32C of parts by index, for backends whose commit names each part's checksum
        (S3) when earlier processes wrote some of them.
        """

    @abc.abstractmethod
    async def abort(self) -> None:
        """Discard every part; safe to call more than once."""

    def stream_part(self, index: int) -> PartStream | None:
        """Part ``index`` written front to back as its bytes arrive (a copy streaming
        from :meth:`Store.read_to`), where the backend can (POSIX: ``pwrite`` at the
        part's offset); None where it takes whole parts only (S3's UploadPart)."""
        return None

    async def read_part(self, index: int) -> bytes | None:
        """The bytes part ``index`` holds now, where the backend can read a pending write
        back (POSIX); None elsewhere.  Lets a resumed copy check parts written without a
        sync instead of writing them again."""
        return None


class PartStream(abc.ABC):
    """One part of a :class:`PartWriter`, written in order (see
    :meth:`PartWriter.stream_part`)."""

    @abc.abstractmethod
    def write(self, data: memoryview) -> Awaitable[None] | None:
        """Append ``data`` (a :data:`Consumer`): None once written, or an awaitable to
        complete before the next write and before ``data`` is reused.  ValueError past the
        part's end."""

    @abc.abstractmethod
    async def close(self) -> None:
        """The part is complete: durable when this returns, as after
        :meth:`PartWriter.write_part`.  ValueError when fewer bytes came than the part
        holds."""


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

    async def cleanup_temp(self, older_than: float = 3600.0, under: str = "") -> int:
        """Remove the temp files that crashed writers left under this store (below the
        prefix ``under``), older than ``older_than`` seconds; returns how many.  Stores whose writes leave no temp
        objects (S3 aborts its uploads, fsspec) have none: 0."""
        return 0

    async def close(self) -> None:
        """Release connections and pools; the store is unusable afterwards."""

    # ---- built on top, once ---------------------------------------------------------

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

    async def read_to(self, key: str, start: int, end: int, consume: Consumer) -> None:
        """Hand bytes ``[start, end)`` of ``key`` to ``consume``, in order.

        The bytes passed are only valid during the call (or until its awaitable is done).
        Backends that stream (S3) call it as bytes arrive, from a buffer small enough to
        stay in the CPU's cache, so a copy to a file never holds a whole range in memory;
        this default reads the range, then hands over its pieces.  What ``consume`` raises
        is raised as is.
        """
        for piece in await self.get_range_pieces(key, start, end):
            pending = consume(memoryview(piece))
            if pending is not None:
                await pending

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
        from .parts import TempPartsWriter

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
        """Delete several keys (backends batch where they can)."""
        import asyncio

        await asyncio.gather(*(self.delete(k) for k in keys))

    async def list_keys(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[str]:
        return [m.key async for m in self.list(prefix, recursive=recursive) if not m.is_dir]

    def sub(self, prefix: str) -> Store:
        """A view of this store rooted at ``prefix`` (keys are relative to it)."""
        from .prefix import PrefixStore

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
