"""POSIX attributes as object metadata, in FSx for Lustre's data-repository convention.

FSx for Lustre exports a file's ownership, permissions and times as S3 user metadata and
restores them on import; fmstore writes and reads the same keys, so data exported by one
is imported with its attributes by the other (within limits: metadata is written by whoever
may write to the bucket, so it never sets special mode bits, and sets ownership only when
the operator asks; see :func:`apply`):

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
import re
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


#: Mode bits metadata may set: permissions without setuid, setgid, sticky and write for
#: others.  fmstore often runs as root: a bucket anyone can write to must not be able to
#: plant a setuid-root or world-writable file on a shared tier.
MODE_MASK = 0o775
#: Latest time accepted (nanoseconds; about 2262, where a 64-bit count of nanoseconds ends:
#: ``utime`` takes no later one).  Earlier than the epoch is refused too.
MAX_TIME_NS = (1 << 63) - 1
_OCTAL = re.compile(r"0?[0-7]{1,7}")
_TIME = re.compile(r"([0-9]{1,20})(ns|\.[0-9]{1,9})?")
_ID = re.compile(r"[0-9]{1,10}")
#: uid/gid -1 means "leave as is" to chown; ids above are not ids.
_MAX_ID = (1 << 32) - 2


def parse_mode(text: str | None) -> int | None:
    """The permission bits ``text`` asks for, masked by :data:`MODE_MASK`; None when absent
    or malformed."""
    if not text or not _OCTAL.fullmatch(text.strip()):
        return None
    return _stat.S_IMODE(int(text, 8)) & MODE_MASK


def parse_time_ns(text: str | None) -> int | None:
    """``<n>ns`` is nanoseconds; a bare number is milliseconds, as FSx reads it.  None when
    absent, malformed, negative or past :data:`MAX_TIME_NS`."""
    if not text:
        return None
    m = _TIME.fullmatch(text.strip())
    if m is None:
        return None
    whole, tail = m.group(1), m.group(2) or ""
    if tail == "ns":
        ns = int(whole)
    else:  # milliseconds, with up to 9 decimals
        frac = tail[1:]
        ns = int(whole) * 1_000_000 + int((frac + "0" * 9)[:9]) // 1000
    return ns if ns <= MAX_TIME_NS else None


def parse_id(text: str | None) -> int | None:
    if text is None or not _ID.fullmatch(text.strip()):
        return None
    n = int(text)
    return n if n <= _MAX_ID else None


def apply(
    target: str | int,
    metadata: Mapping[str, str],
    *,
    times: bool = True,
    owner: bool = False,
) -> None:
    """Restore permissions (never special bits: see :data:`MODE_MASK`), times (unless
    ``times`` is false: see :func:`apply_times`) and, only with ``owner``, ownership on a
    local file (a path or an open descriptor); a no-op when ``metadata`` has none of the
    keys.  Malformed or absurd values are ignored.

    Ownership is the operator's opt-in (``--preserve-owner``, ``[stage] preserve_owner``):
    object metadata is written by whoever may write to the bucket.  Even then it changes
    only when the process may (root, or the owner already matches); a failed ``chown`` is
    not an error, like ``cp -p`` run by an ordinary user.
    """
    meta = pick(metadata)
    if not meta:
        return
    if owner:
        uid = parse_id(meta.get(OWNER))
        gid = parse_id(meta.get(GROUP))
        if uid is not None or gid is not None:
            with contextlib.suppress(OSError):
                os.chown(target, -1 if uid is None else uid, -1 if gid is None else gid)
    # After chown, which clears setuid/setgid bits: the mode is set last and holds none.
    mode = parse_mode(meta.get(PERMISSIONS))
    if mode is not None:
        os.chmod(target, mode)
    if times:
        apply_times(target, meta)


def apply_times(target: str | int, metadata: Mapping[str, str]) -> None:
    """Restore the access and modification times only (absurd ones are ignored)."""
    meta = pick(metadata)
    mtime = parse_time_ns(meta.get(MTIME))
    if mtime is not None:
        atime = parse_time_ns(meta.get(ATIME))
        with contextlib.suppress(OverflowError, OSError):  # beyond what the fs can hold
            os.utime(target, ns=(mtime if atime is None else atime, mtime))
