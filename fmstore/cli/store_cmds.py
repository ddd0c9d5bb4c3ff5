"""``fmstore ls``: list objects and prefixes (cp, du, rm are in object_cmds; stage, hydrate
and release in stage_cmds)."""

from __future__ import annotations

import datetime as dt
import os

import typer
from rich.console import Console
from rich.table import Table

from .. import runtime
from ..stores.base import ObjectMeta
from .main import app
from .util import human_bytes


@app.command("ls")
def ls(
    url: str = typer.Argument(..., help="Store URL or TIER:path to list."),
    recursive: bool = typer.Option(False, "--recursive", "-r", help="List every object below URL."),
    long: bool = typer.Option(False, "--long", "-l", help="Show size and modification time."),
    in_bytes: bool = typer.Option(
        False, "--bytes", "-b", help="Exact sizes in bytes, not human units."
    ),
) -> None:
    """List objects under URL (directories end in '/'), with a total.

    In a lazily staged directory, files listed but not fetched yet are shown too, marked
    'lazy' in the long format.
    """
    from ..errors import NotFound
    from ..tiering.stage import RESERVED_PREFIX, open_source

    try:
        store = open_source(url, role="location")
    except NotFound:
        # A directory of a lazy staging that holds nothing fetched yet.
        if not _lazy_entries(url, set(), recursive):
            raise
        listed: list[ObjectMeta] = []
    else:

        async def go() -> list[ObjectMeta]:
            try:
                return [m async for m in store.list("", recursive=recursive)]
            finally:
                await store.close()

        listed = runtime.run(go())
    entries = [
        m for m in listed if not m.key.rstrip("/").rsplit("/", 1)[-1].startswith(RESERVED_PREFIX)
    ]
    lazy = _lazy_entries(url, {m.key for m in entries}, recursive)
    fmt = (lambda n: str(n)) if in_bytes else human_bytes
    console = Console(highlight=False)
    if long:
        t = Table(box=None, show_header=True)
        t.add_column("size", justify="right")
        t.add_column("modified")
        t.add_column("key")
        rows = [(m.key, m) for m in entries] + [(k, None) for k in lazy]
        for key, m in sorted(rows, key=lambda r: r[0].encode()):
            if m is None:
                t.add_row(fmt(lazy[key][0]), "lazy", key)
                continue
            when = dt.datetime.fromtimestamp(m.mtime).strftime("%Y-%m-%d %H:%M") if m.mtime else ""
            t.add_row("" if m.is_dir else fmt(m.size), when, m.key)
        console.print(t)
    else:
        for key in sorted([m.key for m in entries] + list(lazy), key=str.encode):
            console.print(key)
    files = sum(1 for m in entries if not m.is_dir)
    total = sum(m.size for m in entries)
    dirs = sum(1 for m in entries if m.is_dir)
    line = f"{files} objects, {fmt(total)}"
    if in_bytes:
        line += " bytes"
    elif total >= 1024:
        line += f" ({total} bytes)"
    if dirs:
        line += f", {dirs} directories"
    if lazy:
        n, size = sum(c for _s, c in lazy.values()), sum(s for s, _c in lazy.values())
        line += f"; {n} more listed lazily ({fmt(size)}, not fetched yet)"
    console.print(f"[dim]{line}[/dim]")


def _lazy_entries(url: str, present: set[str], recursive: bool) -> dict[str, tuple[int, int]]:
    """Keys (relative to ``url``) of a lazy index that are not present locally, with their
    sizes and file counts (1); without ``recursive``, a directory holding only such files
    appears as one entry (``dir/``) with their total size and count."""
    from ..errors import ConfigError
    from ..tiering import lazy

    try:
        path = lazy.local_dir(url)
    except ConfigError:
        return {}
    if os.path.isfile(path):
        return {}
    found = lazy.find_index(path)
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
