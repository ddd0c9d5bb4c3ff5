"""The operating system's side of the POSIX backend: what ``os`` does not wrap, or not
in one call.

Atomic publication (:func:`commit_file`, :func:`commit_at`: rename or link, then the
directory fsync), ``O_DIRECT`` writes from aligned buffers, vectored writes resumed after
short ones (:func:`pwrite_all`), kernel-side copies, ``syncfs`` and ``sync_file_range``
through libc, the file system type of a path, and the metadata xattr fmstore keeps with
each file it writes.  Nothing here knows about keys, tiers or stores.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import mmap
import os
import re
import stat as _stat
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .. import runtime
from ..buffers import huge_buffer
from .base import Buffer, Pieces, views_of

if TYPE_CHECKING:
    import ctypes

_XATTR = "user.fmstore.meta"
#: Recorded in the metadata xattr: the file's size and modification time (whole seconds,
#: as Lustre keeps them) when fmstore wrote it.  A file changed since (written in place,
#: truncated) no longer matches, and the metadata recorded with it (its checksum, the
#: source's version) no longer describes it: it then reads as having none, so the file is
#: copied again rather than skipped, and its checksum is computed rather than trusted.
_STAMP = "fmstore-written"
_ALIGN = 4096
#: Block size for large sequential reads and ``O_DIRECT`` writes.
BLOCK = 16 << 20
#: The most one write into the page cache asks for.  The kernel sizes the folios a write
#: allocates by its length, and from 2 MiB on takes whole 2 MiB blocks of free memory:
#: on a VM whose host takes free memory back in such blocks (virtio-balloon free page
#: reporting), every one is faulted in again at the host.  640 MiB written in 16 MiB
#: writes took 0.7-1.6 s of system CPU here, in 1 MiB writes 0.13 s.
CACHE_WRITE = 1 << 20
#: A durable write of a large file keeps at most two windows of this size of it in the page
#: cache (:func:`pwrite_behind`).
WRITE_BEHIND = 16 << 20
#: Most buffers one ``pwritev`` takes.
_IOV_MAX = os.sysconf("SC_IOV_MAX")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(path: str, *, dir_fd: int | None = None) -> int:
    """The bytes of the files under directory ``path`` (relative to ``dir_fd`` when given;
    0 where there is none), walked from descriptors: a link below is counted as itself,
    never followed, and ``path`` itself being a link raises ``OSError(ELOOP)``."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return 0
    except NotADirectoryError:  # a file, or a link (O_NOFOLLOW with O_DIRECTORY)
        if _stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise OSError(errno.ELOOP, "a symbolic link, not followed", path) from None
        return 0
    total = 0
    try:
        for _d, _dirs, files, dfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
            for f in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(f, dir_fd=dfd, follow_symlinks=False).st_size
    finally:
        os.close(top)
    return total


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


def _write_direct(fd: int, dfd: int, tmp: str, data: memoryview) -> None:
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


@functools.cache
def _has_write_behind() -> bool:
    return hasattr(os, "posix_fadvise") and hasattr(_libc(), "sync_file_range")


def _drop_behind(fd: int, offset: int, length: int) -> None:
    """Wait until ``[offset, offset + length)`` of ``fd`` is on disk, then drop it from
    the page cache.  A write error is raised here: the wait consumes it, so the file's
    final sync would not see it."""
    import ctypes

    # SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER
    if _libc().sync_file_range(fd, offset, length, 7) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def pwrite_behind(
    fd: int, data: Buffer | Pieces, offset: int, started: list[tuple[int, int]] | None = None
) -> bool:
    """:func:`pwrite_all` for a file that is synced when written: in windows of
    :data:`WRITE_BEHIND` bytes, each window's write-back starts as soon as it is written,
    and the window before it is waited for and dropped from the page cache.  ``started``
    carries the window whose write-back was started and not yet dropped from one call to
    the next (a writer's).  True when it wrote so (the caller then drops what is left with
    :func:`drop_cached` once the file is synced).  Data under two windows (one, for a
    writer's call) is written plainly, as is what is left after the last whole window.

    A large write otherwise fills the page cache with the whole file before the sync
    writes it out.  Here it recycles the memory of two windows: fresh memory costs a page
    fault per page (on a VM whose host takes free memory back, a fault at the host too:
    4 GiB written here took 7.7 s plainly, 2.45 s like this, 2.4 s with ``O_DIRECT``),
    and the disk is kept busy during the write instead of after it.  The file is not
    left in the cache: a checkpoint is rarely read back soon, and then at the disk's speed.
    """
    views = views_of(data)
    least = 2 * WRITE_BEHIND if started is None else WRITE_BEHIND
    if sum(v.nbytes for v in views) < least or not _has_write_behind():
        pwrite_all(fd, views, offset)
        return False
    started = [] if started is None else started
    window: list[memoryview] = []
    filled = 0
    for v in views:
        while v.nbytes:
            piece = v[: WRITE_BEHIND - filled]
            window.append(piece)
            filled += piece.nbytes
            v = v[piece.nbytes :]
            if filled == WRITE_BEHIND:
                pwrite_all(fd, window, offset)
                _start_writeback(fd, offset, filled)
                started.append((offset, filled))
                while len(started) > 1:
                    _drop_behind(fd, *started.pop(0))
                offset += filled
                window, filled = [], 0
    if window:
        pwrite_all(fd, window, offset)
    return True


#: A part streamed into a file on a local disk is received into a page-aligned ring of
#: this size and written from it with ``O_DIRECT`` (:class:`DirectWrites`).
DIRECT_RING = 1 << 20
#: Rings are cut from blocks of memory this big, in huge pages (a fault per 2 MiB).
_RING_BLOCK = 16 << 20
#: Rings kept for the next parts, at most (the rest go with their block).
_RINGS_KEPT = 64
_rings: list[memoryview] = []


def take_ring() -> memoryview:
    """A page-aligned :data:`DIRECT_RING` buffer, reused when one is spare: fresh memory
    costs a fault per page."""
    if not _rings:
        block = memoryview(huge_buffer(_RING_BLOCK))
        _rings.extend(block[i : i + DIRECT_RING] for i in range(0, _RING_BLOCK, DIRECT_RING))
    return _rings.pop()


def give_ring(ring: memoryview) -> None:
    """Hand back a ring from :func:`take_ring` nothing reads or writes any more."""
    if len(_rings) < _RINGS_KEPT:
        _rings.append(ring)


def _address(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class DirectWrites:
    """``O_DIRECT`` writes to the file open as ``fd`` (reopened once, through
    ``/proc/self/fd``: the same file whatever its name meanwhile), for bytes received
    straight into a ring of :func:`take_ring`: they go from there to the disk, with no
    copy into the page cache.  Fresh memory costs a page fault per page (on a VM whose
    host takes free memory back, a fault at the host too): 3 × 300 MiB downloaded into
    the page cache of such memory took 2.5 s here, written from reused rings 0.95 s.
    Where the file system refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some FUSE), or a
    write is not aligned, the bytes go through the page cache as usual."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.direct: int | None = None
        flags = os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC
        with contextlib.suppress(OSError):
            self.direct = os.open(f"/proc/self/fd/{fd}", flags)
        # Cleared when a write is refused: kept open until close() (other parts' writes
        # may be under way with it).
        self.ok = self.direct is not None

    def fits(self, view: memoryview, offset: int, ring: memoryview) -> bool:
        """Whether ``view`` (written at ``offset``) goes straight to disk: a whole number
        of pages from the start of ``ring``, to a page boundary of the file."""
        return (
            self.ok
            and offset % _ALIGN == 0
            and view.nbytes >= _ALIGN
            and view.obj is ring.obj
            and _address(view) == _address(ring)
        )

    def write(self, view: memoryview, offset: int) -> None:
        """Write ``view`` at ``offset`` (see :meth:`fits`): its whole pages with
        ``O_DIRECT``, what is left of the last through the page cache."""
        bulk = view.nbytes - view.nbytes % _ALIGN
        done = 0
        if self.ok and self.direct is not None:
            try:
                while done < bulk:
                    n = os.pwrite(self.direct, view[done:bulk], offset + done)
                    if n <= 0 or n % _ALIGN:
                        done += max(n, 0)
                        break
                    done += n
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.ok = False  # refused after all: the page cache from now on
        if done < view.nbytes:
            pwrite_all(self.fd, view[done:], offset + done)

    def close(self) -> None:
        """Once no write is under way."""
        self.ok = False
        if self.direct is not None:
            os.close(self.direct)
            self.direct = None


def drop_cached(fd: int) -> None:
    """Drop ``fd``'s clean pages from the page cache (a hint: failures are ignored)."""
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


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


#: File systems on this machine's own disks or memory (not Lustre, NFS or FUSE).
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


#: A write slower than this (dirty-page throttling) sends a file's later writes to the I/O pool.
SLOW_WRITE_S = 0.02
#: So do writes slower together than this, over :data:`WRITE_WINDOW` of them: the page
#: cache filling at a fraction of its usual 5 GB/s.  On a VM whose host took free memory
#: back, each new page is faulted in at the host, and one thread faulting alone is the
#: copy's bottleneck (40 × 16 MiB from S3: 2.1 s inline, 1.7 s with the pool's threads
#: writing at once; no change where memory is warm).
SLOW_WRITE_RATE = 1e9
WRITE_WINDOW = 16


class QuickWrites:
    """``write(data, offset)`` on the event loop while writes are quick: a 256 KiB write
    into the page cache takes tens of µs, less than handing it to a thread and back.  From
    the first write slower than :data:`SLOW_WRITE_S` on, or the first :data:`WRITE_WINDOW`
    writes slower together than :data:`SLOW_WRITE_RATE`, or from the start with
    ``inline=False`` (Lustre, NFS, FUSE), in the I/O pool: then an awaitable is returned,
    and ``data`` must stay valid until it is done."""

    def __init__(self, write: Callable[[memoryview, int], None], inline: bool = True) -> None:
        self._write, self.inline = write, inline
        self._count, self._bytes, self._seconds = 0, 0, 0.0  # the current window

    def __call__(self, data: memoryview, offset: int) -> Awaitable[None] | None:
        if not self.inline:
            return runtime.to_io(self._write, data, offset)
        t0 = time.perf_counter()
        self._write(data, offset)
        dt = time.perf_counter() - t0
        self._count += 1
        self._bytes += data.nbytes
        self._seconds += dt
        slow = dt >= SLOW_WRITE_S
        if self._count == WRITE_WINDOW:
            slow = slow or self._bytes < self._seconds * SLOW_WRITE_RATE
            self._count, self._bytes, self._seconds = 0, 0, 0.0
        self.inline = not slow
        return None


def pwrite_all(fd: int, data: Buffer | Pieces, offset: int) -> None:
    """Write a buffer or consecutive pieces at ``offset``, at most :data:`CACHE_WRITE`
    bytes per call (``pwritev`` of pieces up to that), short writes resumed where they
    stopped."""
    if isinstance(data, memoryview) and data.nbytes <= CACHE_WRITE:  # a streamed write
        n = os.pwrite(fd, data, offset)
        if n == data.nbytes:
            return
        data, offset = data.cast("B")[n:], offset + n
    views = [
        v[i : i + CACHE_WRITE] for v in views_of(data) for i in range(0, v.nbytes, CACHE_WRITE)
    ]
    k = 0
    while k < len(views):
        batch, total = [views[k]], views[k].nbytes
        for v in views[k + 1 : k + _IOV_MAX]:
            if total + v.nbytes > CACHE_WRITE:
                break
            batch.append(v)
            total += v.nbytes
        n = os.pwritev(fd, batch, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while n and n >= views[k].nbytes:
            n -= views[k].nbytes
            k += 1
        if n:
            views[k] = views[k][n:]


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
        while off < size:
            buf = os.pread(src, BLOCK, off)
            if not buf:
                break
            pwrite_all(dst, memoryview(buf), off)
            off += len(buf)


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
