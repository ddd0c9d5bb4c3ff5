"""Dataset commands: stage, hydrate, release, cp, du, rm.

Exit codes (also in docs/staging.md):

====  ==================================================================
0     everything done (or nothing to do)
1     error before or outside the copy: bad location, unreachable store,
      missing bucket, unreadable source, unknown tier, bad config
2     usage error: bad option value, malformed glob, bad --shard, or a
      deletion refused because --yes is missing on a non-interactive run
3     the run finished but some files failed (listed on stderr)
130   interrupted (Ctrl-C); re-run the same command to resume
====  ==================================================================
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import typer

from .. import runtime
from ..errors import ConfigError, NotFound
from ..stores import open_store, split_tier
from ..tiering import lazy as _lazy
from ..tiering.stage import (
    KeyFilter,
    StageOptions,
    check_destination,
    check_locations,
    journal_path,
    local_dir,
    open_source,
    parse_shard,
    plan_stage,
    preserve_owner_setting,
    run_plan,
    shard_from_env,
)
from ..tiering.transfer import (
    CopyItem,
    TransferOptions,
    TransferProgress,
    TransferReport,
    copy_items,
    version_of,
)
from .main import app
from .util import human_bytes, size_option

if TYPE_CHECKING:
    from rich.console import Console

T = TypeVar("T")

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _console(err: bool = False) -> Console:
    from rich.console import Console  # on demand: a copy logging to a file needs none

    return Console(stderr=err, highlight=False)


class _Interrupted(Exception):
    pass


def _run_with_progress(
    coro: Coroutine[Any, Any, T],
    progress: TransferProgress | None,
    label: str,
    show: bool,
    interval: float,
) -> T:
    """Run ``coro`` on the fmstore loop while showing ``progress``: a rich bar on a
    terminal, a log line every ``interval`` seconds otherwise.  Ctrl-C cancels the run,
    waits for it to leave its journal in order, and raises :class:`_Interrupted`."""
    finished = threading.Event()

    async def wrapped() -> T:
        try:
            return await coro
        finally:
            finished.set()

    fut = runtime.submit(wrapped())
    try:
        if progress is None or not show:
            return fut.result()
        if sys.stderr.isatty():
            return _rich_loop(fut, progress, label, _console(err=True))
        return _log_loop(fut, progress, label, interval)
    except KeyboardInterrupt:
        fut.cancel()
        finished.wait(30)
        raise _Interrupted() from None


def _rich_loop(fut: Any, p: TransferProgress, label: str, err: Console) -> Any:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
    ) as bar:
        task = bar.add_task(label, total=max(p.bytes_total, 1))
        while True:
            done = fut.done()
            failed = f" [red]{p.files_failed} failed[/red]" if p.files_failed else ""
            bar.update(
                task,
                completed=p.bytes_done,
                total=max(p.bytes_total, 1),
                description=f"{label} {p.files_done}/{p.files_total} files{failed}",
            )
            if done:
                return fut.result()
            time.sleep(0.1)


def _log_loop(fut: Any, p: TransferProgress, label: str, interval: float) -> Any:
    last = time.monotonic()
    while True:
        try:
            return fut.result(timeout=0.2)
        except cf.TimeoutError:
            pass
        now = time.monotonic()
        if now - last >= interval:
            last = now
            el = max(now - p.started, 1e-6)
            rate = p.bytes_copied / el
            left = max(p.bytes_total - p.bytes_done, 0)
            eta = f"{left / rate:.0f} s" if rate > 0 else "?"
            typer.echo(
                f"{label}: {p.files_done}/{p.files_total} files, {human_bytes(p.bytes_done)}/"
                f"{human_bytes(p.bytes_total)}, {human_bytes(rate)}/s, ETA {eta}"
                + (f", {p.files_failed} failed" if p.files_failed else ""),
                err=True,
            )


def _summary(report: TransferReport, *, verb: str = "copied") -> None:
    p = report.progress
    secs = max(report.seconds, 1e-6)
    rate = human_bytes(p.bytes_copied / secs) + "/s"
    line = (
        f"{verb} {p.files_copied} files ({human_bytes(p.bytes_copied)}), skipped {p.files_skipped} "
        f"identical ({human_bytes(p.bytes_skipped)})"
    )
    if p.bytes_resumed:
        line += f", resumed {human_bytes(p.bytes_resumed)} of earlier parts"
    line += f", {p.files_failed} failed, in {report.seconds:.1f} s ({rate})"
    typer.echo(line, err=True)
    _list_failures(report)


def _list_failures(report: TransferReport) -> None:
    if report.failures:
        typer.secho(f"{len(report.failures)} file(s) failed:", fg=typer.colors.RED, err=True)
        for f in report.failures[:200]:
            typer.echo(f"  FAILED {f.key}: {f.error}", err=True)
        if len(report.failures) > 200:
            typer.echo(f"  … and {len(report.failures) - 200} more", err=True)


def _confirm(question: str, yes: bool, declined: str = "Nothing deleted.") -> None:
    """Ask ``question``; a no (or no terminal to ask on, without ``--yes``) says
    ``declined`` and exits 2."""
    if yes:
        return
    if not sys.stdin.isatty():
        typer.secho(
            f"{question} Refusing without --yes (not a terminal). {declined}",
            fg=typer.colors.RED,
            err=True,
        )
        raise typer.Exit(EXIT_USAGE)
    if not typer.confirm(question, default=False, err=True):
        typer.echo(declined, err=True)
        raise typer.Exit(EXIT_USAGE)


_PRESERVE_OWNER_HELP = (
    "Restore owner and group from the source's metadata (FSx's file-owner / file-group) "
    "on a POSIX destination; default: [stage] preserve_owner in fmstore.toml (false). "
    "Only for sources whose writers you trust: metadata is set by whoever writes the object."
)


def _preserve_owner(flag: bool | None) -> bool:
    return preserve_owner_setting() if flag is None else flag


def _transfer_options(
    concurrency: int,
    bwlimit: str | None,
    part_size: str,
    verify: bool,
    fsync: str = "batch",
    preserve_owner: bool = False,
) -> TransferOptions:
    if concurrency < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--concurrency")
    part = size_option(part_size, "--part-size")
    if part < 1 << 20:
        raise typer.BadParameter("must be at least 1 MiB", param_hint="--part-size")
    return TransferOptions(
        concurrency=concurrency,
        bwlimit=float(size_option(bwlimit, "--bwlimit")) if bwlimit else None,
        part_size=part,
        multipart_threshold=max(part, 2 * part),
        # Enough parts in flight to keep a fast link busy (each is read as several ranges
        # at once), few enough that their buffers are reused rather than freshly faulted.
        max_inflight_bytes=max(4 * part, min(concurrency * part, 512 << 20)),
        verify=verify,
        fsync=_fsync_mode(fsync),
        preserve_owner=preserve_owner,
    )


def _fsync_mode(fsync: str) -> Literal["batch", "each", "none"]:
    modes: dict[str, Literal["batch", "each", "none"]] = {
        "batch": "batch",
        "each": "each",
        "none": "none",
    }
    mode = modes.get(fsync.strip().lower())
    if mode is not None:
        return mode
    raise typer.BadParameter(f"{fsync!r}: use batch, each or none", param_hint="--fsync")


def _shard(text: str) -> tuple[int, int] | None:
    t = text.strip().lower()
    if t in ("none", "off"):
        return None
    if t == "auto":
        return shard_from_env()
    try:
        k_n = parse_shard(text)
    except ConfigError as e:
        raise typer.BadParameter(e.message, param_hint="--shard") from None
    return k_n if k_n[1] > 1 else None


@app.command("stage")
def stage_cmd(
    src: str = typer.Argument(
        ..., help="Source: path, s3://bucket/prefix, TIER:path, any fsspec URL."
    ),
    dst: str = typer.Argument(..., help="Destination, same forms."),
    include: list[str] = typer.Option(
        [], "--include", "-i", help="Only keys matching this glob (repeatable)."
    ),
    exclude: list[str] = typer.Option(
        [], "--exclude", "-x", help="Leave out keys matching this glob (repeatable)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", "-n", help="Print the plan with totals; change nothing."
    ),
    delete: bool = typer.Option(
        False, "--delete", help="Delete destination files absent from the source (sync)."
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask before deleting."),
    concurrency: int = typer.Option(64, "--concurrency", "-c", help="Files (and parts) in flight."),
    bwlimit: str | None = typer.Option(None, "--bwlimit", help="Bandwidth limit, e.g. 200MiB/s."),
    part_size: str = typer.Option(
        "32MiB",
        "--part-size",
        help="Part size of big files (ranged reads, multipart writes): files over twice this "
        "go in parts; from S3 to a local disk, every file over 8 MiB, in parts of at most this.",
    ),
    shard: str = typer.Option(
        "auto",
        "--shard",
        help="K/N: stage shard K of N (K from 0 to N-1); auto: from SLURM_PROCID/SLURM_NTASKS "
        "or RANK/WORLD_SIZE; none.",
    ),
    lazy: bool = typer.Option(
        False, "--lazy", help="Write only the listing; files are fetched on first read."
    ),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Re-read every copied file at the destination and compare checksums.",
    ),
    fsync: str = typer.Option(
        "batch",
        "--fsync",
        help="Local destinations: 'batch' syncs every 30 s and before exiting (after a power "
        "cut the next run re-checks what the last sync did not cover); 'each' fsyncs every "
        "file and part (slower with many small files); 'none' never syncs (scratch data).",
    ),
    preserve_owner: bool | None = typer.Option(
        None, "--preserve-owner/--no-preserve-owner", help=_PRESERVE_OWNER_HELP
    ),
    json_out: bool = typer.Option(
        False, "--json", help="Print the final summary as JSON on stdout."
    ),
    progress: bool = typer.Option(
        True, "--progress/--no-progress", help="Progress bar (terminal) or log lines."
    ),
    interval: float = typer.Option(
        10.0, "--log-interval", help="Seconds between progress lines when not on a terminal."
    ),
) -> None:
    """Copy a dataset between any two locations: parallel, resumable, verified.

    Files already present and identical (same size and recorded checksum or source
    version) are skipped, so re-running is cheap; an interrupted run resumes where it
    stopped, big files included.

    Exit codes: 0 ok, 1 error, 2 usage, 3 some files failed, 130 interrupted.
    """
    topts = _transfer_options(
        concurrency, bwlimit, part_size, verify, fsync, _preserve_owner(preserve_owner)
    )
    if interval <= 0:
        raise typer.BadParameter("must be more than 0", param_hint="--log-interval")
    try:
        key_filter = KeyFilter.of(include, exclude)
    except ConfigError as e:
        raise typer.BadParameter(e.message, param_hint="--include/--exclude") from None
    k_n = _shard(shard)
    if lazy and delete:
        raise typer.BadParameter(
            "--lazy writes only a listing; it cannot be combined with --delete"
        )
    if lazy and k_n is not None and k_n[0] != 0:
        typer.echo(
            f"shard {k_n[0]}/{k_n[1]}: the lazy listing is written by shard 0 only; nothing to do",
            err=True,
        )
        return
    if lazy:
        k_n = None
    source = open_source(src)
    check_destination(source, dst, delete=delete)
    # A dry run must not even create the destination directory.
    local = local_dir(dst)
    missing = dry_run and local is not None and not os.path.exists(local)
    dest = open_store(tempfile.mkdtemp(prefix="fmstore-dry-run-") if missing else dst)
    if local is None:  # a remote destination, checked once open
        check_locations(source, dest, delete=delete)
    if k_n is not None:
        typer.echo(f"staging shard {k_n[0]}/{k_n[1]}", err=True)
    try:
        plan = runtime.run(
            plan_stage(source, dest, key_filter=key_filter, shard=k_n, delete=delete)
        )
    finally:
        if missing:
            os.rmdir(dest.url[len("file://") :])
    if not plan.src_listing:
        typer.echo(f"warning: source {src} has no files", err=True)
    if dry_run:
        _print_plan(plan, json_out, lazy)
        return
    if plan.delete:
        out = _console(err=True)
        out.print(f"{len(plan.delete)} file(s) at {dst} are not in {src} and will be deleted:")
        for k in plan.delete[:10]:
            out.print(f"  {k}")
        if len(plan.delete) > 10:
            out.print(f"  … and {len(plan.delete) - 10} more")
        _confirm(
            f"Delete {len(plan.delete)} file(s) from {dst}?",
            yes,
            "Nothing copied or deleted (run without --delete to copy only).",
        )
    try:
        _stage_run(
            src,
            dst,
            source,
            dest,
            plan,
            include,
            exclude,
            delete,
            k_n,
            lazy,
            topts,
            progress,
            interval,
            json_out,
        )
    finally:
        _close(source, dest)


def _close(*stores: Any) -> None:
    """Close stores (connection pools) so the process exits cleanly."""
    import asyncio
    import contextlib

    async def go() -> None:
        await asyncio.gather(*(s.close() for s in stores), return_exceptions=True)

    with contextlib.suppress(Exception):
        runtime.run(go(), timeout=30)


def _stage_run(
    src: str,
    dst: str,
    source: Any,
    dest: Any,
    plan: Any,
    include: list[str],
    exclude: list[str],
    delete: bool,
    k_n: tuple[int, int] | None,
    lazy: bool,
    topts: TransferOptions,
    progress: bool,
    interval: float,
    json_out: bool,
) -> None:
    prog = TransferProgress()
    opts = StageOptions(
        includes=tuple(include),
        excludes=tuple(exclude),
        delete=delete,
        shard=k_n,
        lazy=lazy,
        transfer=topts,
    )
    try:
        result = _run_with_progress(
            run_plan(source, dest, plan, opts, progress=prog, src_url=src),
            prog,
            "stage",
            progress and not lazy,
            interval,
        )
    except _Interrupted:
        typer.echo(
            f"Interrupted after {prog.files_done} files; run the same command again to resume.",
            err=True,
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if lazy:
        typer.echo(
            f"lazy listing of {result.lazy_entries} files written to {dst}; files are fetched on first read",
            err=True,
        )
        if result.lazy_dropped:
            typer.echo(
                f"dropped {len(result.lazy_dropped)} local copies of an earlier version "
                "(the next read fetches the listed one)",
                err=True,
            )
        for key in result.lazy_kept:
            typer.echo(
                f"  kept {key}: changed locally (or not fetched by fmstore); "
                "it may differ from the listed version",
                err=True,
            )
    else:
        _summary(result.report)
    if result.deleted or result.delete_failures:
        typer.echo(
            f"deleted {result.deleted} file(s), {len(result.delete_failures)} failed", err=True
        )
        for key, err in result.delete_failures:
            typer.echo(f"  FAILED delete {key}: {err}", err=True)
    if json_out:
        d = result.report.as_dict()
        d.update(
            deleted=result.deleted,
            delete_failures=len(result.delete_failures),
            lazy_entries=result.lazy_entries,
            lazy_dropped=len(result.lazy_dropped),
            lazy_kept=result.lazy_kept,
        )
        typer.echo(json.dumps(d))
    if not result.ok:
        raise typer.Exit(EXIT_FAILED)


def _print_plan(plan: Any, json_out: bool, lazy: bool) -> None:
    todo = plan.to_copy()
    same = plan.files - len(todo)
    if json_out:
        typer.echo(
            json.dumps(
                {
                    "files": plan.files,
                    "bytes": plan.bytes,
                    "to_copy_files": len(todo),
                    "to_copy_bytes": sum(i.size for i in todo),
                    "present_same_size": same,
                    "delete": len(plan.delete),
                    "lazy": lazy,
                    "copy_keys": [i.src_key for i in todo],
                    "delete_keys": plan.delete,
                }
            )
        )
        return
    out = _console()
    out.print(f"plan: {plan.files} files, {human_bytes(plan.bytes)} selected")
    out.print(f"  to copy: {len(todo)} files, {human_bytes(sum(i.size for i in todo))}")
    for i in todo[:10]:
        out.print(f"    {i.src_key}  ({human_bytes(i.size)})")
    if len(todo) > 10:
        out.print(f"    … and {len(todo) - 10} more")
    out.print(f"  already present with the same size (checked against checksums when run): {same}")
    if plan.delete:
        out.print(f"  to delete: {len(plan.delete)} files")
        for k in plan.delete[:10]:
            out.print(f"    {k}")
    out.print("dry run: nothing was changed")


@app.command("hydrate")
def hydrate_cmd(
    path: str = typer.Argument(..., help="A lazily staged directory or file (or a part of one)."),
    concurrency: int = typer.Option(64, "--concurrency", "-c", help="Files (and parts) in flight."),
    bwlimit: str | None = typer.Option(None, "--bwlimit", help="Bandwidth limit, e.g. 200MiB/s."),
    verify: bool = typer.Option(
        False, "--verify", help="Re-read every fetched file and compare checksums."
    ),
    progress: bool = typer.Option(
        True, "--progress/--no-progress", help="Progress bar (terminal) or log lines."
    ),
    json_out: bool = typer.Option(
        False, "--json", help="Print the final summary as JSON on stdout."
    ),
) -> None:
    """Fetch every not-yet-present file of a lazy staging under PATH.

    Files already fetched (by an earlier hydrate or a first read) and still identical to
    the source are skipped.

    Exit codes: 0 ok, 1 error, 3 some files failed, 130 interrupted."""
    topts = _transfer_options(concurrency, bwlimit, "32MiB", verify)
    found = _lazy.find_index(path)
    if found is None:
        raise NotFound(
            "not inside a lazily staged directory (no .fmstore-lazy.jsonl above it)", key=path
        )
    idx, prefix = found
    entries = idx.under(prefix)
    if not entries:
        raise NotFound("nothing in the lazy index under this path", key=path)
    prog = TransferProgress()

    async def go() -> TransferReport:
        import asyncio

        from ..tiering.journal import Journal

        src = open_store(idx.source)
        dst = open_store(idx.root)
        existing = {}
        async for m in dst.list(prefix if prefix and prefix not in idx.entries else ""):
            existing[m.key] = m
        # The staging's journal: an interrupted hydrate resumes the parts of big files.
        journal = await Journal.open(journal_path(src, dst))
        try:
            return await copy_items(
                src,
                dst,
                [e.item() for e in entries],
                topts,
                journal=journal,
                progress=prog,
                dst_existing=existing,
            )
        finally:
            await asyncio.shield(journal.close())

    try:
        report = _run_with_progress(go(), prog, "hydrate", progress, 10.0)
    except _Interrupted:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    _summary(report, verb="fetched")
    if json_out:
        typer.echo(json.dumps(report.as_dict()))
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


@app.command("release")
def release_cmd(
    path: str = typer.Argument(..., help="A lazily staged directory or file (or a part of one)."),
    json_out: bool = typer.Option(
        False, "--json", help="Print what was released and kept as JSON on stdout."
    ),
) -> None:
    """Drop the local copies of lazily staged files under PATH, keeping the listing.

    Only files whose local bytes match what was fetched and whose source still holds the
    same version are dropped (the next read fetches them again); the others are kept and
    listed with the reason."""
    res = _lazy.release(path)
    typer.echo(
        f"released {len(res.released)} files ({human_bytes(res.bytes_released)}); kept {len(res.kept)}",
        err=True,
    )
    for key, why in res.kept[:50]:
        typer.echo(f"  kept {key}: {why}", err=True)
    if json_out:
        typer.echo(
            json.dumps(
                {
                    "released": res.released,
                    "bytes_released": res.bytes_released,
                    "kept": [k for k, _ in res.kept],
                }
            )
        )


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
    preserve_owner: bool | None = typer.Option(
        None, "--preserve-owner/--no-preserve-owner", help=_PRESERVE_OWNER_HELP
    ),
) -> None:
    """Copy one object between any two locations (checksummed, atomic)."""
    topts = TransferOptions(
        verify=verify, skip_identical=not force, preserve_owner=_preserve_owner(preserve_owner)
    )
    s_parent, s_key = split_object(src)
    if os.path.isdir(dst) or dst.endswith("/"):
        d_parent, d_key = dst.rstrip("/") or "/", s_key
    else:
        d_parent, d_key = split_object(dst)
    sstore = open_store(s_parent) if split_tier(s_parent)[0] else open_source(s_parent)
    dstore = open_store(d_parent)

    async def go() -> TransferReport:
        meta = await sstore.stat(s_key)
        item = CopyItem(s_key, d_key, meta.size, version_of(meta))
        return await copy_items(sstore, dstore, [item], topts)

    report = runtime.run(go())
    if report.failures:
        _list_failures(report)
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
    out = _console()
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
    _confirm(f"Delete {total}?", yes)

    async def go() -> None:
        for i in range(0, len(keys), 1000):
            await store.delete_many(keys[i : i + 1000])

    runtime.run(go())
    typer.echo(f"deleted {len(keys)} object(s)", err=True)
