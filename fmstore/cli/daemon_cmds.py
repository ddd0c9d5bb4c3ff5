"""``fmstore daemon``: run the tiering policies continuously (see fmstore.tiering.service.daemon)."""

from __future__ import annotations

import logging
import os
import sys

import typer

from .. import config as config_mod
from .main import app
from .util import plural


@app.command("daemon")
def daemon(
    config: str = typer.Option(
        None, "--config", "-c", help="fmstore.toml to use (default: the usual lookup)."
    ),
    port: int = typer.Option(
        None, "--port", help="Port of /metrics and /healthz (overrides [daemon] port)."
    ),
    once: bool = typer.Option(False, "--once", help="Run one policy step and exit."),
    drain: bool = typer.Option(
        False,
        "--drain",
        help="Run until every policy is satisfied (all exports done), then exit 0 "
        "(end-of-job export, Slurm epilog).",
    ),
    timeout_s: str = typer.Option(
        None,
        "--timeout",
        help="With --drain: give up after this long (like 90s, 15m, or seconds; exit 3).",
    ),
    no_http: bool = typer.Option(False, "--no-http", help="Serve no /metrics endpoint."),
    check: bool = typer.Option(
        False,
        "--check",
        help="Validate the configuration and policies and prove every tier usable "
        "(reachable, bucket present, credentials accepted, writable where policies write), "
        "then exit 0, or 1 naming each problem and the setting to fix.",
    ),
) -> None:
    """Export, retain and release checkpoints by the policies in fmstore.toml.

    Serves Prometheus metrics on /metrics and a health check on /healthz.  SIGTERM lets
    the current copy finish (a second SIGTERM leaves it resumable), then exits 0.

    Exit codes: 0 done, 1 bad configuration or another daemon holds the state directory,
    2 --drain or --check under the embedded default with no catalog (no run ever used it:
    the config meant is elsewhere), 3 --drain timed out with work left (resumable).
    """
    from ..tiering.policy.policies import from_config
    from ..tiering.service import daemon as d
    from . import main as cli_main

    if config is not None:
        config_mod.use_file(config)  # what the global --config does: "named by --config"
    cfg = config_mod.get_config()
    if drain or check:
        _refuse_an_unused_default(cfg, "--drain" if drain else "--check")
    if check:
        if cli_main.log_level != logging.ERROR:
            typer.echo(cfg.provenance, err=True)
        from ..tiering.probe import probe_once_per_node

        pol = from_config(cfg)
        d.settings_from_config(cfg)
        probed = probe_once_per_node(cfg, pol, force=True)
        for p in probed.problems:
            typer.echo(f"error: {p.describe()}", err=True)
        if probed.problems:
            raise typer.Exit(1)
        checked = ", ".join(f"{t} ({'+'.join(c)})" for t, c in probed.checked.items())
        typer.echo(
            f"ok: tiers {checked}; write tier {pol.write_tier}; "
            f"{plural(len(pol.exports), 'export rule')}, retention on "
            f"{plural(len(pol.retention), 'tier')}, release on {plural(len(pol.release), 'tier')}"
        )
        for line in _not_counted(cfg, pol.ladder):
            typer.echo(f"warning: {line}", err=True)
        from ..protocol.env import Env
        from ..protocol.skew import clock_warning

        skew = Env.from_config(cfg).clock_skew
        for tier, offset in probed.clock.items():
            if (skewed := clock_warning(tier, offset, skew)) is not None:
                typer.echo(f"warning: {skewed}", err=True)
        return
    from ..units import parse_duration

    sys.exit(
        d.main(
            cfg,
            port=port,
            once=once,
            drain=drain,
            timeout=None if timeout_s is None else parse_duration(timeout_s, "--timeout"),
            http=not no_http,
            log_level=cli_main.log_level,
        )
    )


def _refuse_an_unused_default(cfg: config_mod.Config, flag: str) -> None:
    """Exit 2 when ``--drain``/``--check`` would act on the embedded default that no run has
    used (its state directory holds no catalog): run from another directory than the job's,
    the command would create empty tiers, drain nothing and report success."""
    from ..tiering.inventory.catalog import DB_NAME

    if cfg.source is not None or os.path.exists(os.path.join(cfg.state_dir, DB_NAME)):
        return
    typer.echo(
        f"error: no catalog under the embedded default config (state directory "
        f"{cfg.state_dir}): no run has used it, so `daemon {flag}` has nothing to act on. "
        f"Did you mean `fmstore -c PATH daemon {flag}` with the fmstore.toml the job used "
        f"(or FMSTORE_CONFIG=PATH, or running it from the job's directory)?",
        err=True,
    )
    raise typer.Exit(2)


def _not_counted(cfg: config_mod.Config, ladder: tuple[str, ...]) -> list[str]:
    """What the tiers hold that the daemon will not count as checkpoints, one line per
    prefix (a listing of each directory, as the daemon's start-up scan makes)."""
    from .. import runtime
    from ..tiering.inventory.discovery import survey
    from ..tiering.tiers import Tiers
    from .util import printable

    tiers = Tiers(cfg)

    async def scan() -> list[str]:
        try:
            notes, _ = await survey(tiers, ladder)  # an unreachable tier: the probe said so
        finally:
            await tiers.close()
        return [printable(notes.describe(r), markup=False) for r in notes.roots()]

    return runtime.run(scan())
