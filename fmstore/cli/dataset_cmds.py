"""``fmstore dataset``: convert data into fmstore shards, and inspect any dataset."""

from __future__ import annotations

import json
import os
from typing import Any

import typer
from rich.table import Table

from .main import HELP_MARKUP, app
from .progress import make_console
from .util import human_bytes, printable, size_option

dataset_app = typer.Typer(
    help="Write and inspect streaming datasets (fmstore shards, token streams, WebDataset, MDS, Parquet).",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)
app.add_typer(dataset_app, name="dataset")


@dataset_app.command("write")
def write(
    src: str = typer.Argument(
        ..., help="A local JSONL / text / .npy / .bin file, or a directory of them."
    ),
    dst: str = typer.Argument(
        ..., help="Where the dataset goes: a path, s3://…, memory://…, or TIER:path."
    ),
    shard_size: str = typer.Option("64MiB", "--shard-size", help="Target shard size (e.g. 64MiB)."),
    compression: str = typer.Option("none", "--compression", help="none or zstd."),
    input_format: str = typer.Option(
        "auto", "--format", help="Input type: auto, jsonl, text (a sample per file), files, tokens."
    ),
    dtype: str | None = typer.Option(
        None, "--dtype", help="Token dtype of raw .bin files (uint16, uint32)."
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace a dataset already at DST, removing the shards the new index does not name.",
    ),
) -> None:
    """Convert SRC into an fmstore dataset at DST (shards first, index.json last).

    A DST that already holds a dataset is refused unless --overwrite."""
    from rich.progress import BarColumn, TextColumn

    from ..loaders.writer import write_dataset
    from .progress import byte_columns, progress_bar

    total = _src_bytes(src)
    with progress_bar(
        TextColumn("[bold]writing"), BarColumn(), *byte_columns(),
        TextColumn("{task.fields[samples]} samples"), transient=True,
    ) as bar:  # fmt: skip
        task = bar.add_task("write", total=total or None, samples=0)

        def progress(read: int, samples: int) -> None:
            bar.update(task, completed=read, samples=samples)

        r = write_dataset(
            src,
            dst,
            input_format=input_format,
            shard_size=size_option(shard_size, "--shard-size"),
            compression=None if compression == "none" else compression,
            dtype=dtype,
            progress=progress,
            overwrite=overwrite,
        )
    noun = "tokens" if r.kind == "tokens" else "samples"
    make_console().print(
        f"wrote {r.shards} shards, {r.samples} {noun}, {human_bytes(r.bytes)} to {dst}",
        markup=False,
    )


def _src_bytes(src: str) -> int:
    if os.path.isfile(src):
        return os.path.getsize(src)
    total = 0
    for root, _dirs, files in os.walk(src):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


@dataset_app.command("inspect")
def inspect(
    url: str = typer.Argument(
        ..., help="Dataset location: a path, s3://…, memory://…, or TIER:path."
    ),
    format: str | None = typer.Option(
        None, "--format", help="fmstore, tokens, webdataset, mds or parquet (default: detect)."
    ),
    seq_len: int | None = typer.Option(
        None, "--seq-len", help="Sequence length, for token streams."
    ),
    dtype: str | None = typer.Option(None, "--dtype", help="Token dtype, for raw token files."),
    columns: str | None = typer.Option(
        None, "--columns", help="Parquet: comma-separated columns to read (default: all)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    shards: bool = typer.Option(False, "--shards", help="List every shard."),
) -> None:
    """Show a dataset's format, shards, samples and bytes."""
    from ..loaders.formats import FormatOptions, load_format
    from ..stores.location import open_existing

    cols = tuple(c.strip() for c in columns.split(",") if c.strip()) if columns else None
    fmt = load_format(
        open_existing(url, role="dataset"), FormatOptions(format, seq_len, dtype, columns=cols)
    )
    info = fmt.describe()
    rows: list[dict[str, Any]] = [
        {"key": s.key, "samples": s.samples, "bytes": s.size, "compression": s.compression}
        for s in fmt.shards
    ]
    if fmt.name == "parquet":  # a Parquet shard is a file, a sample a row
        for r, s in zip(rows, fmt.shards, strict=True):
            r["row_groups"] = len(s.extra["row_groups"])
    if as_json:
        typer.echo(
            json.dumps({**info, **({"shard_list": rows} if shards else {})}, indent=1, default=str)
        )
        return
    console = make_console()
    t = Table(box=None, show_header=False)
    words = {"shards": "files", "samples": "rows"} if fmt.name == "parquet" else {}
    for k, v in info.items():
        if k == "columns" and isinstance(v, dict):
            t.add_row(k, "\n".join(printable(f"{c}: {typ}") for c, typ in v.items()) or "-")
            continue
        t.add_row(words.get(k, k), human_bytes(v) if k == "bytes" else printable(v))
    console.print(t)
    if shards:
        st = Table(box=None)
        extra = ["row_groups"] if fmt.name == "parquet" else []
        for col in ("key", "samples", "bytes", "compression", *extra):
            st.add_column(col, justify="left" if col in ("key", "compression") else "right")
        for r in rows:
            st.add_row(
                printable(r["key"]),
                str(r["samples"]),
                human_bytes(r["bytes"]),
                printable(r["compression"] or ""),
                *(str(r[c]) for c in extra),
            )
        console.print(st)
