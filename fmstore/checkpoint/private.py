"""Reading a file whose bytes someone else could rewrite: a private copy first.

An open descriptor stops a rename, not a rewrite in place: the owner of a file (or anyone
its mode or ACL lets write) can change its bytes between a check and the read that trusts
the check, or truncate it under a memory map (``SIGBUS``, no Python exception).  So a file
that someone other than a trusted uid could rewrite (:func:`fmstore.trust.why_rewritable`:
owner not root, the caller or ``$SUDO_UID``, or writable by others) is copied once, through
its descriptor, into a file only this process holds, and everything after (the zip guard,
the safetensors header check, ``torch.load`` with ``mmap=True``, safetensors' map) reads
the copy:

* below :data:`MEMORY_BELOW` bytes into memory (a ``memfd``);
* else into an unlinked ``O_TMPFILE`` (mode 0600) in the config's ``state_dir``, when its
  file system has the room;
* never above ``[checkpoint] private_copy_limit`` (default :data:`DEFAULT_LIMIT`):
  :class:`~fmstore.errors.PermissionDenied` saying how to trust the file instead.

A trusted file is read in place, never copied: a 140 GB ``.pt`` of one's own costs no copy.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator

from ..config import Config, get_config
from ..errors import ConfigError, CorruptData, PermissionDenied, TierFull
from ..trust import why_rewritable
from ..units import human_bytes

__all__ = [
    "DEFAULT_LIMIT",
    "HOW_TO_TRUST",
    "MEMORY_BELOW",
    "check_copy_size",
    "copy_limit",
    "stable_fd",
]

#: Copies smaller than this are held in memory.
MEMORY_BELOW = 256 << 20
#: ``[checkpoint] private_copy_limit`` when the config does not set it.
DEFAULT_LIMIT = 64 << 30
_CHUNK = 64 << 20


def copy_limit(config: Config | None = None) -> int:
    """``[checkpoint] private_copy_limit``: the most bytes fmstore copies of a file before
    reading it (a file someone else could rewrite, a download)."""
    raw, w = (config or get_config()).table("checkpoint")
    value = raw.get("private_copy_limit", DEFAULT_LIMIT)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{w} private_copy_limit must be a size in bytes, not {value!r}")
    return value


#: How to get a file read without a copy, for the refusals.
HOW_TO_TRUST = (
    "make it trusted (owned by root or you: chown it; not writable by others: chmod go-w, "
    "no ACL entry giving write), or copy it yourself and load the copy"
)


def check_copy_size(size: int, name: str, into: str | None, why: str, advice: str) -> None:
    """Refuse to copy ``size`` bytes of ``name`` when that is more than ``[checkpoint]
    private_copy_limit`` (:class:`PermissionDenied`) or, ``into`` being a directory, than
    the free space there (:class:`TierFull`); ``why``: why it is copied, ``advice``: what
    to do instead, for the message."""
    limit = copy_limit()
    head = f"{name} {why}, so it is copied before it is read, and its {human_bytes(size)}"
    if size > limit:
        raise PermissionDenied(
            f"{head} are more than [checkpoint] private_copy_limit "
            f"({human_bytes(limit)}): {advice}, or raise the limit"
        )
    free = _free(into) if into is not None else size
    if size > free:
        raise TierFull(f"{head} do not fit in {into} ({human_bytes(free)} free): {advice}")


def _free(d: str) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def stable_fd(fd: int, name: str) -> Iterator[int]:
    """A descriptor reading what ``fd`` (a regular file open for reading) holds, whose
    bytes nobody but a trusted uid can change: ``fd`` itself when only trusted uids can
    write the file, else a private copy (see the module's docstring), closed on exit
    (a memory map of it stays valid)."""
    why = why_rewritable(fd)
    if why is None:
        yield fd
        return
    size = os.fstat(fd).st_size
    if size < MEMORY_BELOW:
        check_copy_size(size, name, None, f"is {why}", HOW_TO_TRUST)
        copy = os.memfd_create("fmstore-private", os.MFD_CLOEXEC)
    else:
        state_dir = get_config().state_dir
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        check_copy_size(size, name, state_dir, f"is {why}", HOW_TO_TRUST)
        copy = _unlinked_file(state_dir)
    try:
        os.fchmod(copy, 0o600)  # a memfd is created 0777, though only this process holds it
        _copy(fd, copy, size, name)
        yield copy
    finally:
        os.close(copy)


def _unlinked_file(d: str) -> int:
    """A new file in ``d`` with no name (``O_TMPFILE``; where the file system has none, a
    0600 file unlinked at once), open for reading and writing."""
    try:
        return os.open(d, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    fd, path = tempfile.mkstemp(dir=d, prefix=".fmstore-private.")
    os.unlink(path)
    return fd


def _copy(src: int, dst: int, size: int, name: str) -> None:
    """``size`` bytes of ``src`` into ``dst``, through the descriptor (no memory map of
    ``src``: a truncation mid-copy is a short read, not ``SIGBUS``); a file that changed
    size meanwhile is refused, since the copy would be of no one version."""
    done = 0
    try:
        while done < size:
            try:
                n = os.sendfile(dst, src, done, min(size - done, 1 << 30))
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                n = os.write(dst, os.pread(src, min(size - done, _CHUNK), done))
            if n == 0:
                break
            done += n
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise TierFull(f"no space left to copy {name} before reading it") from None
        raise
    if done != size or os.pread(src, 1, size):
        raise CorruptData(f"{name} changed size while it was being copied to be read")
    os.lseek(dst, 0, os.SEEK_SET)
