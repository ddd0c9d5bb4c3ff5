"""Object commands: cp, du, rm (ls is in store_cmds).  Exit codes: :mod:`.progress`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import typer

from .. import runtime
from ..errors import ConfigError, NotFound
from ..stores import Location, beneath, open_store, split_tier
from ..stores.base import Store
from ..tiering.copy.transfer import (
    CopyItem,
    TransferOptions,
    TransferReport,
    copy_items,
    version_of,
)
from ..tiering.staging.stage import local_dir, open_source
from .main import app
from .progress import (
    EXIT_FAILED,
    EXIT_USAGE,
    PRESERVE_OWNER_HELP,
    ask_yes,
    console,
    list_failures,
    preserve_owner,
)
from .util import human_bytes, is_root, plural, printable, split_object


def _is_local_file(url: str) -> bool:
    path = local_dir(url)
    return path is not None and os.path.isfile(path)


#: A glob character in a ``cp`` source (``s3:ds/train/*.bin``).
_GLOB = re.compile(r"[*?[]")


def _split_glob(src: str) -> tuple[str, str] | None:
    """``s3:ds/train/*.bin`` -> ``("s3:ds/train", "*.bin")``: the directory before the first
    glob character and the pattern below it; None without a glob."""
    m = _GLOB.search(src)
    if m is None:
        return None
    head = src[: m.start()]
    cut = head.rfind("/")
    scheme = src.find("://")
    if scheme >= 0 and cut < scheme + 3:
        raise ConfigError(f"{src!r}: a glob in a bucket name is not supported")
    if cut >= 0:
        return src[:cut] or "/", src[cut + 1 :]
    tier, rest = split_tier(src) if ":" in head else (None, src)
    return (f"{tier}:", rest) if tier is not None else (".", src)


def _cp_many(
    src: str, pattern: str | None, dst: str, recursive: bool, topts: TransferOptions, shown: str
) -> None:
    """``cp -r`` and ``cp GLOB``: what ``fmstore stage`` does (parallel, resumable,
    identical files skipped), restricted to ``pattern``, with no deletes and no shard.  A
    pattern of one segment matches names in ``src`` itself, or at any depth with ``-r``
    (as ``ls`` reads it)."""
    from ..tiering.staging.stage import StageOptions, stage

    top_only = pattern is not None and "/" not in pattern and not recursive
    opts = StageOptions(
        includes=(pattern,) if pattern else (),
        excludes=("*/**",) if top_only else (),
        transfer=topts,
    )
    result = stage(src, dst, opts)
    if result.report.failures:
        list_failures(result.report)
        raise typer.Exit(EXIT_FAILED)
    p = result.report.progress
    if pattern is not None and p.files_total == 0:
        raise NotFound(f"no object under {src} matches {pattern!r}")
    skipped = f", {p.files_skipped} identical skipped" if p.files_skipped else ""
    typer.echo(
        f"{shown} -> {dst}: copied {plural(p.files_copied, 'file')} "
        f"({human_bytes(p.bytes_copied)}){skipped}",
        err=True,
    )


@app.command("cp")
def cp_cmd(
    src: str = typer.Argument(
        ...,
        metavar="SRC",
        help="Source object (path, s3://bucket/key, TIER:path/key); with a glob (quoted: "
        "'s3:ds/train/*.bin') every object it matches; with -r a directory or prefix.",
    ),
    dst: str = typer.Argument(
        ...,
        metavar="DST",
        help="Destination object, or a directory/prefix ending in '/' (the one for -r and globs).",
    ),
    recursive: bool = typer.Option(
        False, "--recursive", "-r", help="Copy a directory or prefix and everything under it."
    ),
    verify: bool = typer.Option(False, "--verify", help="Re-read the copy and compare checksums."),
    force: bool = typer.Option(
        False, "--force", "-f", help="Copy even when an identical copy is present."
    ),
    preserve_owner_flag: bool | None = typer.Option(
        None, "--preserve-owner/--no-preserve-owner", help=PRESERVE_OWNER_HELP
    ),
) -> None:
    """Copy one object between any two locations (checksummed, atomic).

    With a glob in SRC ('s3:ds/train/*.bin', quoted so the shell leaves it) or with -r, copy
    many into the directory DST: every object the glob matches in its directory (with -r,
    at any depth below it, as for ls), or everything under SRC, keeping their paths
    relative to that directory. This is 'fmstore stage DIR DST --include GLOB' without its
    deletes, shards and progress bar."""
    topts = TransferOptions(
        verify=verify, skip_identical=not force, preserve_owner=preserve_owner(preserve_owner_flag)
    )
    local = local_dir(src)
    # A path that exists is itself, even with a glob character in its name (``run[1]/x``).
    glob = None if local is not None and os.path.exists(local) else _split_glob(src)
    if glob is not None or (recursive and not _is_local_file(src)):  # ``cp -r FILE``: as cp
        base, pattern = glob if glob is not None else (src, None)
        _cp_many(base, pattern, dst, recursive, topts, src)
        return
    if local is not None and os.path.isdir(local):
        raise ConfigError(
            f"{src!r} is a directory: use 'fmstore cp -r' to copy it and what it holds "
            "(or 'fmstore stage', which also resumes, shards and syncs)"
        )
    s_parent, s_key = split_object(src)
    if os.path.isdir(dst) or dst.endswith("/"):
        d_parent, d_key = dst.rstrip("/") or "/", s_key
    else:
        d_parent, d_key = split_object(dst)
    # The stores allow as many requests as the copy keeps in flight (its parts).
    n = topts.concurrency
    if split_tier(s_parent)[0]:
        sstore = open_store(s_parent, concurrency=n)
    else:
        sstore = open_source(s_parent, concurrency=n)
    dstore = open_store(d_parent, concurrency=n)

    async def go() -> TransferReport:
        meta = await sstore.stat(s_key)
        item = CopyItem(s_key, d_key, meta.size, version_of(meta))
        return await copy_items(sstore, dstore, [item], topts)

    try:
        report = runtime.run(go())
    except NotFound:
        if local is None and _has_objects_under(src):
            raise ConfigError(
                f"{src!r} is a prefix: use 'fmstore cp -r' to copy every object under it"
            ) from None
        raise
    missing = [f.exc for f in report.failures if isinstance(f.exc, NotFound)]
    if missing and len(missing) == len(report.failures):
        # A destination that is not there (a missing bucket) is an error in what was
        # asked, as for stage (exit 1), not a copy that failed on the way (exit 3).
        raise missing[0]
    if report.failures:
        list_failures(report)
        raise typer.Exit(EXIT_FAILED)
    p = report.progress
    what = (
        "identical copy present, skipped"
        if p.files_skipped
        else f"copied {human_bytes(p.bytes_copied)}"
    )
    typer.echo(f"{src} -> {d_parent.rstrip('/')}/{d_key}: {what}", err=True)


@app.command("du")
def du_cmd(
    url: str = typer.Argument(..., help="Location to measure."),
    summarize: bool = typer.Option(False, "--summarize", "-s", help="Only the total."),
    in_bytes: bool = typer.Option(False, "--bytes", "-b", help="Sizes in bytes, not human units."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the groups and the total as one JSON object on stdout."
    ),
) -> None:
    """Disk usage: bytes and file counts per top-level directory, and the total."""
    from ..tiering.staging.stage import list_tree

    if _is_local_file(url):
        parent, key = split_object(url)
        tree = {key: runtime.run(open_store(parent).stat(key))}
    else:
        tree = runtime.run(list_tree(open_source(url, role="location")))
        if not tree and local_dir(url) is None and not is_root(url):
            # A remote prefix with nothing below it: one object, or nothing at all (an
            # empty local directory is there, and measures 0).
            parent, key = split_object(url)
            try:
                tree = {key: runtime.run(open_store(parent).stat(key))}
            except (NotFound, ConfigError):
                raise NotFound(f"location {url!r} does not exist (no object or prefix)") from None
    groups: dict[str, list[int]] = {}
    for k, m in tree.items():
        top = k.split("/", 1)[0] + ("/" if "/" in k else "")
        g = groups.setdefault(top, [0, 0])
        g[0] += m.size
        g[1] += 1
    total = sum(m.size for m in tree.values())
    if as_json:
        doc = {
            "url": url,
            "groups": [
                {"prefix": top, "bytes": groups[top][0], "files": groups[top][1]}
                for top in sorted(groups)
            ]
            if not summarize
            else [],
            "bytes": total,
            "files": len(tree),
        }
        typer.echo(json.dumps(doc))
        return
    fmt = (lambda n: str(n)) if in_bytes else human_bytes
    out = console()
    if not summarize:
        for top in sorted(groups):
            size, n = groups[top]
            out.print(f"{fmt(size):>12}  {_files(n)}  {printable(top, markup=False)}", markup=False)
    out.print(f"{fmt(total):>12}  {_files(len(tree))}  total", markup=False)


def _files(n: int) -> str:
    return f"{n:>9} {'file ' if n == 1 else 'files'}"


@dataclass
class _Removal:
    """What ``rm`` of one URL deletes: its store, the keys (none: nothing under a
    prefix), how to say it, and the checkpoint copies the catalog tracks there."""

    url: str
    store: Store
    keys: list[str]
    total: str
    tracked: list[Any]


def _plan_rm(url: str, recursive: bool) -> _Removal:
    """Resolve ``url`` as today's single-URL ``rm`` did; raises what it would have."""
    from ..tiering.inventory.removal import tracked_copies

    local = local_dir(url)
    if recursive and not _is_local_file(url):  # ``rm -r FILE`` deletes the file, as rm does
        from ..tiering.staging.stage import list_tree

        store = open_source(url, role="location")
        keys = sorted(runtime.run(list_tree(store)))
        total = f"{plural(len(keys), 'object')} under {_resolved(url)}"
    else:
        if local is not None and os.path.isdir(local):
            raise ConfigError(f"{url!r} is a directory: use 'fmstore rm -r' to delete it")
        parent, key = split_object(url)
        store = open_store(parent)
        try:
            runtime.run(store.stat(key))
        except NotFound as e:
            runtime.run(store.close())
            if local is None and _has_objects_under(url):
                raise ConfigError(
                    f"{url!r} is a prefix: use 'fmstore rm -r' to delete every object under it"
                ) from None
            # The full location: a tier's prefix (s3://bucket/team/...) is part of it, and
            # the store's key alone is relative to the parent opened here.
            raise NotFound(f"{e.message}: {store.url.rstrip('/')}/{key}", tier=e.tier) from None
        keys = [key]
        total = _resolved(url)
    tracked = tracked_copies(url, keys if recursive else [""], recursive=recursive) if keys else []
    return _Removal(url, store, keys, total, tracked)


@app.command("rm")
def rm_cmd(
    urls: list[str] = typer.Argument(  # noqa: B008
        ..., help="Objects to delete, or prefixes with --recursive (one or more)."
    ),
    recursive: bool = typer.Option(
        False, "--recursive", "-r", help="Delete every object under each URL."
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    dry_run: bool = typer.Option(
        False, "--dry-run", "-n", help="Say what would be deleted; delete nothing."
    ),
) -> None:
    """Delete objects, or every object under prefixes (asks first unless --yes).

    A prefix (a directory) needs --recursive; on a file system the directories it
    empties are removed too.  Every URL is resolved before anything is deleted (one that
    is missing stops the command, exit 1); then each is confirmed and deleted in turn.

    Checkpoints the catalog tracks on a tier are listed before anything goes (and by
    --dry-run), and the catalog records them deleted afterwards."""
    removals: list[_Removal] = []
    try:
        for url in urls:
            removals.append(_plan_rm(url, recursive))
        declined = False
        deleted_any = False
        for r in removals:
            if not r.keys:
                typer.echo(f"nothing under {r.url}", err=True)
                _remove_empty_dirs(r.url, keep_top=is_root(r.url))
                continue
            if not _rm_one(
                r, recursive, yes, dry_run, several=len(removals) > 1, first=not deleted_any
            ):
                declined = True
                if not sys.stdin.isatty():
                    break  # refused for want of --yes: the others could not be asked either
                continue
            deleted_any = not dry_run
    finally:
        for r in removals:
            runtime.run(r.store.close())
    if declined:
        raise typer.Exit(EXIT_USAGE)


def _rm_one(
    r: _Removal, recursive: bool, yes: bool, dry_run: bool, *, several: bool, first: bool
) -> bool:
    """Show what ``r`` reaches, ask, delete; False when declined."""
    from ..tiering.inventory.removal import record_removed

    if r.tracked:
        typer.echo(
            f"{plural(len(r.tracked), 'checkpoint copy', 'checkpoint copies')} the catalog "
            "tracks would go with it (the catalog then records them deleted):",
            err=True,
        )
        for c in r.tracked[:20]:
            typer.echo(f"  {printable(c.describe(), markup=False)}", err=True)
        if len(r.tracked) > 20:
            typer.echo(f"  … and {len(r.tracked) - 20} more", err=True)
    replicas = _replicas_beside(r.url) if recursive else None
    if replicas is not None:
        typer.echo(
            f"this node's replicas of other nodes' parts under {r.url} stay in {replicas} "
            f"(not deleted; 'fmstore rm -r {replicas}' deletes them)",
            err=True,
        )
    if dry_run:
        typer.echo(f"dry run: would delete {r.total}; nothing deleted", err=True)
        return True
    nothing = "Nothing deleted." if first and (not several or not sys.stdin.isatty()) else None
    if not ask_yes(f"Delete {r.total}?", yes, nothing or f"Not deleted: {r.url}."):
        return False
    keys, store = r.keys, r.store

    async def go() -> None:
        for i in range(0, len(keys), 1000):
            await store.delete_many(keys[i : i + 1000])
        if recursive:  # S3 folder markers below go too (the directories are emptied)
            with contextlib.suppress(NotFound):
                markers = [m.key async for m in store.list("", recursive=True) if m.is_dir]
                await store.delete_many(markers)

    try:
        runtime.run(go())
    finally:
        # Also after a failure part-way: a copy rm set out to delete, even in part, is no
        # longer one to restore from or to count as a replica.
        record_removed(r.tracked)
    if recursive:
        _remove_empty_dirs(r.url, keep_top=is_root(r.url))
    where = f" ({r.url})" if several else ""
    typer.echo(f"deleted {plural(len(keys), 'object')}{where}", err=True)
    return True


def _resolved(url: str) -> str:
    """``url`` and what it resolved to, for the question before a delete: a tier's
    directory or URL and the config that named the tier, an S3 endpoint."""
    loc = Location.parse(url)
    endpoint = loc.options.get("endpoint_url") if loc.scheme == "s3" else None
    return f"{loc.described()} at {endpoint}" if endpoint else loc.described()


def _replicas_beside(url: str) -> str | None:
    """``TIER:.replicas/PATH`` where the node-local tier of ``url`` (``TIER:PATH``) holds
    replicas of other nodes' parts under PATH, else None."""
    from ..checkpoint.layout import REPLICA_PREFIX
    from ..config import get_config
    from ..stores import split_tier

    name, rest = split_tier(url)
    rest = rest.strip("/")
    if name is None or get_config().tier(name).scope != "node":
        return None
    if rest.split("/", 1)[0] == REPLICA_PREFIX:
        return None
    where = f"{name}:{REPLICA_PREFIX}/{rest}" if rest else f"{name}:{REPLICA_PREFIX}"
    if local_dir(where) is not None:  # opening a local store would create the directory
        with _local_tree(where) as got:
            return where if got is not None and any(os.scandir(got[2])) else None
    return where if _has_objects_under(where) else None


@contextlib.contextmanager
def _local_tree(url: str) -> Iterator[tuple[int, str, int] | None]:
    """(its parent, its name, itself) of the directory of local location ``url``, open
    (None: not there, or not reached): a tier's path resolved beneath the tier's root with
    no link followed; a plain path's last component is not followed either."""
    loc = Location.parse(url)
    path = loc.local_root
    if path is None:
        yield None
        return
    if loc.tier is not None:
        base, rel = Location.parse(f"{loc.tier}:").local_root or path, loc.sub.strip("/")
    else:
        base, rel = os.path.split(path.rstrip("/") or "/")
    up, _, name = rel.rpartition("/")
    fds: list[int] = []
    try:
        try:
            fds.append(os.open(base, beneath.DIR_FLAGS))
            fds.append(beneath.open_dir(fds[0], up))
            fds.append(beneath.open_dir(fds[1], name) if name else os.dup(fds[1]))
        except OSError:  # not there, or a link: never followed
            got = None
        else:
            got = (fds[1], name, fds[2])
        yield got
    finally:
        for fd in fds:
            os.close(fd)


def _has_objects_under(url: str) -> bool:
    store = open_store(url)

    async def go() -> bool:
        try:
            async for _m in store.list("", recursive=False):
                return True
            return False
        except NotFound:
            return False
        finally:
            await store.close()

    return runtime.run(go())


def _remove_empty_dirs(url: str, *, keep_top: bool) -> None:
    """After ``rm -r`` on a file system: remove the directories it emptied, bottom-up (and
    the location itself unless it is a tier's root); a directory still holding anything
    stays.  Walked from descriptors: a link (one swapped in since the delete included) is
    never followed, and nothing outside the location is removed."""
    with _local_tree(url) as got:
        if got is None:
            return
        parent, name, top = got
        for _d, dirs, _files, dfd in os.fwalk(
            ".", dir_fd=top, topdown=False, follow_symlinks=False
        ):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(d, dir_fd=dfd)
        if name and not keep_top:
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=parent)
