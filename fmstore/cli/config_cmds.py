"""``fmstore config``: which fmstore.toml is in effect and where each tier resolves."""

from __future__ import annotations

import json

import typer

from .main import app


@app.command("config")
def config_cmd(
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of text."),
) -> None:
    """Show the config file in effect (or that the embedded default applies), the state
    directory, and each tier's resolved location.

    The file is the global --config, else $FMSTORE_CONFIG, else fmstore.toml in the working
    directory or the nearest directory above it (up to $HOME, a file-system boundary or a
    directory of $FMSTORE_CEILING_DIRECTORIES; used only when nobody but root and you could
    have written it), else ~/.config/fmstore/fmstore.toml, else /etc/fmstore/fmstore.toml.
    """
    from ..config import get_config
    from ..stores import Location

    cfg = get_config()
    tiers: dict[str, dict[str, str]] = {}
    for name, tier in sorted(cfg.tiers.items()):
        loc = Location.parse(f"{name}:", cfg)
        endpoint = loc.options.get("endpoint_url") if loc.scheme == "s3" else None
        tiers[name] = {
            "location": loc.local_root or tier.url,
            "scheme": loc.scheme,
            "scope": tier.scope,
        }
        if endpoint:
            tiers[name]["endpoint_url"] = str(endpoint)
    if as_json:
        doc = {
            "config": cfg.source,
            "found_by": cfg.found_by,
            "state_dir": cfg.state_dir,
            "tiers": tiers,
        }
        typer.echo(json.dumps(doc, indent=1))
        return
    typer.echo(cfg.provenance if cfg.source else f"config: {cfg.origin}")
    typer.echo(f"state_dir: {cfg.state_dir}")
    width = max((len(n) for n in tiers), default=0)
    for name, t in tiers.items():
        extra = f" (endpoint {t['endpoint_url']})" if "endpoint_url" in t else ""
        scope = " [node-local]" if t["scope"] == "node" else ""
        typer.echo(f"tier {name:<{width}}  {t['location']}{extra}{scope}")
    if not tiers:
        typer.echo("no tiers configured")
