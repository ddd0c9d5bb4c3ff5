"""POSIX attributes as object metadata, in FSx for Lustre's data-repository convention.

FSx for Lustre exports a file's ownership, permissions and times as S3 user metadata and
restores them on import; fmstore writes and reads the same keys, so data exported by one
is imported with its attributes by the other:

``x-amz-meta-file-permissions``  ``<octal file type><octal permission mask>``, as ``st_mode``
                                 in stat(2), e.g. ``0100644`` (setuid/setgid bits dropped)
``x-amz-meta-file-owner``        the owner's UID, an integer
``x-amz-meta-file-group``        the group's GID, an integer
``x-amz-meta-file-atime``        last access time in nanoseconds since the epoch, suffixed
                                 ``ns``, e.g. ``1700000000123456789ns`` (without the suffix
                                 FSx reads the number as milliseconds, and so does fmstore)
``x-amz-meta-file-mtime``        modification time, the same way

(Store metadata keys are given without the ``x-amz-meta-`` prefix; the S3 backend adds it.)
A POSIX tier applies these keys to the file it writes, so a file copied from S3 appears
under its final name with its owner, mode and times already set.
"""

from __future__ import annotations

import contextlib
import os
import stat as _stat
from collections.abc import Mapping

PERMISSIONS = "file-permissions"
OWNER = "file-owner"
GROUP = "file-group"
ATIME = "file-atime"
MTIME = "file-mtime"
KEYS = (PERMISSIONS, OWNER, GROUP, ATIME, MTIME)


def from_stat(st: os.stat_result) -> dict[str, str]:
    """The FSx metadata of a file."""
    mode = st.st_mode & ~(_stat.S_ISUID | _stat.S_ISGID)
    return {
        PERMISSIONS: f"0{mode:o}",
        OWNER: str(st.st_uid),
        GROUP: str(st.st_gid),
        ATIME: f"{st.st_atime_ns}ns",
        MTIME: f"{st.st_mtime_ns}ns",
    }


def pick(metadata: Mapping[str, str]) -> dict[str, str]:
    """The FSx keys present in ``metadata`` (S3 returns user metadata keys lower-cased)."""
    lower = {k.lower(): v for k, v in metadata.items()}
    return {k: lower[k] for k in KEYS if k in lower}


def parse_mode(text: str | None) -> int | None:
    if not text:
        return None
    try:
        return _stat.S_IMODE(int(text, 8))
    except ValueError:
        return None


def parse_time_ns(text: str | None) -> int | None:
    """``<n>ns`` is nanoseconds; a bare number is milliseconds, as FSx reads it."""
    if not text:
        return None
    import decimal  # rare: FSx's metadata only

    t = text.strip()
    try:
        if t.endswith("ns"):
            return int(t[:-2])
        return int(decimal.Decimal(t) * 1_000_000)
    except (ValueError, decimal.InvalidOperation):
        return None


def apply(target: str | int, metadata: Mapping[str, str], *, times: bool = True) -> None:
    """Restore permissions, times (unless ``times`` is false: see :func:`apply_times`) and
    (when allowed) ownership on a local file (a path or an open descriptor); a no-op when
    ``metadata`` has none of the keys.

    Ownership is changed only when the process may (root, or the owner already matches);
    a failed ``chown`` is not an error, like ``cp -p`` run by an ordinary user.
    """
    meta = pick(metadata)
    if not meta:
        return
    mode = parse_mode(meta.get(PERMISSIONS))
    if mode is not None:
        os.chmod(target, mode)
    uid = _int(meta.get(OWNER))
    gid = _int(meta.get(GROUP))
    if uid is not None or gid is not None:
        with contextlib.suppress(PermissionError, OSError):
            os.chown(target, -1 if uid is None else uid, -1 if gid is None else gid)
    if times:
        apply_times(target, meta)


def apply_times(target: str | int, metadata: Mapping[str, str]) -> None:
    """Restore the access and modification times only."""
    meta = pick(metadata)
    mtime = parse_time_ns(meta.get(MTIME))
    if mtime is not None:
        atime = parse_time_ns(meta.get(ATIME))
        os.utime(target, ns=(mtime if atime is None else atime, mtime))


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
