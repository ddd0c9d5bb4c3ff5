"""``fmstore.toml``: named tiers and the settings of every layer, validated with clear errors.

Lookup order: the path given explicitly, ``$FMSTORE_CONFIG``, ``./fmstore.toml``,
``~/.config/fmstore/fmstore.toml``; with none, the embedded default (``nvme`` and ``lustre``
directories under ``$FMSTORE_HOME``, default ``~/.fmstore``, and no ``s3`` tier until one is
configured).  Environment variables override any value: ``FMSTORE__TIERS__S3__URL=s3://b/p``
sets ``[tiers.s3] url``; the path is the variable name after ``FMSTORE__``, split on ``__``,
lower-cased; values are parsed as TOML scalars when they parse, else kept as strings.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from .errors import ConfigError

#: Sections other layers read; each layer validates its own section.
SECTIONS = ("tiers", "state_dir", "s3", "checkpoint", "policies", "daemon", "dataset", "stage")
#: Keys a tier table may hold besides ``url``: the options of its backend.
TIER_KEYS = {
    "url",
    # posix
    "direct_io",
    "stripe_count",
    "stripe_size",
    "fsync",
    # s3
    "endpoint_url",
    "region",
    "profile",
    "addressing_style",
    "max_concurrency",
    "part_size",
    "sse",
    "sse_kms_key_id",
    "max_attempts",
    "connect_timeout",
    "read_timeout",
    "checksum",
}


@dataclass(frozen=True)
class TierConfig:
    name: str
    url: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    tiers: Mapping[str, TierConfig]
    state_dir: str
    sections: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None

    def tier(self, name: str) -> TierConfig:
        try:
            return self.tiers[name]
        except KeyError:
            raise ConfigError(
                f"unknown tier {name!r}{_suggest(name, self.tiers)}; configured tiers: "
                f"{', '.join(sorted(self.tiers)) or 'none'}"
            ) from None

    def section(self, name: str) -> Mapping[str, Any]:
        return self.sections.get(name, {})

    def table(self, name: str, allowed: Iterable[str]) -> tuple[Mapping[str, Any], str]:
        """Section ``name``, checked to be a table whose keys are all in ``allowed``, and
        the prefix its layer's messages start with (``fmstore.toml: [daemon]``); raises
        :class:`ConfigError` naming the file, the section and the unknown key."""
        raw = self.section(name)
        w = f"{self.source or 'config'}: [{name}]"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{w} must be a table")
        known = sorted(allowed)
        for key in raw:
            if key not in known:
                raise ConfigError(
                    f"{w} unknown key {key!r}{_suggest(key, known)}; allowed: {', '.join(known)}"
                )
        return raw, w


def home() -> Path:
    return Path(os.environ.get("FMSTORE_HOME", "~/.fmstore")).expanduser()


def default_dict() -> dict[str, Any]:
    h = home()
    return {
        "tiers": {"nvme": {"url": str(h / "nvme")}, "lustre": {"url": str(h / "lustre")}},
        "state_dir": str(h / "state"),
    }


def find_config_file(path: str | os.PathLike[str] | None = None) -> Path | None:
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        return p
    env = os.environ.get("FMSTORE_CONFIG")
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise ConfigError(f"$FMSTORE_CONFIG points at {env!r}, which does not exist")
        return p
    for p in (Path("fmstore.toml"), Path("~/.config/fmstore/fmstore.toml").expanduser()):
        if p.is_file():
            return p
    return None


def load_config(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> Config:
    """Read, merge with the environment and validate; raises :class:`ConfigError`."""
    file = find_config_file(path)
    data: dict[str, Any]
    if file is None:
        data = default_dict()
    else:
        try:
            data = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{file}: not valid TOML: {e}") from None
        data.setdefault("state_dir", default_dict()["state_dir"])
    _apply_env(data, os.environ if env is None else env)
    return from_dict(data, source=str(file) if file else None)


def from_dict(data: Mapping[str, Any], *, source: str | None = None) -> Config:
    where = source or "config"
    for key in data:
        if key not in SECTIONS:
            raise ConfigError(f"{where}: unknown section or key {key!r}{_suggest(key, SECTIONS)}")
    raw_tiers = data.get("tiers", {})
    if not isinstance(raw_tiers, Mapping):
        raise ConfigError(f"{where}: [tiers] must be a table of tables")
    tiers: dict[str, TierConfig] = {}
    for name, table in raw_tiers.items():
        tiers[name] = _tier(where, name, table, data.get("s3", {}))
    state_dir = data.get("state_dir", default_dict()["state_dir"])
    if not isinstance(state_dir, str):
        raise ConfigError(f"{where}: state_dir must be a string path")
    sections = {k: v for k, v in data.items() if k not in ("tiers", "state_dir")}
    return Config(
        tiers=tiers, state_dir=os.path.expanduser(state_dir), sections=sections, source=source
    )


def _tier(where: str, name: str, table: Any, s3_defaults: Mapping[str, Any]) -> TierConfig:
    if not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"{where}: tier name {name!r} must be letters, digits, '-' or '_'")
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: [tiers.{name}] must be a table with at least 'url'")
    for key in table:
        if key not in TIER_KEYS:
            raise ConfigError(
                f"{where}: [tiers.{name}] unknown key {key!r}{_suggest(key, TIER_KEYS)}"
            )
    url = table.get("url")
    if not isinstance(url, str) or not url:
        raise ConfigError(
            f"{where}: [tiers.{name}] needs 'url' (a path, file://, s3:// or fsspec URL)"
        )
    options = {k: v for k, v in table.items() if k != "url"}
    if url.startswith("s3://"):
        options = {**dict(s3_defaults), **options}
    return TierConfig(name=name, url=os.path.expanduser(url), options=options)


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> None:
    for var, value in env.items():
        if not var.startswith("FMSTORE__"):
            continue
        path = [p.lower() for p in var[len("FMSTORE__") :].split("__") if p]
        if not path:
            continue
        node = data
        for p in path[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"${var}: {p!r} is not a table in the config")
            node = nxt
        node[path[-1]] = _scalar(value)


def _scalar(value: str) -> Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _suggest(word: str, choices: Any) -> str:
    import difflib  # only for a mistake's message

    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_cached: Config | None = None


def get_config() -> Config:
    """The process-wide config, loaded on first use (``set_config`` replaces it)."""
    global _cached
    if _cached is None:
        _cached = load_config()
    return _cached


def set_config(config: Config | None) -> None:
    global _cached
    _cached = config
