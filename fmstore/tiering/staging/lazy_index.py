"""The lazy-staging index (``DST/.fmstore-lazy.jsonl``), read as the hostile data it is.

``fmstore stage --lazy`` writes the index, but on a shared node an index is data written by
whoever can write where it lies, and fmstore often runs as root.  So:

* **Who wrote it.** An index is honoured only when it is owned by root or the caller and is
  writable by neither its group nor others, and no directory on its path can be changed by
  anyone else: each is owned by root or the caller and writable by neither its group nor
  others.  The one exception is a sticky ancestor (``/tmp``, a 1777 scratch directory)
  whose next directory down is owned by root or the caller: nobody else can rename that
  one.  The index's own directory gets no such exception: an index in a sticky scratch
  directory is refused.  A group that is root's, or the caller's own private group (the
  user-private-group convention: same name as the user, no other members), does not
  count as others.
* **Where it is looked for.** :func:`find_index` looks from a path upwards, never past the
  root of the configured POSIX tier holding the path (or the root its caller names), and
  never into a directory someone else could have written the index into.
* **How it is read.** With ``O_NOFOLLOW | O_NONBLOCK``: links, FIFOs and devices are
  refused, never opened or read; at most :data:`MAX_INDEX_BYTES`, lines of at most
  :data:`MAX_LINE_BYTES`; every malformed line is a :class:`CorruptData` naming the file
  and the line.
* **Where files come from.** :func:`open_source` fetches only from a configured tier (or a
  location below one), or from below a location the operator listed in ``[stage]
  lazy_sources``.  Any other location or protocol an index names (``http://``, fsspec
  chains such as ``simplecache::``, ``file://`` or a path outside those) is refused before
  anything is opened.
"""

from __future__ import annotations

import json
import os
import stat as _stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

from ...config import Config, get_config
from ...errors import ConfigError, CorruptData, FmstoreError, PermissionDenied
from ...keys import validate_key
from ...stores import Location, open_store, split_tier
from ...stores.base import Store
from ...stores.crc import from_hex
from ...stores.location import scheme_of
from ...trust import why_untrusted, why_untrusted_dir

INDEX_NAME = ".fmstore-lazy.jsonl"
#: Largest index read (about four million files).
MAX_INDEX_BYTES = 512 << 20
#: Longest line of an index (a key is at most 1 KiB).
MAX_LINE_BYTES = 64 << 10
#: Longest source location and source version recorded.
_MAX_TEXT = 4096
#: Largest file size an entry may state.
_MAX_SIZE = 1 << 62
#: Names fmstore keeps for itself (temp files, locks, the index): never an entry.
_RESERVED = ".fmstore"


@dataclass(frozen=True)
class LazyEntry:
    key: str
    size: int
    version: str | None = None
    crc: int | None = None


@dataclass
class LazyIndex:
    root: str  # local directory holding the index (with no symbolic link in its path)
    source: str
    entries: dict[str, LazyEntry] = field(default_factory=dict)

    def under(self, prefix: str) -> list[LazyEntry]:
        if not prefix:
            return list(self.entries.values())
        p = prefix.rstrip("/")
        return [e for k, e in self.entries.items() if k == p or k.startswith(p + "/")]

    @property
    def path(self) -> str:
        return os.path.join(self.root, INDEX_NAME)


# ---- who may have written it ------------------------------------------------------------


def _check_trusted(path: str, st: os.stat_result) -> None:
    """Raise :class:`PermissionDenied` unless the index at ``path`` (its ``lstat``) and every
    directory above it can be changed only by root and the caller (:mod:`fmstore.trust`)."""
    why = why_untrusted(path, st)
    if why is not None:
        raise PermissionDenied(f"lazy index not trusted, so not used: {why}", key=path)


# ---- reading ------------------------------------------------------------------------------


def _kind(mode: int) -> str:
    for test, name in (
        (_stat.S_ISLNK, "a symbolic link"),
        (_stat.S_ISDIR, "a directory"),
        (_stat.S_ISFIFO, "a FIFO"),
        (_stat.S_ISSOCK, "a socket"),
        (_stat.S_ISCHR, "a character device"),
        (_stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _bad(path: str, line: int, why: str) -> CorruptData:
    return CorruptData(f"lazy index line {line}: {why}", key=path)


def _lines(path: str, f: IO[bytes]) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON) of each non-blank line, bounded."""
    total = 0
    n = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        n += 1
        total += len(raw)
        if total > MAX_INDEX_BYTES:
            raise _bad(path, n, f"the index is longer than {MAX_INDEX_BYTES} bytes")
        if len(raw) > MAX_LINE_BYTES:
            raise _bad(path, n, f"longer than {MAX_LINE_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _bad(path, n, f"not UTF-8 (byte {e.start})") from None
        if not text.strip():
            continue
        try:
            yield n, json.loads(text)
        except (ValueError, RecursionError):
            raise _bad(path, n, "not a JSON value") from None


def _head(path: str, n: int, rec: Any) -> str:
    """The source a valid first line names."""
    ok = (
        n == 1
        and isinstance(rec, dict)
        and type(rec.get("fmstore_lazy")) is int
        and rec["fmstore_lazy"] == 1
        and isinstance(rec.get("source"), str)
        and 0 < len(rec["source"]) <= _MAX_TEXT
    )
    if not ok:
        raise CorruptData("not an fmstore lazy index (bad first line)", key=path)
    return str(rec["source"])


def _entry(path: str, n: int, rec: Any) -> LazyEntry:
    if not isinstance(rec, dict):
        raise _bad(path, n, f"an entry must be a JSON object, not {type(rec).__name__}")
    key, size, version, crc = rec.get("k"), rec.get("s"), rec.get("v"), rec.get("c")
    if not isinstance(key, str):
        raise _bad(path, n, "'k' (the key) must be a string")
    try:
        validate_key(key)
    except FmstoreError as e:
        raise _bad(path, n, f"bad key: {e.message}") from None
    if any(seg.startswith(_RESERVED) for seg in key.split("/")):
        raise _bad(path, n, f"key {key!r} is a name fmstore keeps for itself")
    if type(size) is not int or not 0 <= size <= _MAX_SIZE:
        raise _bad(path, n, f"'s' (the size) of {key!r} must be a whole number of bytes")
    if version is not None and (not isinstance(version, str) or len(version) > _MAX_TEXT):
        raise _bad(path, n, f"'v' (the source version) of {key!r} must be a short string")
    parsed = None
    if crc is not None:
        parsed = from_hex(crc) if isinstance(crc, str) else None
        if parsed is None:
            raise _bad(path, n, f"'c' (the checksum) of {key!r} must be 8 hex digits")
    return LazyEntry(key, size, version, parsed)


def parse(root: str, f: IO[bytes]) -> LazyIndex:
    """The index read from ``f`` (the file ``root/INDEX_NAME``), bounded and checked."""
    path = os.path.join(root, INDEX_NAME)
    idx: LazyIndex | None = None
    for n, rec in _lines(path, f):
        if idx is None:
            idx = LazyIndex(root, _head(path, n, rec))
            continue
        e = _entry(path, n, rec)
        if e.key in idx.entries:
            raise _bad(path, n, f"key {e.key!r} is listed twice")
        idx.entries[e.key] = e
    if idx is None:
        raise CorruptData("not an fmstore lazy index (empty)", key=path)
    return idx


_cache: dict[str, tuple[tuple[int, ...], LazyIndex]] = {}


def load_index(root: str) -> LazyIndex | None:
    """The index at directory ``root``, or None when there is none.  Raises
    :class:`PermissionDenied` when it is not trusted (see the module docstring) and
    :class:`CorruptData` when it is not a regular file or does not parse.  Cached while
    the file is unchanged; its trust is checked on every call."""
    path = os.path.join(root, INDEX_NAME)
    try:
        lst = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise PermissionDenied(f"cannot read the lazy index: {e.strerror}", key=path) from None
    if not _stat.S_ISREG(lst.st_mode):
        raise CorruptData(f"lazy index is {_kind(lst.st_mode)}, not a regular file", key=path)
    _check_trusted(path, lst)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CorruptData(f"cannot open the lazy index: {e.strerror}", key=path) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (lst.st_dev, lst.st_ino) or not _stat.S_ISREG(st.st_mode):
            raise CorruptData("lazy index replaced while it was opened", key=path)
        _check_trusted(path, st)
        if st.st_size > MAX_INDEX_BYTES:
            raise CorruptData(
                f"lazy index of {st.st_size} bytes is over the {MAX_INDEX_BYTES}-byte limit",
                key=path,
            )
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        hit = _cache.get(root)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        idx = parse(root, f)
    _cache[root] = (stamp, idx)
    return idx


# ---- where it is looked for ---------------------------------------------------------------


def local_dir(path: str, config: Config | None = None) -> str:
    """A path, ``file://`` URL or ``TIER:path`` on a POSIX tier as an absolute local path."""
    local = Location.parse(path, config).local_root
    if local is None:
        tier, _rest = split_tier(path, config)
        where = f", and {tier} is {(config or get_config()).tier(tier).url}" if tier else ""
        raise ConfigError(f"{path!r}: lazy staging works on local paths (POSIX tiers){where}")
    return os.path.abspath(local)


def _below(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def tier_root_of(path: str, config: Config | None = None) -> str | None:
    """The root (real path) of the deepest configured POSIX tier holding real path ``path``."""
    cfg = config or get_config()
    best: str | None = None
    for name in cfg.tiers:
        try:
            local = Location.parse(f"{name}:", cfg).local_root
        except ConfigError:
            continue
        if local is None:
            continue
        root = os.path.realpath(local)
        if _below(path, root) and (best is None or len(root) > len(best)):
            best = root
    return best


def find_index(path: str, *, stop: str | None = None) -> tuple[LazyIndex, str] | None:
    """The lazy index governing ``path`` and the key of ``path`` below it, or None.

    Looks in ``path`` (a directory) or its directory, then upwards: never above ``stop``
    (default: the root of the configured POSIX tier holding ``path``), and never into a
    directory that someone other than root and the caller can change (above such a
    directory, they could have placed what is below it).  Raises as :func:`load_index`."""
    real = os.path.realpath(local_dir(path))
    top = os.path.realpath(stop) if stop is not None else tier_root_of(real)
    d = real if os.path.isdir(real) else os.path.dirname(real)
    child: os.stat_result | None = None
    while True:
        try:
            st: os.stat_result | None = os.lstat(d)
        except (FileNotFoundError, NotADirectoryError):
            st = None  # not created yet: look above it
        if st is not None:
            idx = load_index(d)
            if idx is not None:
                rel = os.path.relpath(real, d)
                return idx, "" if rel == "." else rel.replace(os.sep, "/")
            if why_untrusted_dir(d, st, child) is not None:
                return None
        if d == top:
            return None
        parent = os.path.dirname(d)
        if parent == d or (top is not None and not _below(parent, top)):
            return None
        d, child = parent, st


# ---- where files come from ------------------------------------------------------------------


def _comparable(url: str) -> str | None:
    """``url`` in the form locations are compared in: an absolute path for local ones
    (``file://`` dropped), ``s3://`` for ``s3a://``; None for a relative path."""
    scheme = scheme_of(url)
    if scheme is None or scheme == "file":
        path = url[len("file://") :] if scheme == "file" else url
        return path if path.startswith("/") else None
    if scheme == "s3a":
        return "s3://" + url.split("://", 1)[1]
    return url


def _roots(spec: str, cfg: Config) -> list[str]:
    """The forms of location ``spec`` (a tier, ``TIER:path``, a path or a URL) that a
    source below it may be written in."""
    loc = Location.parse(spec, cfg)
    if loc.local_root is not None:
        return sorted({os.path.abspath(loc.local_root), os.path.realpath(loc.local_root)})
    base = _comparable(loc.base)
    if base is None:
        return []
    return [base.rstrip("/") + "/" + loc.sub if loc.sub else base]


def lazy_sources(config: Config | None = None) -> list[str]:
    """``[stage] lazy_sources``: locations (paths, ``file://``, ``s3://``, ``TIER:path``)
    below which a lazy index may name its source, besides the configured tiers.  Raises
    :class:`ConfigError` naming the file and the key when the value is not so."""
    cfg = config or get_config()
    section = cfg.section("stage")
    value = section.get("lazy_sources", []) if isinstance(section, Mapping) else []
    w = f"{cfg.source or 'config'}: [stage] lazy_sources"
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{w} must be a list of locations (strings), not {value!r}")
    for v in value:
        scheme = scheme_of(v)
        try:
            tier, _rest = split_tier(v, cfg)
        except ConfigError as e:
            raise ConfigError(f"{w}: {v!r}: {e.message}") from None
        if tier is None and (scheme not in (None, "file", "s3", "s3a") or "::" in v):
            raise ConfigError(f"{w}: {v!r}: only paths, file://, s3:// or TIER:path")
        if tier is None and _comparable(v) is None:
            raise ConfigError(f"{w}: {v!r}: a path must be absolute")
    return list(value)


def match_source(source: str, config: Config | None = None) -> tuple[str, str] | None:
    """(location, key prefix below it) to open ``source`` as, when it is a configured tier,
    below one, or below a location of ``[stage] lazy_sources``; else None."""
    cfg = config or get_config()
    if not source or "::" in source or any(ord(c) < 0x20 for c in source):
        return None
    try:
        tier, rest = split_tier(source, cfg)
    except ConfigError:
        return None
    if tier is not None:
        return _checked(f"{tier}:", rest.strip("/"))
    want = _comparable(source)
    if want is None:
        return None
    want = want.rstrip("/") or "/"
    specs = [f"{name}:" for name in cfg.tiers] + lazy_sources(cfg)
    for spec in specs:
        try:
            roots = _roots(spec, cfg)
        except ConfigError:
            continue
        for root in roots:
            if _below(want, root):
                found = _checked(spec, want[len(root) :].strip("/"))
                if found is not None:
                    return found
    return None


def _checked(spec: str, sub: str) -> tuple[str, str] | None:
    if not sub:
        return spec, ""
    try:
        validate_key(sub)
    except FmstoreError:
        return None
    return spec, sub


def refusal(source: str) -> str:
    return (
        f"source {source!r} is neither a configured tier (or below one) nor below a "
        "location of [stage] lazy_sources in fmstore.toml"
    )


def open_source(idx: LazyIndex, *, concurrency: int | None = None) -> Store:
    """The store of the index's source, when it may be fetched from (see the module
    docstring); :class:`PermissionDenied` naming the index otherwise."""
    found = match_source(idx.source)
    if found is None:
        raise PermissionDenied(f"lazy index not used: {refusal(idx.source)}", key=idx.path)
    spec, sub = found
    store = open_store(spec, concurrency=concurrency)
    return store.sub(sub) if sub else store
