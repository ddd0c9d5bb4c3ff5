"""The values and writer interfaces of the Store interface (:mod:`fmstore.stores.base`):
buffers given as one byte string or as pieces, object metadata, put options, ranges, the
writers a store hands out, and the mark of their temp names.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

#: Every backend's temp objects (a write before its rename, a part before its upload or
#: join) carry this mark in their name: listings hide them, ``cleanup_temp`` removes them.
TMP_MARK = ".fmstore-tmp."

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


def views_of(data: Buffer | Pieces) -> list[memoryview]:
    """A buffer or pieces as flat byte views, empty ones left out."""
    views = (memoryview(p).cast("B") for p in as_pieces(data))
    return [v for v in views if v.nbytes]


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
class Leftover:
    """Something a writer that died left under a store (:meth:`Store.leftovers`).

    ``kind``: ``"upload"`` (an unfinished S3 multipart upload, holding its parts) or
    ``"temp"`` (a POSIX temp file).  ``key``: the object the upload was for, or the temp
    file's own key.  ``size``: bytes it holds.  ``idle``: seconds since it last changed (its
    newest part, the file's mtime), so a write still in progress looks young however long
    ago it began.  ``token``: the upload id.
    """

    kind: str
    key: str
    size: int
    idle: float
    token: str | None = None


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
    async def write(self, data: Buffer | Pieces) -> None:
        """Append ``data``: a buffer, or pieces written in order as if joined (a blob
        gathered from many tensors needs no copy to be one buffer).  The buffers are read
        only while the call runs: the caller may reuse them once it returns."""

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

    #: Where the source should receive the part's bytes (``ring`` of
    #: :meth:`Store.read_to`), when the stream has a buffer it writes from best.
    ring: memoryview | None = None

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
