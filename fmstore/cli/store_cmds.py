"""``fmstore ls``: list objects and prefixes (cp, du, rm are in object_cmds; stage, hydrate
and release in stage_cmds)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re

import typer

from .. import runtime
from ..errors import ConfigError, PermissionDenied
from ..stores.base import ObjectMeta, Store
from .main import app
from .util import human_bytes, is_root, plural, printable, split_object

_GLOB_CHARS = re.compile(r"[*?\[]")


@app.command("ls")
def ls(
    url: str = typer.Argument(
        ...,
        help="Store URL or TIER:path to list: a prefix, one object, or a glob in the last "
        "path segment (quote it: 's3:ds/*.fms').",
    ),
    recursive: bool = typer.Option(False, "--recursive", "-r", help="List every object below URL."),
    long: bool = typer.Option(False, "--long", "-l", help="Show size and modification time."),
    in_bytes: bool = typer.Option(
        False, "--bytes", "-b", help="Exact sizes in bytes, not human units."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the entries and totals as one JSON object on stdout."
    ),
) -> None:
    """List objects under URL (directories end in '/'), with a total.

    URL may also name one object, or end in a glob ('*' and '?' within a name, '[abc]');
    with --recursive a glob matches names at any depth. A location with nothing there is
    an error (exit 1), on S3 as on a file system.

    In a lazily staged directory, files listed but not fetched yet are shown too, marked
    'lazy' in the long format.
    """
    from ..tiering.staging.stage import RESERVED_PREFIX

    entries, lazy = _entries(url, recursive)
    entries = [
        m for m in entries if not m.key.rstrip("/").rsplit("/", 1)[-1].startswith(RESERVED_PREFIX)
    ]
    files = sum(1 for m in entries if not m.is_dir)
    total = sum(m.size for m in entries)
    dirs = sum(1 for m in entries if m.is_dir)
    if as_json:
        rows: list[dict[str, object]] = [
            {"key": m.key, "size": m.size, "mtime": m.mtime, "is_dir": m.is_dir, "lazy": False}
            for m in entries
        ]
        rows += [
            {"key": k, "size": size, "mtime": None, "is_dir": k.endswith("/"), "lazy": True}
            for k, (size, _n) in lazy.items()
        ]
        rows.sort(key=lambda r: str(r["key"]).encode())
        doc = {
            "url": url,
            "entries": rows,
            "files": files,
            "dirs": dirs,
            "bytes": total,
            "lazy_files": sum(n for _s, n in lazy.values()),
            "lazy_bytes": sum(s for s, _n in lazy.values()),
        }
        typer.echo(json.dumps(doc))
        return
    # rich on demand: loading it (30 ms) would delay the listing's first request.
    from rich.table import Table

    from .progress import console as make_console

    fmt = (lambda n: str(n)) if in_bytes else human_bytes
    console = make_console()
    if long:
        t = Table(box=None, show_header=True)
        t.add_column("size", justify="right")
        t.add_column("modified")
        t.add_column("key")
        rows2 = [(m.key, m) for m in entries] + [(k, None) for k in lazy]
        for key, m in sorted(rows2, key=lambda r: r[0].encode()):
            if m is None:
                t.add_row(fmt(lazy[key][0]), "lazy", printable(key))
                continue
            when = dt.datetime.fromtimestamp(m.mtime).strftime("%Y-%m-%d %H:%M") if m.mtime else ""
            t.add_row("" if m.is_dir else fmt(m.size), when, printable(m.key))
        console.print(t)
    else:
        for key in sorted([m.key for m in entries] + list(lazy), key=str.encode):
            console.print(printable(key, markup=False), markup=False)
    line = f"{plural(files, 'object')}, {fmt(total)}"
    if in_bytes:
        line += " bytes"
    elif total >= 1024:
        line += f" ({total} bytes)"
    if dirs:
        line += f", {plural(dirs, 'directory', 'directories')}"
    if lazy:
        n, size = sum(c for _s, c in lazy.values()), sum(s for s, _c in lazy.values())
        line += f"; {n} more listed lazily ({fmt(size)}, not fetched yet)"
    console.print(f"[dim]{printable(line)}[/dim]")


def _entries(url: str, recursive: bool) -> tuple[list[ObjectMeta], dict[str, tuple[int, int]]]:
    """What ``ls URL`` shows: the listing under a prefix, one object, or a glob's matches
    (keys relative to the listed prefix), and the lazy index's entries not present."""
    from ..errors import NotFound
    from ..tiering.staging.stage import compile_glob, local_dir, open_source

    path = local_dir(url)
    if path is not None and os.path.isfile(path):
        return [_stat_one(url)], {}
    parent, _, pattern = url.rstrip("/").rpartition("/")
    is_glob = bool(pattern and _GLOB_CHARS.search(pattern)) and not (
        path is not None and os.path.exists(path)
    )
    if is_glob:
        if _GLOB_CHARS.search(parent):
            raise typer.BadParameter(
                f"{url!r}: a glob may only be in the last path segment", param_hint="URL"
            )
        try:
            match = compile_glob(pattern)
        except ConfigError as e:
            raise typer.BadParameter(e.message, param_hint="URL") from None
        listed = _list(open_source(parent, role="location"), recursive)
        found = [m for m in listed if match.fullmatch(m.key.rstrip("/"))]
        if not found:
            raise NotFound(f"no objects match {url!r}")
        return found, {}
    try:
        store = open_source(url, role="location")
    except NotFound:
        # A directory of a lazy staging that holds nothing fetched yet.
        lazy = _lazy_entries(url, set(), recursive)
        if not lazy:
            raise
        return [], lazy
    listed = _list(store, recursive)
    lazy = _lazy_entries(url, {m.key for m in listed}, recursive)
    if listed or lazy or path is not None or is_root(url):
        return listed, lazy
    # An S3 (or other remote) URL with nothing below it: one object, or nothing at all.
    try:
        return [_stat_one(url)], {}
    except (NotFound, ConfigError):
        raise NotFound(f"location {url!r} does not exist (no object or prefix)") from None


def _list(store: Store, recursive: bool) -> list[ObjectMeta]:
    async def go() -> list[ObjectMeta]:
        try:
            return [m async for m in store.list("", recursive=recursive)]
        finally:
            await store.close()

    return runtime.run(go())


def _stat_one(url: str) -> ObjectMeta:
    """The object ``url`` names, keyed by its name."""
    from ..stores import open_store

    parent, key = split_object(url)
    store = open_store(parent)

    async def go() -> ObjectMeta:
        try:
            return await store.stat(key)
        finally:
            await store.close()

    return dataclasses.replace(runtime.run(go()), key=key)


def _lazy_entries(url: str, present: set[str], recursive: bool) -> dict[str, tuple[int, int]]:
    """Keys (relative to ``url``) of a lazy index that are not present locally, with their
    sizes and file counts (1); without ``recursive``, a directory holding only such files
    appears as one entry (``dir/``) with their total size and count."""
    from ..tiering.staging import lazy

    try:
        path = lazy.local_dir(url)
    except ConfigError:
        return {}
    if os.path.isfile(path):
        return {}
    try:
        found = lazy.find_index(path)
    except PermissionDenied as denied:  # someone else's index: not used, and said so
        typer.echo(f"warning: {denied}", err=True)
        return {}
    if found is None:
        return {}
    idx, prefix = found
    out: dict[str, tuple[int, int]] = {}
    cut = len(prefix) + 1 if prefix else 0
    for e in idx.under(prefix):
        rel = e.key[cut:]
        if rel in present:
            continue
        if not recursive and "/" in rel:
            top = rel.split("/", 1)[0] + "/"
            if top in present:
                continue
            rel = top
        size, n = out.get(rel, (0, 0))
        out[rel] = (size + e.size, n + 1)
    return out
