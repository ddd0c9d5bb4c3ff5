"""``fmstore gc``: the daemon's orphan sweep, run by hand on one tier or prefix."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from .. import runtime
from .main import app
from .progress import make_console
from .util import human_bytes, printable


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n:
            return f"{seconds / n:.1f} {unit}"
    return f"{seconds:.0f} s"


@app.command("gc")
def gc_cmd(
    location: str = typer.Argument(
        ...,
        help="A tier or a prefix on one: TIER: (with the colon), TIER:PREFIX (like "
        "s3:runs/a), a path or a URL; it must exist.",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", "-n", help="Show what would go (kind, size, age); remove nothing."
    ),
    older_than: str = typer.Option(
        None,
        "--older-than",
        help="Grace period: leave what changed more recently than this (like 30m, 2h, 0). "
        "Default: orphan_grace of the daemon's config section (1h).",
        show_default=False,
    ),
    show_kept: bool = typer.Option(False, "--show-kept", help="List what was kept, and why."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object instead of a table."),
) -> None:
    """Remove what crashed writers left: unfinished S3 multipart uploads, temp files,
    checkpoint generations no manifest names, and journals of dead copies.

    Committed checkpoints are never touched, nor anything under the destination of a copy
    still running on this node, nor anything that changed within the grace period (a write
    in progress on another node).  The daemon runs the same sweep at start and then
    periodically.
    """
    from ..config import get_config
    from ..stores import Location
    from ..tiering.policy.sweep import SweepReport, sweep
    from ..tiering.service.daemon import settings_from_config
    from ..units import parse_duration

    config = get_config()
    grace = (
        settings_from_config(config).orphan_grace
        if older_than is None
        else parse_duration(older_than, "--older-than", allow_zero=True)
    )
    loc = Location.parse(location, config)
    # A sweep only removes: a location that is not there is an error (as for ls), never
    # something to create, least of all for a dry run.
    loc.check_exists()
    store = loc.open(tier=loc.tier)

    async def go() -> SweepReport:
        try:
            return await sweep(
                config, {loc.tier or loc.scheme: store}, grace=grace, dry_run=dry_run
            )
        finally:
            await store.close()

    rep = runtime.run(go())
    shown = rep.orphans if show_kept else rep.removed
    verb = "would remove" if dry_run else "removed"
    if json_out:
        doc = {
            "location": store.url,
            "dry_run": dry_run,
            "grace_seconds": grace,
            "orphans": [o.__dict__ for o in shown],
            "removed": len(rep.removed),
            "bytes": rep.bytes_reclaimed,
            "kept": len(rep.orphans) - len(rep.removed),
            "errors": rep.errors,
        }
        typer.echo(json.dumps(doc, indent=2))
    else:
        console = make_console()
        if shown:
            t = Table()
            for col, just in (
                ("kind", "left"),
                ("where", "left"),
                ("size", "right"),
                ("idle", "right"),
                ("action", "left"),
            ):
                t.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
            for o in shown:
                t.add_row(o.kind, printable(o.where), human_bytes(o.size), _age(o.age), o.action)
            console.print(t)
        kept = len(rep.orphans) - len(rep.removed)
        n = len(rep.removed)
        console.print(
            f"{verb} {n} orphan{'' if n == 1 else 's'} ({human_bytes(rep.bytes_reclaimed)}) "
            f"in {store.url}; kept {kept} (live or changed within {_age(grace)})",
            highlight=False,
        )
        for e in rep.errors:
            make_console(stderr=True).print(f"[red]error:[/red] {printable(e)}", highlight=False)
    if rep.errors:
        raise typer.Exit(1)
