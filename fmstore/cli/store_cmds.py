"""Object-level commands: ls (a fuller stage / cp / rm / du arrive with the staging engine)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from .. import runtime
from ..stores import open_store
from .main import app
from .util import human_bytes


@app.command("ls")
def ls(
    url: str = typer.Argument(..., help="Store URL or TIER:path to list."),
    recursive: bool = typer.Option(False, "--recursive", "-r", help="List every object below URL."),
    long: bool = typer.Option(False, "--long", "-l", help="Show size and modification time."),
) -> None:
    """List objects under URL (directories end in '/'), with a total."""
    store = open_store(url)

    async def go():
        return [m async for m in store.list("", recursive=recursive)]

    entries = runtime.run(go())
    console = Console()
    total = sum(m.size for m in entries)
    if long:
        t = Table(box=None, show_header=True)
        t.add_column("size", justify="right")
        t.add_column("modified")
        t.add_column("key")
        import datetime as dt

        for m in entries:
            when = dt.datetime.fromtimestamp(m.mtime).strftime("%Y-%m-%d %H:%M") if m.mtime else ""
            t.add_row("" if m.is_dir else human_bytes(m.size), when, m.key)
        console.print(t)
    else:
        for m in entries:
            console.print(m.key, highlight=False)
    files = sum(1 for m in entries if not m.is_dir)
    console.print(f"[dim]{files} objects, {human_bytes(total)}[/dim]")
