"""POSIX backend: the ``nvme`` and ``lustre`` tiers.

Every write goes to a hidden temp file in the target directory, is fsynced, renamed over
the key (or hard-linked, for create-only writes) and the directory is fsynced: one helper,
:func:`commit_at`, does all four so the directory fsync can never be forgotten.  Blocking
calls run in the runtime's I/O pool, never on the event loop.

Paths are resolved beneath the root with no symbolic link followed (:mod:`.beneath`): a
link inside the tier refuses the call (``PermissionDenied``) and listings skip links.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import functools
import json
import mmap
import os
import re
import stat as _stat
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .. import runtime
from ..errors import (
    AlreadyExists,
    FmstoreError,
    InvalidKey,
    NotFound,
    PermissionDenied,
    PreconditionFailed,
    StoreUnavailable,
    TierFull,
)
from . import beneath, posixmeta
from .base import (
    Buffer,
    ObjectMeta,
    PartStream,
    PartWriter,
    Pieces,
    PutOptions,
    Store,
    Writer,
    as_pieces,
    nbytes,
    part_bounds,
)

if TYPE_CHECKING:
    import ctypes

#: Temp files carry this marker; listings hide them and ``cleanup_temp`` removes them.
TMP_MARK = ".fmstore-tmp."
_LOCK_NAME = ".fmstore-lock"
_XATTR = "user.fmstore.meta"
#: Recorded in the metadata xattr: the file's size and modification time (whole seconds,
#: as Lustre keeps them) when fmstore wrote it.  A file changed since (written in place,
#: truncated) no longer matches, and the metadata recorded with it (its checksum, the
#: source's version) no longer describes it: it then reads as having none, so the file is
#: copied again rather than skipped, and its checksum is computed rather than trusted.
_STAMP = "fmstore-written"
_ALIGN = 4096
#: Block size for large sequential writes and reads.
BLOCK = 16 << 20
#: Most buffers one ``pwritev`` takes.
_IOV_MAX = os.sysconf("SC_IOV_MAX")
#: A streamed part's write that took longer moves that part's writes off the event loop.
SLOW_WRITE_S = 0.02


@dataclass(frozen=True)
class PosixOptions:
    """Tuning for a POSIX tier.

    ``direct_io``: write large objects with ``O_DIRECT`` from aligned buffers instead of
    through the page cache + ``fdatasync`` (``benchmarks/stores.py`` measures both; buffered
    is the default because it is faster on the machines we measured).  ``stripe_count`` /
    ``stripe_size``: a Lustre layout set with ``lfs setstripe`` on directories fmstore
    creates, when ``lfs`` is on ``PATH``.  ``fsync``: turn off only for scratch data.
    """

    direct_io: bool = False
    stripe_count: int | None = None
    stripe_size: str | None = None
    fsync: bool = True
    read_threads: int = 8


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_file(tmp: str, final: str, *, create_only: bool = False, sync: bool = True) -> None:
    """Publish fsynced ``tmp`` as ``final`` atomically and make the rename durable.

    ``create_only`` links instead of renaming, so an existing ``final`` is never replaced
    (``FileExistsError``).  The temp file is gone afterwards in every case.
    """
    try:
        if create_only:
            os.link(tmp, final)
            os.unlink(tmp)
        else:
            os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_dir(os.path.dirname(final))


def commit_at(
    dfd: int, tmp: str, final: str, *, create_only: bool = False, sync: bool = True
) -> None:
    """:func:`commit_file` for names in the directory open as ``dfd`` (fsynced with
    ``sync``): the directory stays the one resolved, whatever is renamed meanwhile."""
    try:
        if create_only:
            os.link(tmp, final, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            os.unlink(tmp, dir_fd=dfd)
        else:
            os.rename(tmp, final, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    if sync:
        os.fsync(dfd)


class PosixStore(Store):
    """A directory tree as a store: key ``a/b`` is file ``ROOT/a/b``."""

    def __init__(
        self,
        root: str,
        *,
        tier: str = "file",
        options: PosixOptions | None = None,
        create: bool = True,
    ) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.tier = tier
        self.url = "file://" + self.root
        self.options = options or PosixOptions()
        self._lfs = None
        if self.options.stripe_count is not None:
            import shutil

            self._lfs = shutil.which("lfs")
        # `lfs setstripe` runs when a directory is made: never on the loop.
        self._inline_puts = self.options.stripe_count is None and fs_type(self.root) in _LOCAL_FS
        # Small reads on the loop too, but only from the page cache (RWF_NOWAIT): a read that
        # would wait on the disk goes to the I/O pool.
        self._inline_reads = self._inline_puts and hasattr(os, "RWF_NOWAIT")
        if create:
            with self._translate(None):
                self._makedirs(self.root)
        elif not os.path.isdir(self.root):
            raise NotFound("directory does not exist", tier=tier, key=self.root)

    # ---- error translation at the edge ----------------------------------------------

    @contextlib.contextmanager
    def _translate(self, key: str | None) -> Iterator[None]:
        try:
            yield
        except FmstoreError:
            raise
        except OSError as e:
            raise self._error(e, key) from e

    def _error(self, e: OSError, key: str | None) -> FmstoreError:
        msg = f"{e.strerror or e}"
        code = e.errno
        if code == errno.ELOOP or (code == errno.ENOTDIR and self._link_on_path(key)):
            return PermissionDenied(
                "a symbolic link in the key's path: links inside a tier are not followed",
                tier=self.tier,
                key=key,
            )
        if code == errno.ENXIO:  # a socket
            return NotFound("not a regular file", tier=self.tier, key=key)
        if code in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
            return NotFound(
                "no such object" if code != errno.EISDIR else "is a directory, not an object",
                tier=self.tier,
                key=key,
            )
        if code in (errno.EACCES, errno.EPERM, errno.EROFS):
            return PermissionDenied(f"permission denied: {msg}", tier=self.tier, key=key)
        if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return TierFull(f"no space left: {msg}", tier=self.tier, key=key)
        if code == errno.EEXIST:
            return AlreadyExists("object already exists", tier=self.tier, key=key)
        return StoreUnavailable(f"I/O error: {msg}", tier=self.tier, key=key)

    def _link_on_path(self, rel: str | None) -> bool:
        """Whether a component of ``rel`` is a symbolic link: only to name the reason of a
        resolution that already failed (``ENOTDIR`` is also a file where a directory was
        expected), never to decide one."""
        p = self.root
        for name in (rel or "").strip("/").split("/"):
            p = os.path.join(p, name)
            try:
                mode = os.lstat(p).st_mode
            except OSError:
                return False
            if _stat.S_ISLNK(mode):
                return True
            if not _stat.S_ISDIR(mode):
                return False
        return False

    # ---- paths ------------------------------------------------------------------------
    #
    # Every path is resolved from a descriptor of the root opened for the call, with no
    # symbolic link followed (see :mod:`.beneath`): a link planted inside a shared tier
    # never leads a write, read or delete outside it.  Nothing resolved is cached: each
    # call opens what it needs, so a concurrent rename is never seen half-applied.

    def _root_fd(self, *, create: bool = False) -> int:
        try:
            return os.open(self.root, beneath.DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
        self._makedirs(self.root)  # the operator's path, links and all: recreate it
        return os.open(self.root, beneath.DIR_FLAGS)

    def _parent(self, key: str, *, create: bool = False, sync: bool = True) -> tuple[int, str]:
        """The directory holding ``key``, open (the caller closes it), and the key's last
        component; with ``create``, missing directories are made (each new entry's parent
        fsynced with ``sync``, striped on Lustre)."""
        d, _, name = self._key(key).rpartition("/")
        root = self._root_fd(create=create)
        try:
            if not create:
                return beneath.open_dir(root, d), name
            durable = sync and self.options.fsync
            on_new = self._on_new_durable if durable else self._on_new_dir if self._lfs else None
            return beneath.make_dirs(root, d, on_new), name
        finally:
            os.close(root)

    def _on_new_dir(self, parent: int, name: str) -> None:
        if self._lfs:
            self._setstripe(f"/proc/{os.getpid()}/fd/{parent}/{name}")

    def _on_new_durable(self, parent: int, name: str) -> None:
        self._on_new_dir(parent, name)
        os.fsync(parent)

    def _open_read(self, key: str) -> tuple[int, os.stat_result]:
        """A regular file's descriptor and ``fstat``; a FIFO, socket or device is no object
        (``O_NONBLOCK``: opening a FIFO would otherwise wait for a writer)."""
        root = self._root_fd()
        try:
            fd = beneath.open_beneath(root, self._key(key), os.O_RDONLY | os.O_NONBLOCK)
        finally:
            os.close(root)
        try:
            st = os.fstat(fd)
            if not _stat.S_ISREG(st.st_mode):
                raise NotFound(
                    "is a directory, not an object"
                    if _stat.S_ISDIR(st.st_mode)
                    else "not a regular file",
                    tier=self.tier,
                    key=key,
                )
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _makedirs(self, path: str, *, sync: bool = True) -> None:
        """Create the root ``path`` and missing parents (fsync each new entry's parent
        with ``sync``), stripe on Lustre."""
        missing = []
        p = path
        while not os.path.isdir(p):
            missing.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue
            if self._lfs:
                self._setstripe(d)
            if sync and self.options.fsync:
                fsync_dir(os.path.dirname(d))

    def _setstripe(self, d: str) -> None:
        cmd = [self._lfs or "lfs", "setstripe", "-c", str(self.options.stripe_count)]
        if self.options.stripe_size:
            cmd += ["-S", self.options.stripe_size]
        subprocess.run([*cmd, d], check=True, capture_output=True)

    def _open_tmp(self, key: str, *, sync: bool = True) -> tuple[int, str, str, int]:
        """A new temp file beside ``key``: (directory fd, key's name, temp name, temp fd)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        for attempt in range(3):
            dfd, name = self._parent(key, create=True, sync=sync)
            tmp = f"{TMP_MARK}{os.urandom(16).hex()}.{name[:100]}"
            try:
                return dfd, name, tmp, os.open(tmp, flags, 0o644, dir_fd=dfd)
            except FileNotFoundError:
                os.close(dfd)
                # A concurrent delete pruned the (empty) directory between mkdir and open.
                if attempt == 2:
                    raise
            except BaseException:
                os.close(dfd)
                raise
        raise AssertionError("unreachable")

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
                    self._write_all(fd, dfd, tmp, data)
                    self._finish_fd(fd, options)
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

    def _write_all(self, fd: int, dfd: int, tmp: str, data: memoryview) -> None:
        n = len(data)
        if self.options.direct_io and n >= 2 * BLOCK and hasattr(os, "O_DIRECT"):
            self._write_direct(fd, dfd, tmp, data)
            return
        off = 0
        while off < n:
            off += os.write(fd, data[off : off + BLOCK])

    def _write_direct(self, fd: int, dfd: int, tmp: str, data: memoryview) -> None:
        """Aligned O_DIRECT writes of the bulk; the unaligned tail goes through the cache."""
        n = len(data)
        bulk = n - n % _ALIGN
        buf = mmap.mmap(-1, BLOCK)  # page-aligned staging buffer
        try:
            flags = os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW
            direct = os.open(tmp, flags, dir_fd=dfd)
            try:
                off = 0
                while off < bulk:
                    m = min(BLOCK, bulk - off)
                    buf[:m] = data[off : off + m]
                    written = os.pwrite(direct, memoryview(buf)[:m], off)
                    off += written
            finally:
                os.close(direct)
        finally:
            buf.close()
        if bulk < n:
            pwrite_all(fd, data[bulk:], bulk)

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

    async def list(
        self,
        prefix: str = "",
        *,
        recursive: bool = True,
        start_after: str | None = None,
        page_size: int = 1000,
    ) -> AsyncIterator[ObjectMeta]:
        prefix = self._prefix(prefix)
        entries = await runtime.to_io(self._list_sync, prefix, recursive)
        for i in range(0, len(entries), page_size):
            for meta in entries[i : i + page_size]:
                if start_after is None or meta.key > start_after:
                    yield meta

    def _list_sync(self, prefix: str, recursive: bool) -> builtins.list[ObjectMeta]:
        """Regular files and directories only: a symbolic link is neither listed nor
        descended into (each directory is opened beneath the root with no link followed,
        so one swapped for a link after it was seen is skipped too)."""
        out: builtins.list[ObjectMeta] = []
        stack = [prefix]
        with self._translate(prefix or None):
            try:
                root = self._root_fd()
            except FileNotFoundError:
                return out
            try:
                while stack:
                    rel = stack.pop()
                    try:
                        fd = beneath.open_dir(root, rel.rstrip("/"))
                    except NotADirectoryError:
                        if rel == prefix and self._link_on_path(rel):
                            raise
                        continue
                    except FileNotFoundError:
                        continue
                    except PermissionError:
                        raise PermissionDenied(
                            f"permission denied listing {rel or '/'}",
                            tier=self.tier,
                            key=rel or None,
                        ) from None
                    except OSError as e:
                        if beneath.is_link_error(e) and rel != prefix:
                            continue  # replaced by a link since its parent was listed
                        raise
                    try:
                        self._scan(fd, rel, recursive, stack, out)
                    finally:
                        os.close(fd)
            finally:
                os.close(root)
        out.sort(key=lambda m: m.key.encode("utf-8"))
        return out

    def _scan(
        self,
        fd: int,
        rel: str,
        recursive: bool,
        stack: builtins.list[str],
        out: builtins.list[ObjectMeta],
    ) -> None:
        with os.scandir(fd) as it:
            for e in it:
                if e.name.startswith(TMP_MARK) or e.name == _LOCK_NAME:
                    continue
                if not e.name.isascii():
                    _check_utf8(rel, e.name, self.tier)
                key = rel + e.name
                if e.is_dir(follow_symlinks=False):
                    if recursive:
                        stack.append(key + "/")
                    else:
                        out.append(ObjectMeta(key=key + "/", size=0, is_dir=True))
                elif e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    out.append(
                        ObjectMeta(
                            key=key,
                            size=st.st_size,
                            mtime=st.st_mtime,
                            etag=_etag(st),
                            stat=st,
                        )
                    )

    async def delete(self, key: str) -> None:
        await runtime.to_io(self._delete_sync, key)

    def _delete_sync(self, key: str) -> None:
        """Unlink ``key``'s entry: a symbolic link named by the key is removed itself (its
        target untouched); one on the way to it refuses the delete."""
        with self._translate(key):
            try:
                dfd, name = self._parent(key)
            except FileNotFoundError:
                return
            except NotADirectoryError:
                if self._link_on_path(key):
                    raise
                return
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                return
            except IsADirectoryError:
                raise NotFound("is a directory, not an object", tier=self.tier, key=key) from None
            finally:
                os.close(dfd)
            self._prune(self._key(key).rpartition("/")[0])

    def _prune(self, rel: str) -> None:
        """Remove directories left empty by deletes, from ``rel`` up to (not including)
        the root; each through its parent's descriptor, no link followed."""
        try:
            root = self._root_fd()
        except FileNotFoundError:
            return
        try:
            while rel:
                parent, _, name = rel.rpartition("/")
                try:
                    pfd = beneath.open_dir(root, parent)
                except OSError:
                    return
                try:
                    with contextlib.suppress(OSError):
                        cfd = os.open(name, beneath.DIR_FLAGS | os.O_NOFOLLOW, dir_fd=pfd)
                        try:
                            if os.listdir(cfd) == [_LOCK_NAME]:
                                os.unlink(_LOCK_NAME, dir_fd=cfd)
                        finally:
                            os.close(cfd)
                    try:
                        os.rmdir(name, dir_fd=pfd)
                    except OSError:
                        return
                finally:
                    os.close(pfd)
                rel = parent
        finally:
            os.close(root)

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

    # ---- POSIX-only extras ------------------------------------------------------------

    @property
    def local_root(self) -> str:
        return self.root

    async def cleanup_temp(self, older_than: float = 3600.0, under: str = "") -> int:
        """Remove temp files of crashed writers older than ``older_than`` seconds (walked
        from descriptors, no link followed)."""
        import time

        rel = self._prefix(under).rstrip("/")

        def do() -> int:
            n = 0
            cutoff = time.time() - older_than
            with self._translate(under or None):
                try:
                    root = self._root_fd()
                except FileNotFoundError:
                    return 0
                try:
                    top = beneath.open_dir(root, rel)
                except FileNotFoundError:
                    return 0
                except NotADirectoryError:
                    if self._link_on_path(rel):
                        raise
                    return 0
                finally:
                    os.close(root)
                try:
                    for _d, _dirs, files, dirfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
                        for f in files:
                            if not f.startswith(TMP_MARK):
                                continue
                            with contextlib.suppress(FileNotFoundError):
                                st = os.stat(f, dir_fd=dirfd, follow_symlinks=False)
                                if _stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                                    os.unlink(f, dir_fd=dirfd)
                                    n += 1
                finally:
                    os.close(top)
            return n

        return await runtime.to_io(do)


@functools.cache
def _libc() -> ctypes.CDLL:
    import ctypes  # only when a sync is due: not on every command's start-up

    libc = ctypes.CDLL(None, use_errno=True)
    with contextlib.suppress(AttributeError):
        libc.sync_file_range.argtypes = [
            ctypes.c_int,
            ctypes.c_longlong,
            ctypes.c_longlong,
            ctypes.c_uint,
        ]
    return libc


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``[offset, offset + length)`` of ``fd`` to disk without waiting
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the disk works while the copy goes on
    and the sync that ends it finds little left.  A hint: failures are ignored."""
    with contextlib.suppress(AttributeError):
        _libc().sync_file_range(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE


def _syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        libc = _libc()
        if libc.syncfs(fd) != 0:
            import ctypes

            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    except AttributeError:  # no syncfs in this libc
        os.sync()
    finally:
        os.close(fd)


#: Small writes without an fsync are done on the event loop on local file systems: a 4 KiB
#: file costs less to create there (tens of microseconds) than a trip through the I/O pool,
#: whose threads also contend with the loop for the GIL (10,000 files from S3: about 25%
#: less CPU).  Elsewhere (Lustre, NFS, FUSE: a network round trip per create) they go
#: through the pool so the loop never waits on them.
INLINE_PUT_BYTES = 64 << 10
_LOCAL_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "tmpfs", "ramfs"}


def fs_type(path: str) -> str | None:
    """The type of the file system ``path`` is on (``/proc/self/mountinfo``), or None."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best, kind = "", None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, right.split()[0]
    return kind


def pwrite_all(fd: int, data: Buffer | Pieces, offset: int) -> None:
    """Write a buffer or consecutive pieces at ``offset`` with as few ``pwritev`` calls as
    the kernel takes (short writes resumed where they stopped)."""
    views = [v for v in (memoryview(p).cast("B") for p in as_pieces(data)) if len(v)]
    while views:
        batch = views[:_IOV_MAX]
        n = os.pwritev(fd, batch, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        for i, v in enumerate(batch):
            if n < len(v):
                views = [v[n:], *views[i + 1 :]] if n else views[i:]
                break
            n -= len(v)
        else:
            views = views[len(batch) :]


def _copy_fd(src: int, dst: int) -> None:
    """Kernel-side copy (reflink / copy_file_range where the file system has them)."""
    size = os.fstat(src).st_size
    off = 0
    try:
        while off < size:
            n = os.copy_file_range(src, dst, min(size - off, 1 << 30), off, off)
            if n == 0:
                break
            off += n
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.lseek(dst, off, os.SEEK_SET)
        while off < size:
            buf = os.pread(src, BLOCK, off)
            if not buf:
                break
            os.write(dst, buf)
            off += len(buf)


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


def _check_utf8(rel: str, name: str, tier: str) -> None:
    """Keys are UTF-8 (S3's are): a name that is not cannot be staged or listed."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKey(
            f"{os.fsencode(rel + name)!r}: the file name is not valid UTF-8; rename it",
            tier=tier,
        ) from None


def _stamp(st: os.stat_result) -> str:
    return f"{st.st_size:x}-{st.st_mtime_ns // 1_000_000_000:x}"


#: The metadata xattr's encoding: keys sorted, built once (``json.dumps`` with options
#: builds an encoder per call).
_META_JSON = json.JSONEncoder(sort_keys=True)


def _read_meta(path: str | int, st: os.stat_result) -> dict[str, str]:
    """The metadata recorded with a file whose ``stat`` is ``st``; none when the file
    changed since it was recorded (see :data:`_STAMP`)."""
    try:
        raw = os.getxattr(path, _XATTR)
    except OSError:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    stamp = value.pop(_STAMP, None)
    if stamp is not None and stamp != _stamp(st):
        return {}
    return {str(k): str(v) for k, v in value.items()}


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
        self._done = False

    async def write(self, data: Buffer) -> None:
        if self._done:
            raise ValueError("writer is closed")
        view = memoryview(data).cast("B")

        def do() -> None:
            with self.store._translate(self.key):
                off = 0
                while off < len(view):
                    off += os.write(self.fd, view[off : off + BLOCK])

        await runtime.to_io(do)

    async def commit(self) -> ObjectMeta:
        if self._done:
            raise ValueError("writer is closed")
        self._done = True
        return await runtime.to_io(
            _commit_tmp, self.store, self.key, self.dfd, self.name, self.tmp, self.fd, self.options
        )

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        await runtime.to_io(_abort_tmp, self.dfd, self.tmp, self.fd)


def _commit_tmp(
    store: PosixStore, key: str, dfd: int, name: str, tmp: str, fd: int, options: PutOptions
) -> ObjectMeta:
    """Finish, close and publish a writer's temp file; the directory is closed after."""
    try:
        with store._translate(key):
            try:
                store._finish_fd(fd, options)
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
    """A part ``pwrite``-n at its offset as its bytes arrive.

    On a local file system, on the event loop while writes are quick: a 256 KiB write
    into the page cache takes tens of µs, less than handing it to a thread and back.  From
    the first write slower than :data:`SLOW_WRITE_S` (dirty-page throttling) on, and on
    Lustre, NFS or FUSE from the start, in the I/O pool.
    """

    def __init__(self, writer: _PosixPartWriter, index: int) -> None:
        self.w, self.index = writer, index
        self.start, self.end = part_bounds(index, writer.size, writer.part_size)
        self.pos = self.start
        self.inline = writer.store._inline_puts

    def write(self, data: memoryview) -> Awaitable[None] | None:
        n, off = data.nbytes, self.pos
        if off + n > self.end:
            raise ValueError(f"part {self.index} holds {self.end - self.start} bytes, no more")
        self.pos += n
        if not self.inline:
            return runtime.to_io(self._write, data, off)
        t0 = time.perf_counter()
        self._write(data, off)
        self.inline = time.perf_counter() - t0 < SLOW_WRITE_S
        return None

    def _write(self, data: memoryview, offset: int) -> None:
        try:  # one pwrite almost always: the general pwrite_all only for a short one
            n = os.pwrite(self.w.fd, data, offset)
            if n < data.nbytes:
                pwrite_all(self.w.fd, data[n:], offset + n)
        except OSError as e:
            raise self.w.store._error(e, self.w.key) from e

    async def close(self) -> None:
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
        merged = {**(self.options.metadata or {}), **(metadata or {})}
        options = replace(self.options, metadata=merged or None)
        return await runtime.to_io(
            _commit_tmp, self.store, self.key, self.dfd, self.name, self.tmp, self.fd, options
        )

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        await runtime.to_io(_abort_tmp, self.dfd, self.tmp, self.fd)
