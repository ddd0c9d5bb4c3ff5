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
* one exception: a sticky directory (``/tmp``, a 1777 scratch directory) whose next
  directory down is owned by a trusted uid: nobody else can rename that one away.  The
  file's own directory gets no such exception (``/tmp/fmstore.toml`` is refused whoever
  owns it, ``/tmp/me/fmstore.toml`` owned by ``me`` passes).

Every check reads ``lstat``: a link is judged as the link, never as what it points at.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat as _stat

__all__ = ["trusted_uid", "why_untrusted", "why_untrusted_dir", "writable_by_others"]


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


def why_untrusted_dir(path: str, st: os.stat_result, child: os.stat_result | None) -> str | None:
    """Why someone other than a trusted uid could change directory ``path`` (its
    ``lstat``), or None; ``child``: the next directory down on the path, None when ``path``
    is the directory of the file itself."""
    what = "directory" if child is not None else "its directory"
    if not trusted_uid(st.st_uid):
        return f"{what} {path} is owned by uid {st.st_uid}"
    if writable_by_others(st):
        sticky = bool(st.st_mode & _stat.S_ISVTX)
        if sticky and child is not None and trusted_uid(child.st_uid):
            return None  # nobody else can rename the directory below
        return f"{what} {path} is writable by others (mode {_stat.S_IMODE(st.st_mode):04o})"
    return None


def why_untrusted(path: str, st: os.stat_result | None = None) -> str | None:
    """Why the file at absolute ``path`` (``st``: its ``lstat``, read when not given) or a
    directory above it could have been written by someone other than a trusted uid, or
    None when it could not."""
    if st is None:
        st = os.lstat(path)
    if not trusted_uid(st.st_uid):
        return f"owned by uid {st.st_uid}, neither root nor the caller"
    # A link's mode means nothing (nobody writes a link): who can replace it is its owner
    # and whoever can write its directory, checked next.  What it names is the caller's
    # to judge (the config lookup follows no link it finds by walking).
    if not _stat.S_ISLNK(st.st_mode) and writable_by_others(st):
        return f"writable by others (mode {_stat.S_IMODE(st.st_mode):04o})"
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
