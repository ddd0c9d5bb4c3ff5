"""``fmstore`` entry point: the top-level typer app; each command group lives in its module."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import typer
import typer.core

from .. import __version__
from ..errors import ConfigError, FmstoreError

#: Help texts are plain text: "[daemon] port" names a config section, not rich markup
#: (typer's default mode, "rich", would drop it).  Every Typer of the CLI uses this.
HELP_MARKUP = None

app = typer.Typer(
    name="fmstore",
    help=(
        "Tiered storage for foundation-model checkpoints and datasets: local NVMe, a shared "
        "parallel file system (Lustre) and S3.\n\n"
        "Locations are paths, file://, s3://bucket/prefix, any fsspec URL, or TIER:path for a "
        "tier named in fmstore.toml (for example nvme:ckpts/run1).\n\n"
        "Log output goes to stderr: warnings and errors by default; -v adds info, -vv debug, "
        "-q leaves only errors; FMSTORE_LOG_LEVEL (DEBUG, INFO, WARNING, ERROR) sets the "
        "level when neither is given.\n\n"
        "--config FILE (-c FILE before the command) picks the fmstore.toml every command "
        "reads; without it: $FMSTORE_CONFIG, fmstore.toml here or in the nearest directory "
        "above (only one nobody but root and you could have written), "
        "~/.config/fmstore/fmstore.toml, /etc/fmstore/fmstore.toml, else the embedded "
        "default. 'fmstore config' shows which one is in effect; commands that write or "
        "delete print it on stderr first."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=HELP_MARKUP,
)


#: ``fmstore ckpt …``, defined here so that its two command modules (one checkpoint:
#: ckpt_cmds; across tiers: ckpt_tier_cmds) both register on it without importing each other.
ckpt = typer.Typer(
    help="Inspect, verify, garbage-collect and convert checkpoints.",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)
app.add_typer(ckpt, name="ckpt")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fmstore {__version__}")
        raise typer.Exit()


#: The name of the CLI's stderr log handler (``fmstore daemon`` replaces it by its JSON one).
LOG_HANDLER_NAME = "fmstore.cli"
_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "WARN": 30, "ERROR": 40, "CRITICAL": 50}
#: The level asked for on the command line or in FMSTORE_LOG_LEVEL; None: the default.
log_level: int | None = None


class _StderrHandler(logging.Handler):
    """Log lines on whatever ``sys.stderr`` is when a record comes."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.name = LOG_HANDLER_NAME
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def level_from(verbose: int, quiet: bool, env: str | None = None) -> int | None:
    """The log level of ``-v`` (info) / ``-vv`` (debug) / ``-q`` (error), else of
    ``FMSTORE_LOG_LEVEL`` (a name or a number); None when nothing asks for one."""
    if quiet:
        return logging.ERROR
    if verbose:
        return logging.INFO if verbose == 1 else logging.DEBUG
    text = (os.environ.get("FMSTORE_LOG_LEVEL", "") if env is None else env).strip()
    if not text:
        return None
    if text.isdigit():
        return int(text)
    if text.upper() in _LEVELS:
        return _LEVELS[text.upper()]
    raise typer.BadParameter(
        f"{text!r}: use DEBUG, INFO, WARNING or ERROR", param_hint="FMSTORE_LOG_LEVEL"
    )


def setup_logging(level: int | None) -> None:
    """One handler on stderr for the ``fmstore`` logger hierarchy (every layer logs under
    it): ``level``, or warnings and errors when None (the logger's level is then left as
    it is)."""
    logger = logging.getLogger("fmstore")
    for h in [h for h in logger.handlers if h.name == LOG_HANDLER_NAME]:
        logger.removeHandler(h)
    logger.addHandler(_StderrHandler(logging.WARNING if level is None else level))
    if level is not None:
        logger.setLevel(level)


def _remove_log_handler() -> None:
    logger = logging.getLogger("fmstore")
    for h in [h for h in logger.handlers if h.name == LOG_HANDLER_NAME]:
        logger.removeHandler(h)


@app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    verbose: int = typer.Option(
        0,
        "--verbose",
        "-v",
        count=True,
        show_default=False,
        help="More log output on stderr: -v info, -vv debug (overrides FMSTORE_LOG_LEVEL).",
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Log only errors on stderr (overrides FMSTORE_LOG_LEVEL)."
    ),
    config: str = typer.Option(
        None,
        "--config",
        "-c",
        help="The fmstore.toml every command reads (overrides $FMSTORE_CONFIG and the lookup).",
    ),
) -> None:
    """fmstore: move checkpoints and datasets between NVMe, Lustre and S3."""
    global log_level
    log_level = level_from(verbose, quiet)
    from .. import config as config_mod

    if config is not None:
        config_mod.use_file(config)
    if _announce:
        # Loaded here, before the command acts: the config it uses is the one named (the
        # process caches it), and a config that is not trusted stops it first.
        cfg = config_mod.get_config()
        if not quiet and cfg.found_by not in config_mod.NAMED_BY:
            typer.echo(cfg.provenance, err=True)
    if ctx.invoked_subcommand != "daemon":  # the daemon logs JSON lines (its own handler)
        setup_logging(log_level)


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
    "config_cmds",  # config
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
    "config": ("config_cmds",),
}


#: Commands that act on tiers: each given a tier's location or an S3 URL prints the config
#: in effect (one line on stderr, :attr:`~fmstore.config.Config.provenance`) before it
#: acts, unless the caller named the file (``--config``, ``$FMSTORE_CONFIG``) or passed
#: ``-q``; ``daemon`` logs it as a JSON line of its own.  Commands on plain paths only do
#: not (the config decides nothing there).
ANNOUNCING = {
    ("ls",),
    ("du",),
    ("cp",),
    ("rm",),
    ("stage",),
    ("hydrate",),
    ("release",),
    ("gc",),
    ("ckpt", "inspect"),
    ("ckpt", "verify"),
    ("ckpt", "gc"),
    ("ckpt", "convert"),
    ("dataset", "write"),
    ("dataset", "inspect"),
}
#: Commands whose every run reads the configured tiers, whatever their arguments.
ALWAYS_ANNOUNCING = {("ckpt", "list")}
#: Whether the command being run is one of :data:`ANNOUNCING` given a location the config
#: decides (set by :func:`main`).
_announce = False

#: The root's options that take a value.
_ROOT_VALUED = ("--config", "-c")


def command_at(args: list[str]) -> int | None:
    """The index of the command's name in ``args`` (the first word that is neither an
    option nor the value of a root option such as ``-c FILE``), None without one."""
    skip = False
    for i, a in enumerate(args):
        if skip:
            skip = False
        elif a in _ROOT_VALUED:
            skip = True
        elif not a.startswith("-"):
            return i
    return None


def _command_name(args: list[str]) -> str | None:
    i = command_at(args)
    return None if i is None else args[i]


def _register(argv: list[str] | None = None) -> None:
    import importlib

    args = sys.argv[1:] if argv is None else argv
    first = _command_name(args)
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


#: Commands users bring from s5cmd, rclone and the aws cli, and the fmstore way to do them.
OTHER_TOOLS = {
    "sync": "fmstore stage SRC DST --delete (copies what differs and deletes what SRC lacks; "
    "--dry-run shows the plan first)",
    "mv": "fmstore cp SRC DST (or, for many, fmstore stage SRC DST --include GLOB), "
    "then fmstore rm SRC (-r for a prefix)",
    "move": "fmstore cp SRC DST (or, for many, fmstore stage SRC DST --include GLOB), "
    "then fmstore rm SRC (-r for a prefix)",
    "copy": "fmstore stage SRC DST (many files, resumable) or fmstore cp SRC DST (one object, "
    "or -r / a glob)",
}
#: The root's options, also taken after the command (``fmstore stage -v …``): no command
#: has options of these names.
_ROOT_FLAGS = re.compile(r"-v+|--verbose|-q|--quiet")


def hoist_root_options(
    args: list[str], own: Callable[[list[str]], set[str]] | None = None
) -> list[str]:
    """Root options given after the command moved before it, where the root's parser reads
    them (up to a ``--``): ``-v``/``-vv``/``--verbose``/``-q``/``--quiet``, and ``--config
    FILE`` / ``--config=FILE`` / ``-c FILE`` unless the command has an option of that name
    of its own (``own(args)`` names them: ``stage -c`` is its concurrency)."""
    first = command_at(args)
    if first is None:
        return args
    end = args.index("--") if "--" in args else len(args)
    taken = own(args) if own is not None else set()
    moved: list[str] = []
    rest: list[str] = []
    tail = args[first + 1 : end]
    i = 0
    while i < len(tail):
        a = tail[i]
        if _ROOT_FLAGS.fullmatch(a):
            moved.append(a)
        elif a in _ROOT_VALUED and a not in taken and i + 1 < len(tail):
            moved += tail[i : i + 2]
            i += 1
        elif a.startswith("--config=") and "--config" not in taken:
            moved.append(a)
        else:
            rest.append(a)
        i += 1
    if not moved:
        return args
    return [*args[:first], *moved, args[first], *rest, *args[end:]]


def _invoked(args: list[str]) -> tuple[Any, tuple[str, ...]]:
    """The (sub)command ``args`` invoke and the names leading to it (typer vendors click:
    groups are matched by their ``commands``)."""
    cmd: Any = typer.main.get_command(app)
    first = command_at(args)
    path: list[str] = []
    for w in [a for a in args[first or 0 :] if not a.startswith("-")] if first is not None else []:
        commands = getattr(cmd, "commands", None)
        if commands is None or w not in commands:
            break
        cmd = commands[w]
        path.append(w)
    return cmd, tuple(path)


def _own_options(args: list[str]) -> set[str]:
    """The option names of the (sub)command ``args`` invoke, among the root's valued ones."""
    cmd, _ = _invoked(args)
    if getattr(cmd, "commands", None) is not None:
        return set()
    names = {o for p in cmd.params for o in getattr(p, "opts", [])}
    return names & set(_ROOT_VALUED)


def _usage_metavar(make: Callable[..., str]) -> Callable[..., str]:
    """Arguments in usage lines as CLI convention writes them, ``fmstore ls URL``: typer
    writes a required one ``{url}``."""

    def metavar(self: Any, ctx: Any, *, usage: bool = False) -> str:
        var = make(self, ctx, usage=usage)
        if usage:
            var = re.sub(r"^\{([^}]*)\}", r"\1", var)
            var = re.sub(r"[a-z_]+", lambda m: m.group(0).upper().replace("_", "-"), var)
        return var

    return metavar


typer.core.TyperArgument.make_metavar = _usage_metavar(  # type: ignore[method-assign]
    typer.core.TyperArgument.make_metavar
)


def _announces(args: list[str]) -> bool:
    """Whether ``args`` run a command of :data:`ANNOUNCING` on a location the config decides."""
    from ..stores.location import decided_by_config

    _, path = _invoked(args)
    if "--help" in args or path not in ANNOUNCING | ALWAYS_ANNOUNCING:
        return False
    if path in ALWAYS_ANNOUNCING:
        return True
    words = [a for a in args[(command_at(args) or 0) + len(path) :] if not a.startswith("-")]
    return any(decided_by_config(w) for w in words)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: fmstore errors become one clear line and exit code 1."""
    global log_level, _announce
    from .. import config as config_mod

    log_level = None
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_name(argv)
    if command in OTHER_TOOLS:
        typer.secho(
            f"error: fmstore has no '{command}' command; use {OTHER_TOOLS[command]}",
            fg=typer.colors.RED,
            err=True,
        )
        sys.exit(2)
    _register(argv)
    argv = hoist_root_options(argv, _own_options)
    _announce = _announces(argv)
    logger = logging.getLogger("fmstore")
    level_before = logger.level
    # In-process callers (tests, embedding) get their config back after a --config.
    config_before = (config_mod._explicit, config_mod._cached)
    try:
        # standalone_mode=False returns typer.Exit's code instead of raising it.
        rc = app(args=argv, standalone_mode=False)
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except FmstoreError as e:
        # One line, whatever a message quoted from the data or a library holds; a config
        # with several problems: one line each (values in them are quoted with repr).
        parts = str(e).split("\n") if isinstance(e, ConfigError) else [str(e)]
        from .util import printable  # no control character of a quoted key reaches the terminal

        lines = [printable(" ".join(p.split()), markup=False) for p in parts if p.strip()]
        typer.secho("error: " + "\n  ".join(lines), fg=typer.colors.RED, err=True)
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
    finally:
        # In-process callers (tests, embedding) get the logging they had back.
        _remove_log_handler()
        if log_level is not None and logger.level == log_level:
            logger.setLevel(level_before)
        config_mod._explicit, config_mod._cached = config_before
        _announce = False


def entry() -> None:
    """Console-script and ``python -m fmstore`` entry: :func:`main`, then exit without
    tearing the interpreter down.

    Exit handlers still run (the runtime closes its clients and stops its threads) and
    output is flushed; what is skipped is freeing every module and object one by one,
    about 0.3 s after a copy that loaded botocore and aiohttp.
    """
    import atexit

    if _command_name(sys.argv[1:]) != "daemon":
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
