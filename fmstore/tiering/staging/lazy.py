"""Lazy staging, like FSx for Lustre's lazy loading: the listing now, the bytes on first read.

``fmstore stage --lazy SRC DST`` writes only an index, ``DST/.fmstore-lazy.jsonl``: the
source location, then one line per file with its key, size, source version and checksum
(when known).  No stub files are created, so nothing can read a placeholder as data.

* :func:`open` (``fmstore.open``) opens a file below a lazily staged directory; when it is
  not there yet it is fetched from the source (verified, atomically) and kept.
* :func:`hydrate` (``fmstore hydrate PATH``) fetches everything under ``PATH`` that is
  missing, with the parallel copy engine and the staging's resume journal: an interrupted
  hydrate fetches neither the files nor the parts of big files it had finished.
* :func:`release` (``fmstore release PATH``) drops local copies under ``PATH`` but keeps
  the index, and only where that is safe: the local bytes still match the checksum recorded
  when they were fetched, and the source still holds the same version of the file.
* Staging lazily again over the same directory writes the new listing and drops the local
  copies it makes stale (fetched from another version of their source file, unchanged
  since): the next read fetches the listed version.  A copy changed locally since it was
  fetched is kept, and named.

The index is data written by whoever can write where it lies: it is used only where
nobody but root and the caller could have written it, read bounded, and its source fetched
from only where the configuration allows (:mod:`fmstore.tiering.staging.lazy_index`).

Index format (JSON lines)::

    {"fmstore_lazy": 1, "source": "s3://bucket/ds"}
    {"k": "train/000.tar", "s": 4096, "v": "etag-or-version", "c": "1a2b3c4d"}
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import json
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from ... import runtime
from ...config import get_config
from ...errors import ConfigError, FmstoreError, NotFound, PermissionDenied
from ...stores import open_store
from ...stores.base import ObjectMeta, PutOptions, Store
from ...stores.crc import crc32c, from_hex, to_hex
from ..copy.journal import Journal
from ..copy.transfer import (
    META_CRC,
    META_SRC_VERSION,
    CopyItem,
    TransferOptions,
    TransferProgress,
    TransferReport,
    copy_items,
    version_of,
)
from .lazy_index import (
    INDEX_NAME,
    LazyEntry,
    LazyIndex,
    find_index,
    load_index,
    local_dir,
    match_source,
    open_source,
    refusal,
)

__all__ = [
    "INDEX_NAME",
    "LazyEntry",
    "LazyIndex",
    "find_index",
    "load_index",
    "local_dir",
    "open_source",
]


def _item(e: LazyEntry) -> CopyItem:
    return CopyItem(e.key, e.key, e.size, e.version, e.crc)


async def write_index(dst: Store, source: str, items: Sequence[CopyItem]) -> int:
    """Write the lazy index of ``items`` (from ``source``) at ``dst``'s root; returns its size."""
    lines = [json.dumps({"fmstore_lazy": 1, "source": source})]
    for i in items:
        rec: dict[str, Any] = {"k": i.dst_key, "s": i.size, "v": i.version}
        if i.crc32c is not None:
            rec["c"] = to_hex(i.crc32c)
        lines.append(json.dumps(rec, separators=(",", ":")))
    await dst.put(INDEX_NAME, ("\n".join(lines) + "\n").encode(), PutOptions())
    path = dst.local_path(INDEX_NAME)
    if path is not None:
        await runtime.to_io(_usable, path)
    return len(items)


def _usable(path: str) -> None:
    """Drop group and other write from the index just written (a umask of 002 leaves
    them), then check that it will be used where it lies (:mod:`.lazy_index`): one that
    would not be (in a directory others can write, say) is removed, and the error says
    why, rather than reporting a staging that no read could use."""
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    if mode & 0o022:
        os.chmod(path, mode & ~0o022, follow_symlinks=False)
    try:
        load_index(os.path.realpath(os.path.dirname(path)))
    except PermissionDenied as e:
        os.unlink(path)
        raise ConfigError(
            f"lazy listing not kept, as it would not be used: {e.message}", key=path
        ) from None


def check_stage(src_url: str, dst_url: str) -> None:
    """Refuse a lazy staging whose listing could not be used, before anything is opened:
    a destination that is not a local directory, a source that an index may not name
    (:func:`fmstore.tiering.staging.lazy_index.match_source`).  ``src_url`` as it will be
    recorded (absolute when a path)."""
    try:
        local_dir(dst_url)
    except ConfigError as e:
        raise ConfigError(
            f"--lazy: the destination must be a local directory (a path or a POSIX tier), "
            f"where the listing and the files fetched on first read are kept: {e.message}"
        ) from None
    if match_source(src_url) is None:
        raise ConfigError(
            f"--lazy: {refusal(src_url)}, so its listing would not be used; list it there "
            "to allow it (docs/staging.md)"
        )


def _hidden_from_others(path: str, copy: str) -> bool:
    """Whether users other than the owner and group could not read ``path`` where they
    can reach ``copy``: the file lacks other-read, or a directory above it and not above
    ``copy`` too lacks other-search (directories above both hide both alike)."""
    if not os.stat(path, follow_symlinks=False).st_mode & stat.S_IROTH:
        return True
    common = os.path.commonpath([os.path.abspath(path), os.path.abspath(copy)])
    d = os.path.dirname(os.path.abspath(path))
    while d != common and d.startswith(common):
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return True
        d = os.path.dirname(d)
    return False


def _keep_private(src: Store, root: str, keys: Sequence[str]) -> None:
    """A fetched copy is never readable by others when its source was not: a 0644 file in
    a 0700 directory is hidden by that directory, which the copy does not sit below."""
    for key in keys:
        source = src.local_path(key)
        local = os.path.join(root, key)
        try:
            if source is None or not _hidden_from_others(source, local):
                continue
            mode = stat.S_IMODE(os.lstat(local).st_mode)
            if mode & 0o007:
                os.chmod(local, mode & ~0o007, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not fetched (a failure the report names) or gone meanwhile


async def _fetch(
    src: Store,
    dst: Store,
    root: str,
    entries: Sequence[LazyEntry],
    options: TransferOptions,
    existing: Mapping[str, ObjectMeta],
    **kwargs: Any,
) -> TransferReport:
    """Copy ``entries`` not in ``existing``; fetches carry the source's mode as staging
    does (never wider, never special bits), and never readable by others when the source
    was not (:func:`_keep_private`)."""
    report = await copy_items(
        src,
        dst,
        [_item(e) for e in entries],
        dataclasses.replace(options, posix_attrs=True),
        dst_existing=existing,
        **kwargs,
    )
    fetched = [e.key for e in entries if e.key not in existing]
    if fetched and src.local_root is not None:
        await runtime.to_io(_keep_private, src, root, fetched)
    return report


async def drop_stale(
    dst: Store, items: Sequence[CopyItem], present: Mapping[str, ObjectMeta]
) -> tuple[list[str], list[str]]:
    """Local copies under a new listing of ``items`` that it makes stale: those fetched
    from another version of their source file and unchanged since are dropped (the next
    read fetches the listed one); those changed locally, or not fetched by fmstore, are
    kept.  Returns (dropped, kept) keys."""
    dropped: list[str] = []
    kept: list[str] = []
    sem = asyncio.Semaphore(32)

    async def one(item: CopyItem) -> None:
        if item.version is None and item.crc32c is None:
            return  # nothing to tell one version from another
        async with sem:
            try:
                local = await dst.stat(item.dst_key)  # with what was recorded at fetch
            except NotFound:
                return
            crc = from_hex(local.metadata.get(META_CRC))
            version = local.metadata.get(META_SRC_VERSION)
            if local.size == item.size and (
                (crc is not None and crc == item.crc32c)
                or (version is not None and version == item.version)
            ):
                return  # the listed version
            if crc is None:
                kept.append(item.dst_key)
                return
            await dst.delete(item.dst_key)
            dropped.append(item.dst_key)

    await asyncio.gather(*(one(i) for i in items if i.dst_key in present))
    return sorted(dropped), sorted(kept)


async def fetch_async(
    idx: LazyIndex, entries: Sequence[LazyEntry], options: TransferOptions = TransferOptions()
) -> TransferReport:
    """Copy ``entries`` from the index's source into its root (files already there are
    skipped); a file whose source changed size since the listing is reported as failed."""
    src = open_source(idx)
    dst = open_store(idx.root)
    try:
        existing = {}
        for e in entries:
            p = os.path.join(idx.root, e.key)
            if os.path.exists(p):
                existing[e.key] = await dst.stat(e.key)
        return await _fetch(src, dst, idx.root, entries, options, existing)
    finally:
        # Each fetch opens its own stores: close them, or every lazy open leaks a client.
        closing = asyncio.gather(src.close(), dst.close(), return_exceptions=True)
        await asyncio.shield(closing)


def open(path: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:  # noqa: A001 (mirrors builtins.open)
    """Open a local file, fetching it first when it belongs to a lazily staged directory
    and is not present yet.  Other files open as with ``builtins.open``."""
    local = local_dir(path)
    if any(c in mode for c in "wx") or os.path.exists(local):
        return builtins.open(local, mode, **kwargs)
    found = find_index(local)
    if found is None or found[1] not in found[0].entries:
        raise NotFound("no such file (and not in a lazy index)", key=local)
    idx, key = found
    report = runtime.run(fetch_async(idx, [idx.entries[key]]))
    if report.failures:
        raise FmstoreError(
            f"lazy fetch from {idx.source} failed: {report.failures[0].error}", key=key
        )
    return builtins.open(os.path.join(idx.root, key), mode, **kwargs)


async def hydrate_async(
    path: str,
    options: TransferOptions = TransferOptions(),
    *,
    progress: TransferProgress | None = None,
    state_dir: str | None = None,
) -> TransferReport:
    """Fetch every file of the lazy index under ``path`` that is not present yet.

    Resumable: the copy keeps the resume journal that staging the same source into the
    same directory keeps (in ``state_dir``, by default the config's), so a run that was
    interrupted is finished by the next without fetching again the files, or the parts
    of big files, it had finished.  ``progress``: live counters, readable from any thread
    while the run goes on.  The source is opened with ``options.concurrency`` as its
    request limit (:meth:`fmstore.stores.Location.open`)."""
    found = await runtime.to_io(find_index, path)
    if found is None:
        raise NotFound(
            "not inside a lazily staged directory (no .fmstore-lazy.jsonl above it)", key=path
        )
    idx, prefix = found
    entries = idx.under(prefix)
    if not entries:
        raise NotFound("nothing in the lazy index under this path", key=path)
    src = open_source(idx, concurrency=options.concurrency)
    dst = open_store(idx.root)
    try:
        existing = {}
        async for m in dst.list(prefix if prefix and prefix not in idx.entries else ""):
            existing[m.key] = m
        # The staging's journal (:func:`fmstore.tiering.staging.stage.journal_path`).
        where = Journal.path_for(state_dir or get_config().state_dir, src.url, dst.url)
        journal = await Journal.open(where, dest=dst.url)
        try:
            return await _fetch(
                src, dst, idx.root, entries, options, existing, journal=journal, progress=progress
            )
        finally:
            await asyncio.shield(journal.close())
    finally:
        closing = asyncio.gather(src.close(), dst.close(), return_exceptions=True)
        await asyncio.shield(closing)


def hydrate(
    path: str,
    options: TransferOptions = TransferOptions(),
    *,
    progress: TransferProgress | None = None,
    state_dir: str | None = None,
) -> TransferReport:
    """Sync facade of :func:`hydrate_async`."""
    return runtime.run(hydrate_async(path, options, progress=progress, state_dir=state_dir))


@dataclass
class ReleaseResult:
    released: list[str] = field(default_factory=list)
    bytes_released: int = 0
    kept: list[tuple[str, str]] = field(default_factory=list)  # (key, why it is not safe)


async def release_async(path: str, *, concurrency: int = 32) -> ReleaseResult:
    found = await runtime.to_io(find_index, path)
    if found is None:
        raise NotFound(
            "not inside a lazily staged directory (no .fmstore-lazy.jsonl above it)", key=path
        )
    idx, prefix = found
    src = open_source(idx)
    dst = open_store(idx.root)
    out = ReleaseResult()
    sem = asyncio.Semaphore(concurrency)

    async def one(e: LazyEntry) -> None:
        async with sem:
            try:
                local = await dst.stat(e.key)
            except NotFound:
                return  # not present: nothing to release
            reason = await _unsafe(src, dst, e, local.metadata.get(META_CRC))
            if reason:
                out.kept.append((e.key, reason))
                return
            await dst.delete(e.key)
            out.released.append(e.key)
            out.bytes_released += e.size

    await asyncio.gather(*(one(e) for e in idx.under(prefix)))
    out.released.sort()
    out.kept.sort()
    return out


async def _unsafe(src: Store, dst: Store, e: LazyEntry, recorded: str | None) -> str | None:
    """Why dropping the local copy of ``e`` could lose data, or None when it cannot."""
    want = from_hex(recorded)
    if want is None:
        return "no checksum recorded with the local copy"
    data = await dst.get(e.key)
    got = await runtime.to_cpu(crc32c, data)
    if got != want or len(data) != e.size:
        return "local copy differs from what was fetched (modified?)"
    try:
        smeta = await src.stat(e.key)
    except NotFound:
        return "not present on the source"
    except FmstoreError as err:
        return f"source unreachable: {err}"
    if smeta.size != e.size or (e.version is not None and version_of(smeta) != e.version):
        return "source changed since staging"
    return None


def release(path: str) -> ReleaseResult:
    """Drop local copies under ``path`` that are safe on the source (see module docstring)."""
    return runtime.run(release_async(path))
