"""The POSIX backend's writers: a streamed object (:class:`_PosixWriter`) and resumable
numbered parts ``pwrite``-n into one temp file (:class:`_PosixPartWriter`, whose parts
may also arrive as streams, :class:`_PosixPartStream`).

Each holds the directory resolved when it was opened and its temp file there until
:func:`_commit_tmp` (finish, close, publish through the store's usual rename) or
:func:`_abort_tmp`.  Blocking calls run in the runtime's I/O pool.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from .. import runtime
from .base import (
    Buffer,
    ObjectMeta,
    PartStream,
    PartWriter,
    Pieces,
    PutOptions,
    Writer,
    nbytes,
    part_bounds,
)
from .posix_io import (
    DIRECT_RING,
    DirectWrites,
    QuickWrites,
    _start_writeback,
    drop_cached,
    give_ring,
    pwrite_all,
    pwrite_behind,
    take_ring,
)

if TYPE_CHECKING:
    from .posix import PosixStore


class _PosixWriter(Writer):
    """Writes into a temp file in the directory ``dfd`` (held open until commit or abort,
    so the commit renames in the directory resolved at open, whatever changed since)."""

    def __init__(
        self,
        store: PosixStore,
        key: str,
        dfd: int,
        name: str,
        tmp: str,
        fd: int,
        options: PutOptions,
    ) -> None:
        self.store, self.key, self.dfd, self.name = store, key, dfd, name
        self.tmp, self.fd, self.options = tmp, fd, options
        self.pos = 0
        self._done = False
        # Written behind (pwrite_behind) when the store says so: the windows it carries
        # between calls; any there once synced, the rest of the file is dropped too.
        self._started: list[tuple[int, int]] | None = [] if store._behind(options) else None

    async def write(self, data: Buffer | Pieces) -> None:
        if self._done:
            raise ValueError("writer is closed")
        pos, started = self.pos, self._started

        def do() -> None:
            with self.store._translate(self.key):
                if started is None:
                    pwrite_all(self.fd, data, pos)
                else:
                    pwrite_behind(self.fd, data, pos, started)

        await runtime.to_io(do)
        self.pos = pos + nbytes(data)

    async def commit(self) -> ObjectMeta:
        if self._done:
            raise ValueError("writer is closed")
        self._done = True
        return await runtime.to_io(
            _commit_tmp,
            self.store,
            self.key,
            self.dfd,
            self.name,
            self.tmp,
            self.fd,
            self.options,
            bool(self._started),
        )

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        await runtime.to_io(_abort_tmp, self.dfd, self.tmp, self.fd)


def _commit_tmp(
    store: PosixStore,
    key: str,
    dfd: int,
    name: str,
    tmp: str,
    fd: int,
    options: PutOptions,
    drop: bool = False,
) -> ObjectMeta:
    """Finish, close and publish a writer's temp file; the directory is closed after.
    ``drop``: it was written behind (:func:`pwrite_behind`): once synced, leave none of it
    in the page cache."""
    try:
        with store._translate(key):
            try:
                store._finish_fd(fd, options)
                if drop:
                    drop_cached(fd)
            finally:
                os.close(fd)
            return store._publish(key, dfd, tmp, name, options)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    finally:
        os.close(dfd)


def _abort_tmp(dfd: int, tmp: str, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
    finally:
        os.close(dfd)


class _PosixPartStream(PartStream):
    """A part ``pwrite``-n at its offset as its bytes arrive (:class:`QuickWrites`: on the
    event loop while quick on a local file system; on Lustre, NFS or FUSE in the I/O pool).

    On a local file system, a part of at least a ring offers the source a ring to receive
    into (:attr:`ring`), and what arrives there is written from it with ``O_DIRECT``
    (:class:`DirectWrites`), in the I/O pool."""

    def __init__(self, writer: _PosixPartWriter, index: int) -> None:
        self.w, self.index = writer, index
        self.start, self.end = part_bounds(index, writer.size, writer.part_size)
        self.pos = self.start
        self._out = QuickWrites(self._write, inline=writer.store._inline_puts)
        self._direct = writer._directly() if self.end - self.start >= DIRECT_RING else None
        self.ring = take_ring() if self._direct is not None else None

    def write(self, data: memoryview) -> Awaitable[None] | None:
        n, off = data.nbytes, self.pos
        if off + n > self.end:
            raise ValueError(f"part {self.index} holds {self.end - self.start} bytes, no more")
        self.pos += n
        direct = self._direct
        if self.ring is not None and direct is not None and direct.fits(data, off, self.ring):
            return runtime.to_io(self._write_direct, direct, data, off)
        return self._out(data, off)

    def _write_direct(self, direct: DirectWrites, data: memoryview, offset: int) -> None:
        with self.w.store._translate(self.w.key):
            direct.write(data, offset)

    def _write(self, data: memoryview, offset: int) -> None:
        try:
            pwrite_all(self.w.fd, data, offset)
        except OSError as e:
            raise self.w.store._error(e, self.w.key) from e

    async def close(self) -> None:
        if self.ring is not None:  # the source is done with it
            give_ring(self.ring)
            self.ring = None
        if self.pos != self.end:
            raise ValueError(
                f"part {self.index}: {self.pos - self.start} of {self.end - self.start} bytes"
            )

        def do() -> None:
            with self.w.store._translate(self.w.key):
                self.w._settle(self.start, self.end)

        await runtime.to_io(do)


class _PosixPartWriter(PartWriter):
    def __init__(
        self,
        store: PosixStore,
        key: str,
        dfd: int,
        name: str,
        tmp: str,
        fd: int,
        size: int,
        part_size: int,
        resumed: bool,
        options: PutOptions,
    ) -> None:
        self.store, self.key, self.dfd, self.name = store, key, dfd, name
        self.tmp, self.fd = tmp, fd
        self.size, self.part_size, self.options = size, part_size, options
        self.token = tmp
        self.resumed = resumed
        self._done = False
        self._direct: DirectWrites | None = None  # opened by the first part that streams

    def _directly(self) -> DirectWrites | None:
        """The file's ``O_DIRECT`` writes, for a local file system's parts."""
        if self._direct is None and self.store._inline_puts:
            self._direct = DirectWrites(self.fd)
        return self._direct if self._direct is not None and self._direct.ok else None

    def _close_direct(self) -> None:
        if self._direct is not None:
            self._direct.close()

    async def write_part(self, index: int, data: Buffer | Pieces) -> None:
        if self._done:
            raise ValueError("writer is closed")
        start, end = part_bounds(index, self.size, self.part_size)
        got = nbytes(data)
        if got != end - start:
            raise ValueError(f"part {index} must be {end - start} bytes, not {got}")

        def do() -> None:
            with self.store._translate(self.key):
                pwrite_all(self.fd, data, start)
                self._settle(start, end)

        await runtime.to_io(do)

    def _settle(self, start: int, end: int) -> None:
        """A part is written: durable now, or its write-back started."""
        if not self.store.options.fsync:
            return
        if self.options.durable:
            os.fdatasync(self.fd)  # durable before the caller journals the part as done
        else:
            _start_writeback(self.fd, start, end - start)

    def stream_part(self, index: int) -> PartStream:
        if self._done:
            raise ValueError("writer is closed")
        return _PosixPartStream(self, index)

    async def read_part(self, index: int) -> bytes | None:
        start, end = part_bounds(index, self.size, self.part_size)

        def do() -> bytes:
            with self.store._translate(self.key):
                fd = os.open(self.tmp, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=self.dfd)
                try:
                    return os.pread(fd, end - start, start)
                finally:
                    os.close(fd)

        return await runtime.to_io(do)

    async def commit(
        self,
        metadata: Mapping[str, str] | None = None,
        *,
        part_crc32c: Mapping[int, int] | None = None,
    ) -> ObjectMeta:
        if self._done:
            raise ValueError("writer is closed")
        self._done = True
        self._close_direct()
        merged = {**(self.options.metadata or {}), **(metadata or {})}
        options = replace(self.options, metadata=merged or None)
        return await runtime.to_io(
            _commit_tmp, self.store, self.key, self.dfd, self.name, self.tmp, self.fd, options
        )

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._close_direct()
        await runtime.to_io(_abort_tmp, self.dfd, self.tmp, self.fd)
