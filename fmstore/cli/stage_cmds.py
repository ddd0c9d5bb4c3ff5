"""Dataset commands: stage, hydrate, release (cp, du and rm are in object_cmds).

Each parses its options, calls the library (:func:`fmstore.tiering.staging.stage.stage_async`,
:func:`fmstore.tiering.staging.lazy.hydrate_async`, :func:`fmstore.tiering.staging.lazy.release`) with a
progress counter and a ``confirm`` answered on the terminal, and prints what it did.
Exit codes: :mod:`.progress`.
"""

from __future__ import annotations

import json
import os
from typing import Literal

import typer

from ..errors import ConfigError
from ..tiering.copy.transfer import TransferOptions, TransferProgress
from ..tiering.staging import lazy as _lazy
from ..tiering.staging.stage import (
    KeyFilter,
    StageOptions,
    StagePlan,
    StageResult,
    in_srun_step,
    parse_shard,
    shard_from_env,
    stage_async,
)
from ..units import parse_duration
from .main import app
from .progress import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    PRESERVE_OWNER_HELP,
    Interrupted,
    MainThreadConfirm,
    ask_yes,
    console,
    preserve_owner,
    run_with_progress,
    shard_label,
    summary,
)
from .util import human_bytes, plural, printable, size_option


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
        k_n = shard_from_env()
        ntasks = os.environ.get("SLURM_NTASKS", "1").strip()
        if k_n is None and not in_srun_step() and ntasks.isdigit() and int(ntasks) > 1:
            typer.echo(
                f"note: SLURM_NTASKS={ntasks} but not inside an srun step: staging all files "
                "(run under srun, or pass --shard K/N, to split the work)",
                err=True,
            )
        return k_n
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
    concurrency: int = typer.Option(
        64, "--concurrency", "-c", help="Files (and parts) in flight; also the S3 request limit."
    ),
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
        "inside an srun step (SLURM_STEP_ID set; a batch script itself stages everything), "
        "or RANK/WORLD_SIZE; none.",
    ),
    lazy: bool = typer.Option(
        False, "--lazy", help="Write only the listing; files are fetched on first read."
    ),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Check every copied file's CRC32C at the destination: on S3 against the checksum "
        "the server computed and validated at upload (a HEAD, no read-back); on a file system, "
        "or an S3 server that keeps no checksum, by reading the file back.",
    ),
    fsync: str = typer.Option(
        "batch",
        "--fsync",
        help="Local destinations: 'batch' syncs every 30 s and before exiting (after a power "
        "cut the next run re-checks what the last sync did not cover); 'each' fsyncs every "
        "file and part (slower with many small files); 'none' never syncs (scratch data; "
        "big files still go to disk as they arrive, with O_DIRECT).",
    ),
    preserve_owner_flag: bool | None = typer.Option(
        None, "--preserve-owner/--no-preserve-owner", help=PRESERVE_OWNER_HELP
    ),
    json_out: bool = typer.Option(
        False, "--json", help="Print the final summary as JSON on stdout."
    ),
    progress: bool = typer.Option(
        True,
        "--progress/--no-progress",
        help="The progress bar on a terminal; --no-progress: no bar, the --log-interval "
        "lines instead.",
    ),
    interval_s: str = typer.Option(
        "10s",
        "--log-interval",
        help="Time between progress lines whenever no bar is shown (not a terminal, or "
        "--no-progress): like 10s, 1m, or seconds.",
    ),
) -> None:
    """Copy a dataset between any two locations: parallel, resumable, verified.

    Files already present and identical (same size and recorded checksum or source
    version) are skipped, so re-running is cheap; an interrupted run resumes where it
    stopped, big files included.

    Exit codes: 0 ok, 1 error, 2 usage, 3 some files failed, 130 interrupted.
    """
    topts = _transfer_options(
        concurrency, bwlimit, part_size, verify, fsync, preserve_owner(preserve_owner_flag)
    )
    try:
        interval = parse_duration(interval_s, "--log-interval")
    except ConfigError as e:
        raise typer.BadParameter(e.message, param_hint="--log-interval") from None
    try:
        KeyFilter.of(include, exclude)
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
    opts = StageOptions(
        includes=tuple(include),
        excludes=tuple(exclude),
        delete=delete,
        shard=k_n,
        lazy=lazy,
        transfer=topts,
        dry_run=dry_run,
    )
    if k_n is not None:
        typer.echo(f"staging shard {k_n[0]}/{k_n[1]}", err=True)

    def ask(plan: StagePlan) -> bool:
        """Before anything changes: warn when nothing is selected, list what would be
        deleted and ask."""
        _warn_if_empty(plan, src)
        if not plan.delete:
            return True
        out = console(err=True)
        out.print(
            f"{plural(len(plan.delete), 'file')} at {dst} not in {src} will be deleted:",
            markup=False,
        )
        for k in plan.delete[:10]:
            out.print(f"  {printable(k, markup=False)}", markup=False)
        if len(plan.delete) > 10:
            out.print(f"  … and {len(plan.delete) - 10} more")
        return ask_yes(
            f"Delete {plural(len(plan.delete), 'file')} from {dst}?",
            yes,
            "Nothing copied or deleted (run without --delete to copy only).",
        )

    prog = TransferProgress()
    confirm = MainThreadConfirm(ask)
    try:
        result = run_with_progress(
            stage_async(src, dst, opts, progress=prog, confirm=confirm),
            prog,
            "stage",
            progress,
            0.0 if lazy or dry_run else interval,
            confirm,
        )
    except Interrupted:
        typer.echo(
            f"Interrupted after {plural(prog.files_done, 'file')}; run the same command again to resume.",
            err=True,
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if result.declined:
        raise typer.Exit(EXIT_USAGE)
    if dry_run:
        assert result.plan is not None
        _warn_if_empty(result.plan, src)
        _print_plan(result.plan, json_out, lazy, k_n)
        return
    _print_result(result, dst, lazy, json_out, k_n)


def _warn_if_empty(plan: StagePlan, src: str) -> None:
    # A source without any file is refused before this (exit 1); filters or a shard that
    # select none of its files are only worth a warning.
    if plan.src_listing and not plan.items:
        typer.echo(
            f"warning: none of the {plural(len(plan.src_listing), 'file')} of source {src} "
            "is selected (--include, --exclude, --shard)",
            err=True,
        )


def _print_result(
    result: StageResult, dst: str, lazy: bool, json_out: bool, shard: tuple[int, int] | None
) -> None:
    if lazy:
        typer.echo(
            f"lazy listing of {plural(result.lazy_entries, 'file')} written to {dst}; files are fetched on first read",
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
                f"  kept {printable(key, markup=False)}: changed locally (or not fetched by fmstore); "
                "it may differ from the listed version",
                err=True,
            )
    else:
        summary(result.report, shard=shard_label(shard))
    if result.deleted or result.delete_failures:
        typer.echo(
            f"deleted {plural(result.deleted, 'file')}, {len(result.delete_failures)} failed",
            err=True,
        )
        for key, err in result.delete_failures:
            typer.echo(printable(f"  FAILED delete {key}: {err}", markup=False), err=True)
    if json_out:
        d = result.report.as_dict()
        d.update(
            shard=shard_label(shard),
            deleted=result.deleted,
            delete_failures=len(result.delete_failures),
            lazy_entries=result.lazy_entries,
            lazy_dropped=len(result.lazy_dropped),
            lazy_kept=result.lazy_kept,
        )
        typer.echo(json.dumps(d))
    if not result.ok:
        raise typer.Exit(EXIT_FAILED)


def _print_plan(plan: StagePlan, json_out: bool, lazy: bool, shard: tuple[int, int] | None) -> None:
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
                    "shard": shard_label(shard),
                    "copy_keys": [i.src_key for i in todo],
                    "delete_keys": plan.delete,
                }
            )
        )
        return
    out = console()
    out.print(
        f"plan: {plural(plan.files, 'file')}, {human_bytes(plan.bytes)} selected; "
        f"shard {shard_label(shard)}"
    )
    out.print(f"  to copy: {plural(len(todo), 'file')}, {human_bytes(sum(i.size for i in todo))}")
    for i in todo[:10]:
        out.print(
            f"    {printable(i.src_key, markup=False)}  ({human_bytes(i.size)})", markup=False
        )
    if len(todo) > 10:
        out.print(f"    … and {len(todo) - 10} more")
    out.print(f"  already present with the same size (checked against checksums when run): {same}")
    if plan.delete:
        out.print(f"  to delete: {plural(len(plan.delete), 'file')}")
        for k in plan.delete[:10]:
            out.print(f"    {printable(k, markup=False)}", markup=False)
    out.print("dry run: nothing was changed")


@app.command("hydrate")
def hydrate_cmd(
    path: str = typer.Argument(..., help="A lazily staged directory or file (or a part of one)."),
    concurrency: int = typer.Option(
        64, "--concurrency", "-c", help="Files (and parts) in flight; also the S3 request limit."
    ),
    bwlimit: str | None = typer.Option(None, "--bwlimit", help="Bandwidth limit, e.g. 200MiB/s."),
    verify: bool = typer.Option(
        False, "--verify", help="Re-read every fetched file and compare checksums."
    ),
    progress: bool = typer.Option(
        True,
        "--progress/--no-progress",
        help="Progress bar (terminal) or a log line every 10 s; --no-progress: neither.",
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
    prog = TransferProgress()
    try:
        report = run_with_progress(
            _lazy.hydrate_async(path, topts, progress=prog),
            prog,
            "hydrate",
            progress,
            10.0 if progress else 0.0,
        )
    except Interrupted:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    summary(report, verb="fetched")
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
        f"released {plural(len(res.released), 'file')} ({human_bytes(res.bytes_released)}); kept {len(res.kept)}",
        err=True,
    )
    for key, why in res.kept[:50]:
        typer.echo(printable(f"  kept {key}: {why}", markup=False), err=True)
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
