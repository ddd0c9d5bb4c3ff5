"""Object commands: cp, du, rm (ls is in store_cmds).  Exit codes: :mod:`.progress`."""

from __future__ import annotations

import os
import re

import typer

from .. import runtime
from ..errors import ConfigError
from ..stores import open_store, split_tier
from ..tiering.stage import local_dir, open_source
from ..tiering.transfer import CopyItem, TransferOptions, TransferReport, copy_items, version_of
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
from .util import human_bytes


def _is_local_file(url: str) -> bool:
    path = local_dir(url)
    return path is not None and os.path.isfile(path)


def split_object(url: str) -> tuple[str, str]:
    """``s3://b/p/k`` → ``("s3://b/p", "k")``; ``nvme:a/k`` → ``("nvme:a", "k")``; paths too."""
    tier, rest = split_tier(url)
    if tier is not None:
        head, _, tail = rest.rstrip("/").rpartition("/")
        if not tail:
            raise ConfigError(f"{url!r} names a tier root, not an object")
        return f"{tier}:{head}", tail
    m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)(.*)$", url)
    if m and m.group(1).lower() != "file://":
        scheme, rest = m.groups()
        head, sep, tail = rest.rstrip("/").rpartition("/")
        if not sep or not tail:
            raise ConfigError(f"{url!r} names a bucket, not an object")
        return scheme + head, tail
    path = os.path.abspath(os.path.expanduser(url[len("file://") :] if m else url))
    return os.path.dirname(path), os.path.basename(path)


@app.command("cp")
def cp_cmd(
    src: str = typer.Argument(..., help="Source object (path, s3://bucket/key, TIER:path/key)."),
    dst: str = typer.Argument(..., help="Destination object, or a directory/prefix ending in '/'."),
    verify: bool = typer.Option(False, "--verify", help="Re-read the copy and compare checksums."),
    force: bool = typer.Option(
        False, "--force", "-f", help="Copy even when an identical copy is present."
    ),
    preserve_owner_flag: bool | None = typer.Option(
        None, "--preserve-owner/--no-preserve-owner", help=PRESERVE_OWNER_HELP
    ),
) -> None:
    """Copy one object between any two locations (checksummed, atomic)."""
    topts = TransferOptions(
        verify=verify, skip_identical=not force, preserve_owner=preserve_owner(preserve_owner_flag)
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

    report = runtime.run(go())
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
) -> None:
    """Disk usage: bytes and file counts per top-level directory, and the total."""
    from ..tiering.stage import list_tree

    if _is_local_file(url):
        parent, key = split_object(url)
        tree = {key: runtime.run(open_store(parent).stat(key))}
    else:
        tree = runtime.run(list_tree(open_source(url, role="location")))
    fmt = (lambda n: str(n)) if in_bytes else human_bytes
    groups: dict[str, list[int]] = {}
    for k, m in tree.items():
        top = k.split("/", 1)[0] + ("/" if "/" in k else "")
        g = groups.setdefault(top, [0, 0])
        g[0] += m.size
        g[1] += 1
    out = console()
    if not summarize:
        for top in sorted(groups):
            size, n = groups[top]
            out.print(f"{fmt(size):>12}  {n:>9} files  {top}")
    total = sum(m.size for m in tree.values())
    out.print(f"{fmt(total):>12}  {len(tree):>9} files  total")


@app.command("rm")
def rm_cmd(
    url: str = typer.Argument(..., help="Object to delete, or a prefix with --recursive."),
    recursive: bool = typer.Option(
        False, "--recursive", "-r", help="Delete every object under URL."
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Delete an object, or every object under a prefix (asks first unless --yes)."""
    if recursive and not _is_local_file(url):  # ``rm -r FILE`` deletes the file, as rm does
        from ..tiering.stage import list_tree

        store = open_source(url, role="location")
        keys = sorted(runtime.run(list_tree(store)))
        if not keys:
            typer.echo(f"nothing under {url}", err=True)
            return
        total = f"{len(keys)} object(s) under {url}"
    else:
        parent, key = split_object(url)
        store = open_store(parent)
        runtime.run(store.stat(key))  # NotFound → a clear error, exit 1
        keys = [key]
        total = url
    if not ask_yes(f"Delete {total}?", yes):
        raise typer.Exit(EXIT_USAGE)

    async def go() -> None:
        for i in range(0, len(keys), 1000):
            await store.delete_many(keys[i : i + 1000])

    runtime.run(go())
    typer.echo(f"deleted {len(keys)} object(s)", err=True)
