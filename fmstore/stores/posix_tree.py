"""The POSIX backend's directory tree: the root, paths resolved beneath it, listings,
deletes and the temp files of crashed writers.

:class:`PosixTree` is the half of :class:`~fmstore.stores.posix.PosixStore` that knows
where things are; the store adds what is read and written there.  OS errors are
translated to fmstore's here, at the edge (:meth:`PosixTree._translate`).

Every path is resolved from a descriptor of the root opened for the call, with no
symbolic link followed (:mod:`.beneath`): a link inside the tier refuses the call
(``PermissionDenied``) and listings skip links.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import stat as _stat
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from .. import runtime
from ..errors import (
    AlreadyExists,
    FmstoreError,
    InvalidKey,
    NotFound,
    PermissionDenied,
    StoreUnavailable,
    TierFull,
)
from . import beneath
from .base import Leftover, ObjectMeta, Store
from .posix_io import _LOCAL_FS, fs_type, fsync_dir
from .types import TMP_MARK

_LOCK_NAME = ".fmstore-lock"


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


class PosixTree(Store):
    """A directory tree as the namespace of a store: key ``a/b`` is file ``ROOT/a/b``."""

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

    # ---- POSIX-only extras ------------------------------------------------------------

    @property
    def local_root(self) -> str:
        return self.root

    async def leftovers(self, under: str = "") -> builtins.list[Leftover]:
        """The temp files of writers that died, below ``under`` (walked from descriptors,
        no link followed)."""
        rel = self._prefix(under).rstrip("/")

        def do() -> builtins.list[Leftover]:
            out: builtins.list[Leftover] = []
            now = time.time()
            with self._translate(under or None):
                top = self._open_under(rel)
                if top is None:
                    return out
                try:
                    for d, _dirs, files, dirfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
                        here = os.path.normpath(os.path.join(rel, d))
                        here = "" if here == "." else here
                        for f in files:
                            if not f.startswith(TMP_MARK):
                                continue
                            with contextlib.suppress(FileNotFoundError):
                                st = os.stat(f, dir_fd=dirfd, follow_symlinks=False)
                                if _stat.S_ISREG(st.st_mode):
                                    key = f"{here}/{f}" if here else f
                                    idle = max(0.0, now - st.st_mtime)
                                    out.append(Leftover("temp", key, st.st_size, idle))
                finally:
                    os.close(top)
            return out

        return await runtime.to_io(do)

    def _open_under(self, rel: str) -> int | None:
        """A descriptor of directory ``rel`` beneath the root, None when it is not there."""
        try:
            root = self._root_fd()
        except FileNotFoundError:
            return None
        try:
            return beneath.open_dir(root, rel)
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            if self._link_on_path(rel):
                raise
            return None
        finally:
            os.close(root)

    async def remove_leftover(self, item: Leftover) -> None:
        parent, _, name = item.key.rpartition("/")
        if item.kind != "temp" or not name.startswith(TMP_MARK):
            raise ValueError(f"not a temp file of this store: {item.key!r}")

        def do() -> None:
            with self._translate(item.key):
                dfd = self._open_under(parent)
                if dfd is None:
                    return
                try:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dfd)
                finally:
                    os.close(dfd)
            # As a delete does: the directories it leaves empty (a killed save's
            # generation, which held only this temp file) go too.
            self._prune(parent)

        await runtime.to_io(do)


def _check_utf8(rel: str, name: str, tier: str) -> None:
    """Keys are UTF-8 (S3's are): a name that is not cannot be staged or listed."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKey(
            f"{os.fsencode(rel + name)!r}: the file name is not valid UTF-8; rename it",
            tier=tier,
        ) from None
