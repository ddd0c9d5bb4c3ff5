"""Opening paths beneath a directory without following any symbolic link.

A POSIX tier is often shared: other users can plant ``TIER/link -> /etc`` and wait for
fmstore, running as root, to write, read or delete ``link/...``.  Every key's path is
therefore resolved from a descriptor of the tier's root, one component at a time by the
kernel, and a symbolic link anywhere in it fails the call with ``ELOOP`` (callers turn that
into :class:`~fmstore.errors.PermissionDenied`).  Checking a path first and using it after
would leave a window in which a directory is swapped for a link; resolving from
descriptors leaves none.

With ``openat2(2)`` (Linux 5.6+) one system call resolves the whole path
(``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS``); elsewhere each
directory is opened with ``O_DIRECTORY | O_NOFOLLOW`` relative to the one before, and the
last component with ``O_NOFOLLOW``.  Both refuse ``..``; keys never hold one anyway.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections.abc import Callable

from ..errors import PermissionDenied
from ..trust import trusted_uid, writable_by_others

_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
#: openat2's number: the same on every architecture (added after the tables were unified).
_SYS_OPENAT2 = 437

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@functools.cache
def _openat2() -> Callable[[int, bytes, int, int], int] | None:
    """``openat2`` as a function (dir_fd, path, flags, mode) -> fd, or None where the
    kernel (or a seccomp filter: ENOSYS, EPERM) does not have it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long

    class OpenHow(ctypes.Structure):
        _fields_ = [
            ("flags", ctypes.c_uint64),
            ("mode", ctypes.c_uint64),
            ("resolve", ctypes.c_uint64),
        ]

    size = ctypes.sizeof(OpenHow)

    def openat2(dir_fd: int, path: bytes, flags: int, mode: int) -> int:
        how = OpenHow(flags, mode if flags & os.O_CREAT else 0, _RESOLVE)
        fd = syscall(_SYS_OPENAT2, dir_fd, path, ctypes.byref(how), size)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), os.fsdecode(path))
        return int(fd)

    try:  # probe: "." beneath the working directory always resolves
        os.close(openat2(-100, b".", DIR_FLAGS, 0))  # AT_FDCWD
    except OSError:
        return None
    return openat2


def open_beneath(dir_fd: int, rel: str, flags: int, mode: int = 0o644) -> int:
    """Open ``rel`` (components separated by ``/``, none of them ``..``, empty for the
    directory itself) beneath ``dir_fd`` with ``flags``; a symbolic link in any component,
    the last included, raises ``OSError(ELOOP)`` (or ``ENOTDIR`` for a directory)."""
    if not rel:
        return os.open(".", flags, mode, dir_fd=dir_fd)
    fast = _openat2()
    if fast is not None:
        return fast(dir_fd, os.fsencode(rel), flags | os.O_CLOEXEC, mode)
    parts = rel.split("/")
    fd = dir_fd
    try:
        for name in parts[:-1]:
            nxt = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def open_dir(dir_fd: int, rel: str) -> int:
    """A directory beneath ``dir_fd`` (see :func:`open_beneath`)."""
    return open_beneath(dir_fd, rel, DIR_FLAGS | os.O_NOFOLLOW)


def make_dirs(dir_fd: int, rel: str, on_new: Callable[[int, str], None] | None = None) -> int:
    """Open directory ``rel`` beneath ``dir_fd``, creating missing ones on the way (mode
    0777 less the umask); ``on_new(parent_fd, name)`` runs after each one created.  A
    symbolic link on the way raises ``ELOOP`` / ``ENOTDIR`` as in :func:`open_beneath`."""
    with contextlib.suppress(FileNotFoundError):
        return open_dir(dir_fd, rel)
    fd = os.dup(dir_fd)
    try:
        for name in rel.split("/") if rel else []:
            try:
                nxt = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                try:
                    os.mkdir(name, dir_fd=fd)
                except FileExistsError:
                    pass
                else:
                    if on_new is not None:
                        on_new(fd, name)
                nxt = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def is_link_error(e: OSError) -> bool:
    """Whether ``e`` is what a symbolic link in the way gives (``ENOTDIR`` is ambiguous:
    also a file where a directory was expected)."""
    return e.errno == errno.ELOOP


def shared_dir(dir_fd: int, name: str, *, tier: str, create: bool, mode: int = 0o755) -> int | None:
    """Directory ``name`` directly beneath ``dir_fd`` (a tier's root) that holds what every
    user of the tier puts there (``.replicas``, ``.aside``), open; None when it is not there
    and not ``create``.

    Made with ``mode`` less the umask and, when the caller is root, given to the tier
    root's owner.  One that exists is used only when owned by root, the caller (or
    ``sudo``'s user) or the tier root's owner, and not writable by others: whoever else
    made it first could rename, plant or remove what every user puts there.  A link, a
    file, or a directory of someone else's raises :class:`~fmstore.errors.PermissionDenied`."""
    made = False
    try:
        try:
            fd = open_dir(dir_fd, name)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(name, mode, dir_fd=dir_fd)
                made = True
                os.fsync(dir_fd)
            except FileExistsError:
                pass
            fd = open_dir(dir_fd, name)
    except OSError as e:
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        raise PermissionDenied(
            "a symbolic link or a file where a directory should be: links inside a tier "
            "are not followed",
            tier=tier,
            key=name,
        ) from None
    try:
        st, top = os.fstat(fd), os.fstat(dir_fd)
        # Only a directory this call made, still root's, is given away: one swapped in
        # between the mkdir and the open keeps its owner, and is judged by it below.
        if made and os.geteuid() == 0 and st.st_uid == 0 and top.st_uid != 0:
            os.fchown(fd, top.st_uid, top.st_gid)
            st = os.fstat(fd)
        if not (trusted_uid(st.st_uid) or st.st_uid == top.st_uid):
            why = f"owned by uid {st.st_uid}, neither root, the caller nor the tier's owner"
        elif writable_by_others(st):
            why = f"writable by others (mode {st.st_mode & 0o7777:04o})"
        else:
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    raise PermissionDenied(
        f"{why}: someone else could change what it holds; remove it or fix its owner and mode",
        tier=tier,
        key=name,
    )
