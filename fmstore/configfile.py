"""Which ``fmstore.toml`` is in effect, and whether a file found by looking may be trusted.

The lookup order and the walk's stops are in :func:`locate`; the trust rule is
:mod:`fmstore.trust`'s (docs/security.md, "A config found by looking").  This module reads
files and directories only: parsing and validating the chosen file is :mod:`fmstore.config`'s.
"""

from __future__ import annotations

import os
import shlex
import stat as _stat
from pathlib import Path

import tomllib

from .errors import ConfigError
from .trust import why_untrusted

__all__ = [
    "CEILING_ENV",
    "CONFIG_NAME",
    "ENV_NAMED",
    "FOUND_ABOVE",
    "FOUND_HERE",
    "NAMED",
    "NAMED_BY",
    "NO_FILE",
    "SYSTEM_CONFIG",
    "USER_CONFIG",
    "existing",
    "locate",
]

CONFIG_NAME = "fmstore.toml"
USER_CONFIG = "~/.config/fmstore/fmstore.toml"
#: The system-wide file, after the user's (a module constant: tests point it elsewhere).
SYSTEM_CONFIG = "/etc/fmstore/fmstore.toml"
#: Colon-separated absolute directories the walk up from the working directory never
#: enters (as ``GIT_CEILING_DIRECTORIES``).
CEILING_ENV = "FMSTORE_CEILING_DIRECTORIES"
NO_FILE = f"no $FMSTORE_CONFIG, no fmstore.toml here or above, no {USER_CONFIG}, no {SYSTEM_CONFIG}"
NAMED = "named by --config"
ENV_NAMED = "$FMSTORE_CONFIG"
#: How a file the caller chose was found (the others were found by looking).
NAMED_BY = ("named explicitly", NAMED, ENV_NAMED)
FOUND_HERE = "found in the working directory"
FOUND_ABOVE = "found above the working directory"


def existing(path: str | os.PathLike[str], what: str) -> Path:
    p = Path(path).expanduser().absolute()
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist")
    return p


def locate(
    path: str | os.PathLike[str] | None = None, explicit: Path | None = None
) -> tuple[Path | None, str]:
    """The config file in effect (an absolute path, or None for the embedded default) and
    how it was found: ``path``; ``explicit`` (the CLI's ``--config``); ``$FMSTORE_CONFIG``; ``fmstore.toml``
    in the working directory or the nearest directory above it (:func:`_walk`), when
    trusted or in a safe directory; ``~/.config/fmstore/fmstore.toml``;
    ``/etc/fmstore/fmstore.toml``.  A file named explicitly or by the variable must exist
    and is the namer's to trust; a file found by looking that fails the trust rule
    (:func:`fmstore.trust.why_untrusted`) raises :class:`ConfigError`."""
    if path is not None:
        return existing(path, "config file"), NAMED_BY[0]
    if explicit is not None:
        return explicit, NAMED
    env = os.environ.get("FMSTORE_CONFIG")
    if env:
        p = Path(env).expanduser().absolute()
        if not p.is_file():
            raise ConfigError(f"$FMSTORE_CONFIG points at {env!r}, which does not exist")
        return p, ENV_NAMED
    walked = _walk()
    if walked is not None:
        return walked
    for name, how in ((USER_CONFIG, "user config"), (SYSTEM_CONFIG, "system config")):
        p = Path(name).expanduser().absolute()
        why = _why_untrusted_file(p)
        if why == "":
            continue
        if why is not None:
            raise ConfigError(
                f"{p} ({how}) is not trusted, so not used: {why}; fmstore reads a config it "
                "finds by looking only when nobody but root and you could have written it. "
                "Fix its owner or mode, or name a file: --config PATH or FMSTORE_CONFIG=PATH"
            )
        return p, how
    return None, "embedded default"


def _why_untrusted_file(p: Path) -> str | None:
    """Why the user's or the system's file ``p`` could have been written by someone else,
    None when it could not, ``""`` when there is no such file.  A link passes when the link
    (its owner, its directories) and the file it names both do."""
    try:
        st = os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        return ""
    except OSError as e:
        return f"cannot be examined ({e.strerror})"
    if not (_stat.S_ISREG(st.st_mode) or _stat.S_ISLNK(st.st_mode)):
        return ""  # not a file (as before: a directory of that name is no config)
    why = why_untrusted(str(p), st)
    if why is not None or _stat.S_ISREG(st.st_mode):
        return why
    real = os.path.realpath(p)
    try:
        rst = os.lstat(real)
    except OSError:
        return ""  # a dangling link: no file
    if not _stat.S_ISREG(rst.st_mode):
        return ""
    why = why_untrusted(real, rst)
    return None if why is None else f"{real}, which it links to: {why}"


def _dirs_of(raw: str) -> set[str]:
    """``raw`` as written and with its links resolved (the walk sees physical paths)."""
    p = os.path.normpath(os.path.expanduser(raw))
    return {p, os.path.realpath(p)} if os.path.isabs(p) else set()


def _walk() -> tuple[Path, str] | None:
    """``fmstore.toml`` in the working directory or the nearest directory above it, and how
    it was found; None without one.  The walk never follows a link (``os.getcwd()`` is
    the physical path; each name is read with ``lstat``), includes ``$HOME`` but stops
    above it, and stops below a file-system boundary and below a directory of
    ``$FMSTORE_CEILING_DIRECTORIES`` (the working directory itself is always looked in).
    A file found must be trusted, or lie in a safe directory; else :class:`ConfigError`."""
    try:
        d = os.getcwd()
        dev = os.lstat(d).st_dev
    except OSError:
        return None  # no working directory (removed): nothing to walk
    home = _dirs_of(os.environ.get("HOME", ""))
    ceilings = {c for raw in os.environ.get(CEILING_ENV, "").split(":") for c in _dirs_of(raw)}
    how = FOUND_HERE
    while True:
        p = os.path.join(d, CONFIG_NAME)
        try:
            st: os.stat_result | None = os.lstat(p)
        except OSError:
            st = None  # absent, or a directory we cannot look in: nothing found there
        if st is not None and (_stat.S_ISREG(st.st_mode) or _stat.S_ISLNK(st.st_mode)):
            return _trusted_walked(Path(p), st, how)
        parent = os.path.dirname(d)
        if d in home or parent == d or parent in ceilings:
            return None
        try:
            if os.lstat(parent).st_dev != dev:
                return None
        except OSError:
            return None
        d, how = parent, FOUND_ABOVE


def _trusted_walked(p: Path, st: os.stat_result, how: str) -> tuple[Path, str]:
    if _stat.S_ISLNK(st.st_mode):
        why: str | None = "it is a symbolic link (the lookup follows none)"
    else:
        why = why_untrusted(str(p), st)
    if why is None:
        return p, how
    safe = _safe_directories()
    listed = next((safe[d] for d in _dirs_of(str(p.parent)) if d in safe), None)
    if listed is not None and not _stat.S_ISLNK(st.st_mode):
        return p, f"{how}, in a safe directory of {listed}"
    q = shlex.quote(str(p))
    # a ceiling keeps the walk out of a directory above, never out of the working one
    ceiling = f"; to keep the lookup out of it, add {shlex.quote(str(p.parent))} to ${CEILING_ENV}"
    raise ConfigError(
        f"{p} ({how}) is not trusted, so not used: {why}. fmstore reads a config it finds "
        "by looking only when nobody but root and you could have written it or any "
        f"directory above it. To use it anyway, name it: --config {q} or "
        f"FMSTORE_CONFIG={q}; to trust its directory for good, list it in [trust] "
        f"safe_directories of {USER_CONFIG} or {SYSTEM_CONFIG}"
        + (ceiling if how == FOUND_ABOVE else "")
    )


def _safe_directories() -> dict[str, str]:
    """``[trust] safe_directories`` of the user's and the system's file (each directory ->
    the file that lists it), read only from those files and only when they are trusted:
    never from a file found by walking."""
    out: dict[str, str] = {}
    for name in (SYSTEM_CONFIG, USER_CONFIG):
        p = Path(name).expanduser().absolute()
        if _why_untrusted_file(p) is not None:
            continue  # absent, or not trusted (an error of its own when it is the config)
        try:
            data = tomllib.loads(p.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{p}: cannot read [trust] safe_directories: {e}") from None
        trust = data.get("trust", {})
        listed = trust.get("safe_directories", []) if isinstance(trust, dict) else None
        if not isinstance(listed, list) or not all(isinstance(x, str) for x in listed):
            raise ConfigError(f"{p}: [trust] safe_directories must be a list of strings")
        for raw in listed:
            for d in _dirs_of(raw):
                out.setdefault(d, str(p))
    return out
