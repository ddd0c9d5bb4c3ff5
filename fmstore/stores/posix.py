"""POSIX backend: the ``nvme`` and ``lustre`` tiers.

Every write goes to a hidden temp file in the target directory, is fsynced, renamed over
the key (or hard-linked, for create-only writes) and the directory is fsynced: one helper,
:func:`commit_at`, does all four so the directory fsync can never be forgotten.  Blocking
calls run in the runtime's I/O pool, never on the event loop.

Paths are resolved beneath the root with no symbolic link followed (:mod:`.beneath`): a
link inside the tier refuses the call (``PermissionDenied``) and listings skip links.

The backend is four modules: this one (reads and writes of objects), :mod:`.posix_tree`
(the root, paths, listing, deletes), :mod:`.posix_writers` (streamed and part writers)
and :mod:`.posix_io` (what the OS offers below ``os``: ``O_DIRECT``, ``syncfs``, the
metadata xattr, atomic publication).  The names importers use are all importable from here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat as _stat
from collections.abc import Iterator

from .. import runtime
from ..errors import AlreadyExists, PreconditionFailed
from . import posixmeta
from .base import Buffer, ObjectMeta, PartWriter, PutOptions, Writer
from .posix_io import (
    _META_JSON,
    _STAMP,
    _XATTR,
    BLOCK,
    _copy_fd,
    _read_meta,
    _stamp,
    _syncfs,
    _write_direct,
    commit_at,
    commit_file,
    drop_cached,
    fs_type,
    fsync_dir,
    pwrite_all,
    pwrite_behind,
)
from .posix_tree import _LOCK_NAME, PosixOptions, PosixTree, _etag
from .posix_writers import _PosixPartWriter, _PosixWriter
from .types import TMP_MARK

#: Names importers take from here, wherever they are defined.
__all__ = [
    "BLOCK",
    "INLINE_PUT_BYTES",
    "TMP_MARK",
    "PosixOptions",
    "PosixStore",
    "commit_at",
    "commit_file",
    "fs_type",
    "fsync_dir",
    "pwrite_all",
]


class PosixStore(PosixTree):
    """A directory tree as a store: key ``a/b`` is file ``ROOT/a/b`` (the tree itself,
    paths and listings, is :class:`~.posix_tree.PosixTree`)."""

    # ---- primitives -------------------------------------------------------------------

    async def put(self, key: str, data: Buffer, options: PutOptions = PutOptions()) -> ObjectMeta:
        view = memoryview(data).cast("B")
        if (
            self._inline_puts
            and view.nbytes <= INLINE_PUT_BYTES
            and options.mode != "if_match"  # takes a directory lock: may wait on others
            and not (self.options.fsync and options.durable)
        ):
            return self._put_sync(key, view, options)
        return await runtime.to_io(self._put_sync, key, view, options)

    def _put_sync(self, key: str, data: memoryview, options: PutOptions) -> ObjectMeta:
        with self._translate(key):
            dfd, name, tmp, fd = self._open_tmp(key, sync=options.durable)
            try:
                try:
                    behind = self._write_all(fd, dfd, tmp, data, self._behind(options))
                    self._finish_fd(fd, options)
                    if behind:
                        drop_cached(fd)
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                return self._publish(key, dfd, tmp, name, options, st)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
            finally:
                os.close(dfd)

    def _write_all(self, fd: int, dfd: int, tmp: str, data: memoryview, behind: bool) -> bool:
        """Write ``data`` into the new file; True when written behind (:func:`pwrite_behind`)."""
        n = len(data)
        if self.options.direct_io and n >= 2 * BLOCK and hasattr(os, "O_DIRECT"):
            _write_direct(fd, dfd, tmp, data)
            return False
        if behind:
            return pwrite_behind(fd, data, 0)
        pwrite_all(fd, data, 0)
        return False

    def _behind(self, options: PutOptions) -> bool:
        """Whether writes of ``options`` go to disk as they are written, dropped from the
        page cache behind them (:func:`pwrite_behind`): those synced when done, on local
        file systems (Lustre and NFS clients cache and write back by their own rules)."""
        return self._inline_puts and self.options.fsync and options.durable

    def _finish_fd(self, fd: int, options: PutOptions) -> None:
        if options.metadata:
            # FSx-convention times first (the stamp records the final mtime), the xattr,
            # then mode and owner (a read-only mode would refuse the xattr).
            posixmeta.apply_times(fd, options.metadata)
            meta = {**options.metadata, _STAMP: _stamp(os.fstat(fd))}
            os.setxattr(fd, _XATTR, _META_JSON.encode(meta).encode())
            posixmeta.apply(fd, options.metadata, times=False, owner=options.preserve_owner)
        if self.options.fsync and options.durable:
            os.fdatasync(fd)

    def _publish(
        self,
        key: str,
        dfd: int,
        tmp: str,
        name: str,
        options: PutOptions,
        st: os.stat_result | None = None,
    ) -> ObjectMeta:
        """Rename ``tmp`` to ``name`` (both in directory ``dfd``) as ``options.mode`` says;
        the object's meta.  ``st``: the temp file's ``fstat`` after its last change, when
        the caller wrote all of it with ``options.metadata`` (a rename keeps inode, size
        and mtime): no second stat, no reading back of the metadata just written."""
        sync = self.options.fsync and options.durable
        if options.mode == "create":
            try:
                commit_at(dfd, tmp, name, create_only=True, sync=sync)
            except FileExistsError:
                raise AlreadyExists("object already exists", tier=self.tier, key=key) from None
        elif options.mode == "if_match":
            with self._dir_lock(dfd):
                try:
                    current = _etag(os.stat(name, dir_fd=dfd, follow_symlinks=False))
                except FileNotFoundError:
                    current = None
                if current != options.if_match:
                    os.unlink(tmp, dir_fd=dfd)
                    raise PreconditionFailed(
                        f"etag is {current}, expected {options.if_match}", tier=self.tier, key=key
                    )
                commit_at(dfd, tmp, name, sync=sync)
        else:
            commit_at(dfd, tmp, name, sync=sync)
        if st is None:
            fd = os.open(
                name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dfd
            )
            try:
                return _file_meta(key, os.fstat(fd), fd)
            finally:
                os.close(fd)
        return ObjectMeta(
            key=key,
            size=st.st_size,
            mtime=st.st_mtime,
            etag=_etag(st),
            metadata={str(k): str(v) for k, v in (options.metadata or {}).items()},
            stat=st,
        )

    @contextlib.contextmanager
    def _dir_lock(self, dfd: int) -> Iterator[None]:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(_LOCK_NAME, flags, 0o644, dir_fd=dfd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    async def open_writer(self, key: str, options: PutOptions = PutOptions()) -> Writer:
        with self._translate(key):
            dfd, name, tmp, fd = await runtime.to_io(self._open_tmp, key, sync=options.durable)
        return _PosixWriter(self, key, dfd, name, tmp, fd, options)

    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        return await runtime.to_io(self._read_sync, key, start, end)

    def _read_sync(self, key: str, start: int, end: int | None) -> bytes:
        with self._translate(key):
            fd, st = self._open_read(key)
            try:
                stop = self._check_range(key, st.st_size, start, end)
                # One pread returns bytes without an extra copy; loop only on short reads.
                parts = []
                off = start
                while off < stop:
                    chunk = os.pread(fd, min(stop - off, 1 << 30), off)
                    if not chunk:
                        raise OSError(errno.EIO, "file shrank while being read")
                    parts.append(chunk)
                    off += len(chunk)
                return parts[0] if len(parts) == 1 else b"".join(parts)
            finally:
                os.close(fd)

    async def get_with_meta(self, key: str) -> tuple[ObjectMeta, bytes]:
        """One open: fstat, read and the metadata xattr all come from the same file."""
        if self._inline_reads:
            got = self._cached_small(key)
            if got is not None:
                return got

        def do() -> tuple[ObjectMeta, bytes]:
            with self._translate(key):
                fd, st = self._open_read(key)
                try:
                    parts = []
                    off = 0
                    while off < st.st_size:
                        chunk = os.pread(fd, min(st.st_size - off, 1 << 30), off)
                        if not chunk:
                            raise OSError(errno.EIO, "file shrank while being read")
                        parts.append(chunk)
                        off += len(chunk)
                    data = parts[0] if len(parts) == 1 else b"".join(parts)
                    meta = _file_meta(key, st, fd)
                    return meta, data
                finally:
                    os.close(fd)

        return await runtime.to_io(do)

    def _cached_small(self, key: str) -> tuple[ObjectMeta, bytes] | None:
        """A small file and its metadata, read on the calling thread when its bytes are in
        the page cache (an I/O-pool trip costs more than the whole read); None otherwise."""
        with self._translate(key):
            fd, st = self._open_read(key)
            try:
                if st.st_size > INLINE_PUT_BYTES:
                    return None
                buf = bytearray(st.st_size)
                try:
                    if st.st_size and os.preadv(fd, [buf], 0, os.RWF_NOWAIT) != st.st_size:
                        return None
                except BlockingIOError:
                    return None  # not cached
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    self._inline_reads = False  # this kernel or file system cannot
                    return None
                meta = _file_meta(key, st, fd)
                return meta, bytes(buf)
            finally:
                os.close(fd)

    async def get_into(self, key: str, start: int, out: memoryview) -> None:
        await runtime.to_io(self._read_into_sync, key, start, out)

    def _read_into_sync(self, key: str, start: int, out: memoryview) -> None:
        with self._translate(key):
            fd, st = self._open_read(key)
            try:
                self._check_range(key, st.st_size, start, start + len(out))
                self._pread_into(fd, out.cast("B"), start)
            finally:
                os.close(fd)

    def _pread_into(self, fd: int, out: memoryview, start: int) -> None:
        n = len(out)
        got = 0
        while got < n:
            r = os.preadv(fd, [out[got : got + BLOCK]], start + got)
            if r == 0:
                raise OSError(errno.EIO, "file shrank while being read")
            got += r

    async def stat(self, key: str) -> ObjectMeta:
        def do() -> ObjectMeta:
            with self._translate(key):
                fd, st = self._open_read(key)
                try:
                    return _file_meta(key, st, fd)
                finally:
                    os.close(fd)

        return await runtime.to_io(do)

    async def copy(self, src: str, dst: str, options: PutOptions = PutOptions()) -> ObjectMeta:
        self._key(src), self._key(dst)  # both valid before anything is opened

        def do() -> ObjectMeta:
            with self._translate(src):
                sfd, sst = self._open_read(src)
            try:
                with self._translate(dst):
                    dfd, name, tmp, fd = self._open_tmp(dst)
                    try:
                        _copy_fd(sfd, fd)
                        meta = options.metadata
                        if meta is None:
                            meta = _read_meta(sfd, sst)
                        self._finish_fd(
                            fd, PutOptions(metadata=meta, preserve_owner=options.preserve_owner)
                        )
                        os.close(fd)
                        fd = -1
                        return self._publish(dst, dfd, tmp, name, options)
                    except BaseException:
                        if fd >= 0:
                            os.close(fd)
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(tmp, dir_fd=dfd)
                        raise
                    finally:
                        os.close(dfd)
            finally:
                os.close(sfd)

        return await runtime.to_io(do)

    async def open_part_writer(
        self,
        key: str,
        size: int,
        part_size: int,
        *,
        token: str | None = None,
        options: PutOptions = PutOptions(),
    ) -> PartWriter:
        """Parts are ``pwrite``-n into one preallocated temp file beside the key; the token
        is the temp file's name, so a later process reopens it and writes only what is
        missing.  Commit is the usual fsync + rename: no byte is copied twice."""

        def resume() -> tuple[int, str, str, int] | None:
            if not (token and token.startswith(TMP_MARK) and "/" not in token):
                return None
            try:
                dfd, name = self._parent(key)
            except (FileNotFoundError, NotADirectoryError):
                return None
            if not _tmp_of(token, name):  # another key's temp file: never reopened or removed
                os.close(dfd)
                return None
            try:
                fd = os.open(token, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dfd)
            except FileNotFoundError:
                os.close(dfd)
                return None
            except BaseException:
                os.close(dfd)
                raise
            st = os.fstat(fd)
            if st.st_size == size and _stat.S_ISREG(st.st_mode):
                return dfd, name, token, fd
            os.close(fd)
            try:
                os.unlink(token, dir_fd=dfd)  # a write of another size: not to be resumed
            finally:
                os.close(dfd)
            return None

        def do() -> tuple[int, str, str, int, bool]:
            with self._translate(key):
                got = resume()
                if got is not None:
                    return (*got, True)
                dfd, name, tmp, fd = self._open_tmp(key, sync=options.durable)
                try:
                    os.ftruncate(fd, size)
                except BaseException:
                    os.close(fd)
                    os.unlink(tmp, dir_fd=dfd)
                    os.close(dfd)
                    raise
                return dfd, name, tmp, fd, False

        dfd, name, tmp, fd, resumed = await runtime.to_io(do)
        return _PosixPartWriter(self, key, dfd, name, tmp, fd, size, part_size, resumed, options)

    async def sync(self) -> None:
        """``syncfs`` of the file system under the root: one flush for every earlier
        ``durable=False`` write (and whatever else is dirty there)."""
        if self.options.fsync:
            await runtime.to_io(_syncfs, self.root)


def _tmp_of(token: str, name: str) -> bool:
    """Whether ``token`` is a temp file name :meth:`PosixTree._open_tmp` gives a write of
    ``name`` (a resume token read from a journal names nothing else)."""
    rand, dot, rest = token[len(TMP_MARK) :].partition(".")
    hexed = len(rand) == 32 and all(c in "0123456789abcdef" for c in rand)
    return token.startswith(TMP_MARK) and hexed and dot == "." and rest == name[:100]


#: Small writes without an fsync are done on the event loop on local file systems: a 4 KiB
#: file costs less to create there (tens of microseconds) than a trip through the I/O pool,
#: whose threads also contend with the loop for the GIL (10,000 files from S3: about 25%
#: less CPU).  Elsewhere (Lustre, NFS, FUSE: a network round trip per create) they go
#: through the pool so the loop never waits on them.
INLINE_PUT_BYTES = 64 << 10


def _file_meta(key: str, st: os.stat_result, file: str | int) -> ObjectMeta:
    """What ``stat`` knows about a file, with its metadata xattr read from ``file`` (a path
    or an open descriptor)."""
    return ObjectMeta(
        key=key,
        size=st.st_size,
        mtime=st.st_mtime,
        etag=_etag(st),
        metadata=_read_meta(file, st),
        stat=st,
    )
