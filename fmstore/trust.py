"""Who may have written a file fmstore acts on: the one rule for configs, indexes, archives.

fmstore often runs as root on shared machines, so a file it finds by looking (a
``fmstore.toml`` above the working directory, a lazy-staging index, a ``.pt`` archive) is
trusted only when nobody but root and the caller could have written it:

* the file and every directory above it are owned by a *trusted uid*: root, the caller, or
  under ``sudo`` (the caller is root and ``$SUDO_UID`` is set) the user who ran ``sudo``
  (git's answer to CVE-2022-24765 compares with ``SUDO_UID`` the same way);
* none of them is writable by others, nor by its group unless the group is root's or the
  caller's own private group (the user-private-group convention: same name as the user,
  no other members);
* no POSIX ACL entry gives write to a user or group the two rules above would not trust
  (the mode's group bits show only the ACL's mask, so ``setfacl -m u:other:rw`` on a
  ``0660`` file of root's group would otherwise pass);
* one exception: a sticky directory (``/tmp``, a 1777 scratch directory) whose next
  directory down is owned by a trusted uid: nobody else can rename that one away.  The
  file's own directory gets no such exception (``/tmp/fmstore.toml`` is refused whoever
  owns it, ``/tmp/me/fmstore.toml`` owned by ``me`` passes).

Every check reads ``lstat``: a link is judged as the link, never as what it points at.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat as _stat
import struct

__all__ = [
    "trusted_uid",
    "why_rewritable",
    "why_untrusted",
    "why_untrusted_dir",
    "writable_by_others",
]


def trusted_uid(uid: int) -> bool:
    """Root, the caller, or (the caller being root) the user ``sudo`` ran for."""
    if uid == 0 or uid == os.geteuid():
        return True
    if os.geteuid() == 0:
        sudo = os.environ.get("SUDO_UID", "")
        return sudo.isdigit() and int(sudo) == uid
    return False


def _private_group(gid: int) -> bool:
    """Root's group, or the caller's own group under the user-private-group convention."""
    if gid == 0:
        return True
    if gid != os.getegid():
        return False
    try:
        g, u = grp.getgrgid(gid), pwd.getpwuid(os.geteuid())
    except KeyError:
        return False
    return not g.gr_mem and g.gr_name == u.pw_name


def writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & _stat.S_IWOTH) or (
        bool(st.st_mode & _stat.S_IWGRP) and not _private_group(st.st_gid)
    )


_ACL_XATTR = "system.posix_acl_access"
_ACL_HEAD, _ACL_ENTRY = struct.Struct("<I"), struct.Struct("<HHI")  # version; tag, perm, id
_ACL_USER, _ACL_GROUP, _ACL_MASK = 0x02, 0x08, 0x10


def _acl_writer(target: int | str) -> str | None:
    """Who besides the owner and the owning group may write ``target`` (a descriptor or
    a path, not followed) through a POSIX ACL entry the trust rule would not accept, or
    None.  A file system without ACLs has none."""
    try:
        if isinstance(target, int):
            raw = os.getxattr(target, _ACL_XATTR)
        else:
            raw = os.getxattr(target, _ACL_XATTR, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        return f"its ACL cannot be read ({e.strerror})"
    n = (len(raw) - _ACL_HEAD.size) // _ACL_ENTRY.size
    entries = [_ACL_ENTRY.unpack_from(raw, _ACL_HEAD.size + i * _ACL_ENTRY.size) for i in range(n)]
    mask = next((perm for tag, perm, _ in entries if tag == _ACL_MASK), 7)
    for tag, perm, who in entries:
        if not perm & mask & 0o2:
            continue
        if tag == _ACL_USER and not trusted_uid(who):
            return f"writable by uid {who} through its ACL"
        if tag == _ACL_GROUP and not _private_group(who):
            return f"writable by gid {who} through its ACL"
    return None


def _why_file(st: os.stat_result, target: int | str) -> str | None:
    """Why someone other than a trusted uid could write the file itself (``st``: its
    stat; ``target``: its descriptor or path, for the ACL), or None."""
    if not trusted_uid(st.st_uid):
        return f"owned by uid {st.st_uid}, neither root nor the caller"
    if _stat.S_ISLNK(st.st_mode):
        # A link's mode means nothing (nobody writes a link): who can replace it is its
        # owner and whoever can write its directory, checked next.  What it names is the
        # caller's to judge (the config lookup follows no link it finds by walking).
        return None
    if writable_by_others(st):
        return f"writable by others (mode {_stat.S_IMODE(st.st_mode):04o})"
    return _acl_writer(target)


def why_rewritable(fd: int) -> str | None:
    """Why the bytes of the open file ``fd`` could be rewritten in place by someone other
    than a trusted uid, or None.  Only the file counts: its directories decide what a name
    points at, not what an open descriptor reads."""
    return _why_file(os.fstat(fd), fd)


def why_untrusted_dir(path: str, st: os.stat_result, child: os.stat_result | None) -> str | None:
    """Why someone other than a trusted uid could change directory ``path`` (its
    ``lstat``), or None; ``child``: the next directory down on the path, None when ``path``
    is the directory of the file itself."""
    what = "directory" if child is not None else "its directory"
    if not trusted_uid(st.st_uid):
        return f"{what} {path} is owned by uid {st.st_uid}"
    mode = _stat.S_IMODE(st.st_mode)
    why = f"writable by others (mode {mode:04o})" if writable_by_others(st) else _acl_writer(path)
    if why is None:
        return None
    if st.st_mode & _stat.S_ISVTX and child is not None and trusted_uid(child.st_uid):
        return None  # nobody else can rename the directory below
    return f"{what} {path} is {why}"


def why_untrusted(path: str, st: os.stat_result | None = None) -> str | None:
    """Why the file at absolute ``path`` (``st``: its ``lstat``, read when not given) or a
    directory above it could have been written by someone other than a trusted uid, or
    None when it could not."""
    if st is None:
        st = os.lstat(path)
    why = _why_file(st, path)
    if why is not None:
        return why
    d, child = os.path.dirname(path), None
    while True:
        here = os.lstat(d)
        why = why_untrusted_dir(d, here, child)
        if why is not None:
            return why
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d, child = parent, here
