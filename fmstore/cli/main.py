"""``fmstore`` entry point: the top-level typer app; each command group lives in its module."""

from __future__ import annotations

import contextlib
import os
import sys

import typer

from .. import __version__
from ..errors import FmstoreError

app = typer.Typer(
    name="fmstore",
    help=(
        "Tiered storage for foundation-model checkpoints and datasets: local NVMe, a shared "
        "parallel file system (Lustre) and S3.\n\n"
        "Locations are paths, file://, s3://bucket/prefix, any fsspec URL, or TIER:path for a "
        "tier named in fmstore.toml (for example nvme:ckpts/run1)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


#: ``fmstore ckpt …``, defined here so that its two command modules (one checkpoint:
#: ckpt_cmds; across tiers: ckpt_tier_cmds) both register on it without importing each other.
ckpt = typer.Typer(
    help="Inspect, verify, garbage-collect and convert checkpoints.", no_args_is_help=True
)
app.add_typer(ckpt, name="ckpt")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fmstore {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """fmstore: move checkpoints and datasets between NVMe, Lustre and S3."""


#: Command modules; each registers its commands on ``app`` when imported.
COMMAND_MODULES = (
    "store_cmds",  # ls
    "ckpt_cmds",  # ckpt inspect, verify, gc, convert
    "dataset_cmds",  # dataset write, inspect
    "stage_cmds",  # stage, hydrate, release
    "object_cmds",  # cp, du, rm
    "ckpt_tier_cmds",  # ckpt list (and verify --all-tiers); after ckpt_cmds
    "daemon_cmds",  # daemon
    "gc_cmds",  # gc
)

#: The modules a command needs.  Only those are imported, so ``fmstore stage`` starts
#: without loading torch (about 1.5 s); ``--help`` and unknown names import everything.
_COMMAND_OWNERS = {
    "ls": ("store_cmds",),
    "ckpt": ("ckpt_cmds", "ckpt_tier_cmds"),
    "dataset": ("dataset_cmds",),
    **{c: ("stage_cmds",) for c in ("stage", "hydrate", "release")},
    **{c: ("object_cmds",) for c in ("cp", "du", "rm")},
    "daemon": ("daemon_cmds",),
    "gc": ("gc_cmds",),
}


def _register(argv: list[str] | None = None) -> None:
    import importlib

    args = sys.argv[1:] if argv is None else argv
    first = next((a for a in args if not a.startswith("-")), None)
    if first is None and "--version" in args:
        return
    names = _COMMAND_OWNERS.get(first or "", COMMAND_MODULES)
    for name in names:
        importlib.import_module(f"{__package__}.{name}")
    _unwrap_help(app)


def _unwrap_help(group: typer.Typer) -> None:
    """Join the lines of each paragraph of the commands' docstrings.

    Docstrings are wrapped for the source; ``--help`` wraps again for the terminal, and
    typer keeps the source's line breaks, which leaves ragged lines.
    """
    import inspect

    for info in group.registered_commands:
        doc = info.help or (inspect.getdoc(info.callback) if info.callback else None)
        if doc:
            info.help = "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _unwrap_help(sub.typer_instance)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: fmstore errors become one clear line and exit code 1."""
    _register(argv)
    try:
        # standalone_mode=False returns typer.Exit's code instead of raising it.
        rc = app(args=argv, standalone_mode=False)
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except FmstoreError as e:
        # One line, whatever a message quoted from the data or a library holds.
        typer.secho(f"error: {' '.join(str(e).split())}", fg=typer.colors.RED, err=True)
        sys.exit(1)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        typer.echo("Aborted.", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("Interrupted.", err=True)
        sys.exit(130)
    except Exception as e:  # usage errors (typer vendors click, so match by duck type)
        show, code = getattr(e, "show", None), getattr(e, "exit_code", None)
        if callable(show) and isinstance(code, int):
            show()
            sys.exit(code)
        raise


def entry() -> None:
    """Console-script and ``python -m fmstore`` entry: :func:`main`, then exit without
    tearing the interpreter down.

    Exit handlers still run (the runtime closes its clients and stops its threads) and
    output is flushed; what is skipped is freeing every module and object one by one,
    about 0.3 s after a copy that loaded botocore and aiohttp.
    """
    import atexit

    if next((a for a in sys.argv[1:] if not a.startswith("-")), None) != "daemon":
        # This process is one command: only the daemon serves metrics, the others need not
        # record them (nor load prometheus_client).
        from .. import stores

        stores.METERED_BY_DEFAULT = False
    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
