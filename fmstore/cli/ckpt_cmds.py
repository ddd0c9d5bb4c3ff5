"""``fmstore ckpt``: inspect, verify, gc and convert checkpoints."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import typer
from rich.progress import BarColumn, TextColumn
from rich.table import Table

from .. import runtime
from ..stores.base import Store
from .main import ckpt
from .progress import byte_columns, make_console, print_titled, progress_bar
from .util import human_bytes, plural, printable

if TYPE_CHECKING:
    from ..checkpoint.sources import SourceFile
    from ..format.manifest import Manifest


def _manifest(uri: str) -> tuple[Store, Manifest]:
    # Imported here: the checkpoint package loads torch, which every other command
    # (stage, ls, cp) would otherwise pay for at start-up (seconds).
    from ..checkpoint.api import open_location
    from ..checkpoint.commit import read_manifest

    store, _ = open_location(uri, for_read=True)
    return store, runtime.run(read_manifest(store))


@ckpt.command("inspect")
def inspect(
    uri: str = typer.Argument(..., help="Checkpoint location (path, file://, s3://, TIER:path)."),
    limit: int = typer.Option(0, "--limit", "-n", help="Show at most N tensors (0: all)."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the tensors and totals as one JSON object on stdout."
    ),
) -> None:
    """Tensor table: name, dtype, shape, bytes, codec and compression ratio; totals.
    Also for torch.save and safetensors files and Hugging Face directories (what
    `ckpt convert` reads), local or on any tier."""
    from ..checkpoint.dcp.api import is_dcp_checkpoint
    from ..checkpoint.sources import source_file

    src = source_file(uri)
    if src is not None:
        with src:
            _inspect_file(src, limit, as_json)
        return
    if is_dcp_checkpoint(uri):
        _inspect_dcp(uri, limit, as_json)
        return
    store, m = _manifest(uri)
    if as_json:
        _inspect_json(store.url, m, limit)
        return
    console = make_console()
    title = f"{store.url}  (format v{m.version}, {m.writer}, generation {m.generation})"
    t = Table()
    for col, just in (
        ("name", "left"),
        ("dtype", "left"),
        ("shape", "left"),
        ("bytes", "right"),
        ("codec", "left"),
        ("ratio", "right"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    shown = m.tensors if limit <= 0 else m.tensors[:limit]
    seen: set[int] = set()
    for e in shown:
        s = m.storages[e.storage]
        codecs = sorted({c.codec for c in s.chunks}) or ["-"]
        stored = sum(c.length for c in s.chunks)
        ratio = f"{s.nbytes / stored:.2f}" if stored else "-"
        shared = e.storage in seen
        seen.add(e.storage)
        nbytes = e.numel * _itemsize(e.dtype)
        t.add_row(
            printable(e.name) + (" (shares storage)" if shared else ""),
            printable(e.dtype),
            "x".join(map(str, e.shape)) or "scalar",
            human_bytes(nbytes),
            printable("+".join(codecs)),
            ratio if not shared else "",
        )
    print_titled(console, printable(title, markup=False), t)
    raw, stored = m.nbytes, m.stored_bytes
    ratio = f"{raw / stored:.2f}" if stored else "-"
    console.print(
        f"{plural(len(m.tensors), 'tensor')} in {plural(len(m.storages), 'storage')}, "
        f"{plural(len(m.blobs), 'blob')}: "
        f"{human_bytes(raw)} raw, {human_bytes(stored)} stored (ratio {ratio})"
    )


def _inspect_file(src: SourceFile, limit: int, as_json: bool) -> None:
    """The tensors of a torch.save or safetensors file or a Hugging Face directory (read
    whole: these formats have no index of sizes without their tensors)."""
    from ..checkpoint.convert import flatten_tensors
    from ..checkpoint.sources import read_source
    from ..format.dtypes import dtype_name

    flat = flatten_tensors(read_source(src))
    rows = [
        (k, dtype_name(t.dtype) or str(t.dtype), list(t.shape), t.numel() * t.element_size())
        for k, t in flat.items()
    ]
    total = sum(r[3] for r in rows)
    shown = rows if limit <= 0 else rows[:limit]
    if as_json:
        tensors = [{"name": n, "dtype": d, "shape": sh, "bytes": b} for n, d, sh, b in shown]
        doc = {"url": src.name, "format": src.kind, "tensors": tensors}
        typer.echo(json.dumps({**doc, "tensor_count": len(rows), "bytes": total}))
        return
    console = make_console()
    t = Table()
    for col, just in (("name", "left"), ("dtype", "left"), ("shape", "left"), ("bytes", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for n, d, sh, b in shown:
        t.add_row(printable(n), printable(d), "x".join(map(str, sh)) or "scalar", human_bytes(b))
    print_titled(console, printable(f"{src.name}  ({src.kind})", markup=False), t)
    console.print(f"{plural(len(rows), 'tensor')}: {human_bytes(total)}")


def _inspect_json(url: str, m: Manifest, limit: int) -> None:
    seen: set[int] = set()
    tensors = []
    for e in m.tensors if limit <= 0 else m.tensors[:limit]:
        s = m.storages[e.storage]
        tensors.append(
            {
                "name": e.name,
                "dtype": e.dtype,
                "shape": list(e.shape),
                "bytes": e.numel * _itemsize(e.dtype),
                "codecs": sorted({c.codec for c in s.chunks}),
                "storage": e.storage,
                "shares_storage": e.storage in seen,
            }
        )
        seen.add(e.storage)
    doc = {
        "url": url,
        "format": "fmstore",
        "version": m.version,
        "writer": m.writer,
        "generation": m.generation,
        "tensors": tensors,
        "tensor_count": len(m.tensors),
        "storages": len(m.storages),
        "blobs": len(m.blobs),
        "bytes": m.nbytes,
        "stored_bytes": m.stored_bytes,
    }
    typer.echo(json.dumps(doc))


def _itemsize(name: str) -> int:
    from ..format.dtypes import ITEMSIZES

    return ITEMSIZES.get(name, 1)


@ckpt.command("verify")
def verify(
    uri: str = typer.Argument(
        ..., help="Checkpoint location; with --all-tiers, a run root (like runs/llama)."
    ),
    all_tiers: bool = typer.Option(
        False,
        "--all-tiers",
        help="Verify every checkpoint of the run root URI on every tier of fmstore.toml.",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the result as one JSON object on stdout."
    ),
) -> None:
    """Check every chunk's checksum (both formats); exit 1 naming the bad chunks."""
    from ..checkpoint.api import open_location
    from ..checkpoint.verify import read_any_manifest, verify_checkpoint

    if all_tiers:
        from .ckpt_tier_cmds import verify_all_tiers

        raise typer.Exit(verify_all_tiers(uri, as_json=as_json))
    store, _ = open_location(uri, for_read=True)
    _, m = runtime.run(read_any_manifest(store, native=True))
    m, part = _node_part(m, store, uri)
    with progress_bar(TextColumn("verifying"), BarColumn(), *byte_columns()) as progress:
        total = m.part_bytes(part) if part else m.stored_bytes
        task = progress.add_task("verify", total=total)
        res = runtime.run(verify_checkpoint(store, m, progress=lambda n: progress.advance(task, n)))
    if as_json:
        doc = {
            "url": store.url,
            "ok": res.ok,
            "chunks": res.chunks,
            "bytes": res.bytes,
            "problems": list(res.problems),
        }
        if part:
            doc["part"] = part
        typer.echo(json.dumps(doc))
        if not res.ok:
            raise typer.Exit(1)
        return
    out = make_console()
    if not res.ok:
        for problem in res.problems:
            out.print(f"[red]BAD[/red] {printable(problem)}", highlight=False)
        out.print(f"{len(res.problems)} problem(s) in {store.url}", markup=False)
        raise typer.Exit(1)
    where = f" (the part of node {part})" if part else ""
    out.print(
        f"ok: {plural(res.chunks, 'chunk')}, {human_bytes(res.bytes)} verified in "
        f"{store.url}{where}"
    )


def _node_part(m: Any, store: Store, uri: str) -> tuple[Any, str]:
    """A sharded checkpoint in node parts on a node-local tier: this node's part of ``m``
    and the node's id (the other nodes' blobs are not here to verify); else ``m`` and ''
    (on a shared tier every part is checked)."""
    from ..format.manifest import Manifest

    if isinstance(m, Manifest):
        return m, ""
    from ..checkpoint.dcp.manifest import DcpManifest
    from ..checkpoint.dcp.nodes import node_id, tier_scope

    if not isinstance(m, DcpManifest) or not m.parts or tier_scope(uri) != "node":
        return m, ""
    me = node_id()
    view = m.part_view(me)
    if view is None:
        from ..errors import NotFound

        raise NotFound(
            f"this node ({me}) holds no part of {store.url}; its parts are on nodes "
            f"{', '.join(p.node for p in m.parts)}",
            tier=store.tier,
        )
    return view, me


def _inspect_dcp(uri: str, limit: int, as_json: bool = False) -> None:
    """The table for a multi-rank (torch.distributed.checkpoint) checkpoint."""
    from ..checkpoint.dcp.api import inspect_checkpoint

    m, rows = inspect_checkpoint(uri)
    native = not hasattr(m, "generation")  # torch's own layout: no generation, no blobs
    if as_json:
        entries = [
            {
                "name": r.fqn,
                "kind": r.kind,
                "dtype": r.dtype if r.kind == "tensor" else None,
                "shape": list(r.shape),
                "shards": r.shards,
                "bytes": r.nbytes,
                "stored_bytes": r.stored,
                "codecs": list(r.codecs),
            }
            for r in (rows if limit <= 0 else rows[:limit])
        ]
        doc = {
            "url": uri,
            "format": "dcp-native" if native else "dcp",
            "version": m.version,
            "world_size": m.world_size,
            "generation": getattr(m, "generation", None),
            "entries": entries,
            "entry_count": len(rows),
            "items": len(m.items),
            "blobs": len(getattr(m, "blobs", m.items)),
            "bytes": m.nbytes,
            "stored_bytes": m.stored_bytes,
        }
        typer.echo(json.dumps(doc))
        return
    console = make_console()
    ranks = plural(m.world_size, "rank")
    title = (
        f"{uri}  (native torch DCP, {ranks}, DCP version {m.version})"
        if native
        else f"{uri}  (DCP, {ranks}, format v{m.version}, generation {m.generation})"  # type: ignore[union-attr]
    )
    t = Table()
    for col, just in (
        ("name", "left"),
        ("dtype", "left"),
        ("shape", "left"),
        ("shards", "right"),
        ("bytes", "right"),
        ("codec", "left"),
        ("ratio", "right"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rows if limit <= 0 else rows[:limit]:
        t.add_row(
            printable(r.fqn),
            printable(r.dtype) if r.kind == "tensor" else "(object)",
            "x".join(map(str, r.shape)) or ("scalar" if r.kind == "tensor" else "-"),
            str(r.shards),
            human_bytes(r.nbytes),
            printable("+".join(r.codecs)) or "-",
            f"{r.nbytes / r.stored:.2f}" if r.stored else "-",
        )
    print_titled(console, printable(title, markup=False), t)
    raw, stored = m.nbytes, m.stored_bytes
    ratio = f"{raw / stored:.2f}" if stored else "-"
    files = len(m.files) if native else len(m.blobs)  # type: ignore[union-attr]
    console.print(
        f"{plural(len(rows), 'entry', 'entries')} in {plural(len(m.items), 'saved item')}, "
        f"{plural(files, 'file' if native else 'blob')} from "
        f"{ranks}: {human_bytes(raw)} raw, {human_bytes(stored)} stored (ratio {ratio})"
    )


def _live_copies() -> list[str]:
    """Destinations of this node's copies in progress (their journals in the state
    directory), when a config is there to name it; gc keeps what lies under them."""
    from ..config import get_config
    from ..errors import FmstoreError
    from ..tiering.copy.journal import live_destinations

    try:
        return live_destinations(get_config().state_dir)
    except (FmstoreError, OSError):
        return []


@ckpt.command("gc")
def gc_cmd(
    root: str = typer.Argument(..., help="Directory or prefix holding checkpoints."),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Only show what would be removed."),
    older_than_s: str = typer.Option(
        "1h",
        "--older-than",
        help="Leave leftovers younger than this (like 30m, 2h, 0, or seconds): saves may "
        "still be running.",
    ),
) -> None:
    """Remove leftovers of crashed or superseded saves; committed checkpoints are kept."""
    from ..checkpoint.gc import gc
    from ..stores.location import open_existing
    from ..units import parse_duration

    older_than = parse_duration(older_than_s, "--older-than", allow_zero=True)
    store = open_existing(root)
    try:
        rep = gc(store, older_than=older_than, dry_run=dry_run, live=_live_copies())
    finally:
        runtime.run(store.close())
    console = make_console()
    verb = "would remove" if dry_run else "removed"
    for key in rep.removed:
        console.print(f"{verb} {printable(key, markup=False)}", highlight=False, markup=False)
    for y in rep.young:
        console.print(
            f"[dim]kept (younger than {older_than:.0f} s): {printable(y)}[/dim]", highlight=False
        )
    for p in rep.pending:
        console.print(
            f"[dim]kept (pending part of a sharded checkpoint; a restore decides): {printable(p)}[/dim]",
            highlight=False,
        )
    for x in rep.exporting:
        console.print(
            f"[dim]kept (an export writes there now): {printable(x)}[/dim]", highlight=False
        )
    for u in rep.unreadable:
        console.print(
            f"[yellow]unreadable manifest, left alone: {printable(u or '.')}[/yellow]",
            highlight=False,
        )
    console.print(
        f"{plural(len(rep.checkpoints), 'committed checkpoint')}; {verb} "
        f"{plural(len(rep.removed), 'object')} ({human_bytes(rep.removed_bytes)}), "
        f"{plural(rep.temp_files, 'temp file')}"
    )


@ckpt.command("convert")
def convert_cmd(
    src: str = typer.Argument(
        ...,
        help="fmstore checkpoint (single-process or multi-rank DCP), a torch DCP directory, "
        "torch.save file (.pt/.pth/.bin), .safetensors, or a Hugging Face save_pretrained "
        "directory (model.safetensors, or shards and model.safetensors.index.json).",
    ),
    dst: str = typer.Argument(..., help="Destination, same kinds (told by the name)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing destination."),
    compression: str = typer.Option("auto", "--compression", help="For fmstore destinations."),
    to: str = typer.Option(
        "",
        "--to",
        help="'dcp': write DST as a torch.distributed.checkpoint directory (.metadata + "
        ".distcp files) that torch's FileSystemReader loads; 'hf': as a Hugging Face "
        "save_pretrained directory that from_pretrained loads.",
    ),
    keys: list[str] = typer.Option(  # noqa: B008
        [],
        "--keys",
        help="Only the entries named (a sub-tree like 'model', a dotted name or a glob); "
        "repeat or separate with commas.",
    ),
    strip_prefix: str = typer.Option(
        "", "--strip-prefix", help="Remove this prefix from the flattened names ('model.')."
    ),
    max_shard_size: str = typer.Option(
        "",
        "--max-shard-size",
        help="Largest shard of a Hugging Face destination (like 500MB; default 5GB); "
        "implies --to hf.",
    ),
    config: str = typer.Option(
        "", "--config", help="A config.json to copy into a Hugging Face destination."
    ),
) -> None:
    """Convert weights between fmstore, torch DCP, torch.save files, safetensors and
    Hugging Face directories."""
    from ..checkpoint.convert import convert

    pats = [p.strip() for k in keys for p in k.split(",") if p.strip()]
    n = convert(
        src,
        dst,
        overwrite=overwrite,
        compression=compression,
        to=to or None,
        keys=pats or None,
        strip=strip_prefix or None,
        max_shard_size=max_shard_size or None,
        config=config or None,
    )
    make_console().print(
        f"converted {plural(n, 'tensor')}: {src} -> {dst}", highlight=False, markup=False
    )
