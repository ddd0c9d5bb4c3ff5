"""``fmstore.toml``: named tiers and the settings of every layer, validated with clear errors.

Lookup order (:func:`locate_config`): the path given explicitly (``load_config(path)``, the
CLI's ``--config``), ``$FMSTORE_CONFIG``, ``fmstore.toml`` in the working directory or the
nearest directory above it (up to ``$HOME``, a file-system boundary or a directory of
``$FMSTORE_CEILING_DIRECTORIES``) when it is trusted, ``~/.config/fmstore/fmstore.toml``,
``/etc/fmstore/fmstore.toml``; with none, the embedded default (``nvme`` and ``lustre``
directories under ``$FMSTORE_HOME``, default ``~/.fmstore``, and no ``s3`` tier until one is
configured).  A file found by looking (not named) is used only when nobody but root and the
caller could have written it (:mod:`fmstore.trust`); one found but not trusted is a
:class:`ConfigError`, never a reason to look further.  Relative paths in a file (a tier's
``url``, ``state_dir``) are relative to the file's directory, so a tier names the same
directory from wherever a command runs.  Environment variables override any value:
``FMSTORE__TIERS__S3__URL=s3://b/p`` sets ``[tiers.s3] url``; the path is the variable name
after ``FMSTORE__``, split on ``__``, lower-cased; values are parsed as TOML scalars when
they parse, else kept as strings.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tomllib

from .configfile import CEILING_ENV as CEILING_ENV  # re-exported: the lookup's names
from .configfile import NAMED_BY as NAMED_BY
from .configfile import NO_FILE, existing, locate
from .configfile import SYSTEM_CONFIG as SYSTEM_CONFIG
from .configfile import USER_CONFIG as USER_CONFIG
from .errors import ConfigError, InvalidKey
from .keys import StepPattern, validate_prefix
from .units import parse_duration, parse_size


@dataclass(frozen=True)
class Check:
    """The rule of one key: ``parse`` returns the value to keep (converted where the key
    reads a unit, e.g. a size string to bytes) or raises ``ValueError`` / ``TypeError``;
    ``expected`` completes "must be ..." in the message."""

    expected: str
    parse: Callable[[Any], Any]


def _typed(expected: str, *types: type, test: Callable[[Any], bool] = lambda v: True) -> Check:
    def parse(v: Any) -> Any:
        if isinstance(v, bool) and bool not in types or not isinstance(v, types) or not test(v):
            raise ValueError(expected)
        return v

    return Check(expected, parse)


def whole(least: int = 0, most: int | None = None) -> Check:
    """An integer (not a boolean) in ``least..most``."""
    span = f">= {least}" if most is None else f"{least}..{most}"
    return _typed(
        f"a whole number {span}", int, test=lambda v: v >= least and (most is None or v <= most)
    )


def one_of(*choices: str) -> Check:
    return _typed(" or ".join(repr(c) for c in choices), str, test=lambda v: v in choices)


def _size(v: Any) -> int:
    if isinstance(v, bool):
        raise TypeError(v)
    return parse_size(v, "")


def _duration(allow_zero: bool) -> Callable[[Any], float]:
    def parse(v: Any) -> float:
        if isinstance(v, bool):
            raise TypeError(v)
        return parse_duration(v, "", allow_zero=allow_zero)

    return parse


STRING = _typed("a string", str)
BOOL = _typed("true or false (a TOML boolean, unquoted)", bool)
STRINGS = _typed("a list of strings", list, test=lambda v: all(isinstance(x, str) for x in v))
FRACTION = _typed("a fraction in (0, 1]", int, float, test=lambda v: 0 < v <= 1)
SIZE = Check('a size in bytes, or a string like "64MiB"', _size)
DURATION = Check('a duration in seconds, or a string like "30m"', _duration(False))
DURATION0 = Check('a duration in seconds (0 allowed), or a string like "1h"', _duration(True))


def _lfs_size(v: Any) -> str:
    """``stripe_size`` goes to ``lfs setstripe -S`` as written; a number of bytes as text."""
    return str(_typed("", str, int).parse(v))


def _buffer(v: Any) -> int:
    return 0 if v == 0 and not isinstance(v, bool) else _size(v)


LFS_SIZE = Check('a size like "4M" or a number of bytes', _lfs_size)

#: The options of an S3 tier, also the keys of ``[s3]`` (defaults for every S3 tier).
_S3: dict[str, Check] = {
    "endpoint_url": STRING,
    "region": STRING,
    "profile": STRING,
    "addressing_style": one_of("path", "virtual", "auto"),
    "max_concurrency": whole(1),
    "part_size": SIZE,
    "sse": STRING,
    "sse_kms_key_id": STRING,
    "max_attempts": whole(1),
    "connect_timeout": DURATION,
    "read_timeout": DURATION,
    "checksum": one_of("crc32c", "md5", "off"),
    "lean_requests": BOOL,
    "socket_buffer": Check("a size in bytes, or 0 (the kernel's autotuning)", _buffer),
}

#: Every key fmstore.toml may hold, by table: ``"tiers.*"`` is each table under
#: ``[tiers]``, ``"policies.export[]"`` each ``[[policies.export]]``, ``""`` the top level.
#: A table named here may appear; a key not named in its table is an error that suggests
#: the nearest.  Adding a key is one line in its table (and its layer reads it).
SCHEMA: dict[str, dict[str, Check]] = {
    "": {"state_dir": STRING},
    "tiers.*": {
        "url": STRING,
        # "node": each node has its own copy (NVMe); see docs/distributed.md
        "scope": one_of("shared", "node"),
        "replicas": whole(0, 8),  # of each node's part on peers' node-local tiers
        # this node's rack / switch / zone: replicas go to other domains first
        "failure_domain": _typed(
            "a name of 1-128 ASCII letters, digits or ._:@+/- (a rack, a switch, a zone)",
            str,
            test=lambda v: is_failure_domain(v),
        ),
        # posix
        "direct_io": BOOL,
        "stripe_count": whole(-1),  # -1: every OST
        "stripe_size": LFS_SIZE,
        "fsync": BOOL,
        **_S3,
    },
    "s3": _S3,
    # the most bytes copied of a file someone else could rewrite, or downloaded, before it is read
    "checkpoint": {"private_copy_limit": SIZE},
    "dataset": {},
    "stage": {"preserve_owner": BOOL, "lazy_sources": STRINGS},
    "daemon": {
        "host": STRING,
        "port": whole(0, 65535),
        "interval": DURATION,
        "max_backoff": DURATION,
        "concurrency": whole(1),
        "bwlimit": SIZE,
        "verify_destination": BOOL,
        "orphan_grace": DURATION0,
        "sweep_interval": DURATION,
        "priority": STRING,
    },
    "policies": {
        "ladder": STRINGS,
        "write_tier": STRING,
        "on_full": one_of("fail", "fallback"),
        "warn_after_failures": whole(1),
        "replica_export_after": DURATION0,
    },
    "policies.export[]": {
        "to": STRING,
        "from": STRING,
        "every_saves": whole(1),
        "every_steps": whole(1),
        "every_seconds": DURATION,
    },
    "policies.retention.*": {"keep_latest": whole(0), "keep_every": whole(1), "keep_for": DURATION},
    "policies.release.*": {
        "after": DURATION,
        "high_watermark": FRACTION,
        "low_watermark": FRACTION,
        "durable": STRINGS,
    },
    "policies.restore": {"mode": one_of("lazy", "eager"), "cache_tier": STRING},
    # one table per run root ([runs."team/run"]): how its step directories are named
    "runs.*": {"step_pattern": STRING},
    "protocol": {"lease_ttl": DURATION, "lease_renew": DURATION, "clock_skew": DURATION0},
    # read only from the user's and the system's file (see locate_config)
    "trust": {"safe_directories": STRINGS},
}
#: Keys a tier table may hold besides ``url``: the options of its backend.
TIER_KEYS = set(SCHEMA["tiers.*"])
#: Top-level keys: the tables of each layer, and ``state_dir``.
SECTIONS = tuple(sorted({*SCHEMA[""], *(s.split(".")[0] for s in SCHEMA if s)}))


@dataclass(frozen=True)
class TierConfig:
    name: str
    url: str
    options: Mapping[str, Any] = field(default_factory=dict)
    #: ``"shared"`` (every node sees the same bytes) or ``"node"`` (each node its own copy)
    scope: str = "shared"
    #: copies of each node's part on other nodes (``scope = "node"`` only): 0..8
    replicas: int = 0
    #: this node's failure domain (``$FMSTORE_FAILURE_DOMAIN`` overrides it); None: unknown
    failure_domain: str | None = None


@dataclass(frozen=True)
class Config:
    tiers: Mapping[str, TierConfig]
    state_dir: str
    sections: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None
    #: how :func:`load_config` found ``source`` (``"found above the working directory"``,
    #: ``"$FMSTORE_CONFIG"``, ...); None for a config built otherwise
    found_by: str | None = None

    @property
    def origin(self) -> str:
        """Where this config came from, for messages: its file, or the embedded default."""
        return self.source or f"the embedded default ({NO_FILE})"

    @property
    def provenance(self) -> str:
        """The line commands print before they act: ``config: /x/fmstore.toml (found
        above the working directory)``, ``config: embedded default (no config file
        found)``."""
        if self.source is None:
            return "config: embedded default (no config file found)"
        return f"config: {self.source} ({self.found_by or 'named explicitly'})"

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

    def table(
        self, name: str, allowed: Iterable[str] | None = None
    ) -> tuple[Mapping[str, Any], str]:
        """Section ``name``, checked to be a table whose keys are all in ``allowed`` (default:
        its keys in :data:`SCHEMA`), and
        the prefix its layer's messages start with (``fmstore.toml: [daemon]``); raises
        :class:`ConfigError` naming the file, the section and the unknown key."""
        raw = self.section(name)
        w = f"{self.source or 'config'}: [{name}]"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{w} must be a table")
        known = sorted(SCHEMA.get(name, {}) if allowed is None else allowed)
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


#: The file the CLI's global ``--config`` named: what ``load_config()`` reads before
#: ``$FMSTORE_CONFIG`` (:func:`use_file`).
_explicit: Path | None = None


def use_file(path: str | os.PathLike[str] | None) -> None:
    """Make ``path`` the file every later :func:`load_config` without a path reads (the
    CLI's ``--config``); None goes back to the lookup.  Drops the cached config."""
    global _explicit
    _explicit = None if path is None else existing(path, "config file")
    set_config(None)


def find_config_file(path: str | os.PathLike[str] | None = None) -> Path | None:
    """The config file in effect (an absolute path), or None for the embedded default
    (:func:`locate_config` without how it was found)."""
    return locate_config(path)[0]


def locate_config(path: str | os.PathLike[str] | None = None) -> tuple[Path | None, str]:
    """The config file in effect and how it was found (:func:`fmstore.configfile.locate`,
    the CLI's ``--config`` taken into account)."""
    return locate(path, _explicit)


def load_config(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> Config:
    """Read, merge with the environment and validate; raises :class:`ConfigError`."""
    file, how = locate_config(path)
    data: dict[str, Any]
    text = None
    if file is None:
        data = default_dict()
    else:
        text = file.read_text()
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{file}: not valid TOML: {e}") from None
        _relative_to(data, file.parent)
        data.setdefault("state_dir", default_dict()["state_dir"])
    source = str(file) if file else None
    origin = _Origin(source, text)
    _apply_env(data, os.environ if env is None else env, origin)
    cfg = from_dict(data, source=source, _origin=origin)
    return replace(cfg, found_by=how)


def _relative_to(data: dict[str, Any], base: Path) -> None:
    """Relative local paths of a file (tiers' ``url``, ``state_dir``) made absolute against
    the file's directory; ``~``, absolute paths and URLs are left as they are."""

    def fix(v: Any) -> Any:
        if (
            not isinstance(v, str)
            or not v
            or v.startswith(("/", "~"))
            or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", v)
        ):
            return v
        return str(base / v)

    if "state_dir" in data:
        data["state_dir"] = fix(data["state_dir"])
    tiers = data.get("tiers")
    if isinstance(tiers, dict):
        for t in tiers.values():
            if isinstance(t, dict) and "url" in t:
                t["url"] = fix(t["url"])


def from_dict(
    data: Mapping[str, Any], *, source: str | None = None, _origin: _Origin | None = None
) -> Config:
    """Validate ``data`` against :data:`SCHEMA` (converting sizes and durations where a
    key reads them) and build the :class:`Config`; raises :class:`ConfigError` naming the
    file, the line or environment variable, the ``[table] key`` and what it must be."""
    where = source or "config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: a config is a table, not {_show(data)}")
    problems: list[str] = []  # every one is reported, not only the first
    data = _checked(data, "", (), _origin or _Origin(source), problems)
    raw_tiers = data.get("tiers", {})
    tiers: dict[str, TierConfig] = {}
    for name, table in raw_tiers.items():
        try:
            tiers[name] = _tier(where, name, table, data.get("s3", {}))
        except ConfigError as e:
            problems.append(e.message)
    if "runs" in data:
        data = {**data, "runs": _runs(data["runs"], _origin or _Origin(source), problems)}
    state_dir = data.get("state_dir", default_dict()["state_dir"])
    if not isinstance(state_dir, str):
        problems.append(f"{where}: state_dir must be a string path")
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems in {where}:\n  " + "\n  ".join(problems))
    sections = {k: v for k, v in data.items() if k not in ("tiers", "state_dir")}
    return Config(
        tiers=tiers, state_dir=os.path.expanduser(state_dir), sections=sections, source=source
    )


def _tier(where: str, name: str, table: Any, s3_defaults: Mapping[str, Any]) -> TierConfig:
    if not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"{where}: tier name {name!r} must be letters, digits, '-' or '_'")
    url = table.get("url")
    if not isinstance(url, str) or not url:
        raise ConfigError(
            f"{where}: [tiers.{name}] needs 'url' (a path, file://, s3:// or fsspec URL)"
        )
    scope = table.get("scope", "shared")
    if scope not in ("shared", "node"):
        raise ConfigError(
            f"{where}: [tiers.{name}] scope must be 'shared' or 'node', not {scope!r}"
        )
    replicas = int(table.get("replicas", 0))
    if replicas and scope != "node":
        raise ConfigError(f'{where}: [tiers.{name}] replicas needs scope = "node"')
    domain = table.get("failure_domain")
    if domain is not None and scope != "node":
        raise ConfigError(f'{where}: [tiers.{name}] failure_domain needs scope = "node"')
    own = ("url", "scope", "replicas", "failure_domain")
    options = {k: v for k, v in table.items() if k not in own}
    if url.startswith("s3://"):
        options = {**dict(s3_defaults), **options}
    return TierConfig(
        name=name,
        url=os.path.expanduser(url),
        options=options,
        scope=scope,
        replicas=replicas,
        failure_domain=domain,
    )


def _runs(runs: Mapping[str, Any], origin: _Origin, problems: list[str]) -> dict[str, Any]:
    """``[runs."ROOT"]`` with each root a valid key prefix (kept without its trailing
    ``/``, named once) and each ``step_pattern`` a :class:`~fmstore.keys.StepPattern`."""
    out: dict[str, Any] = {}
    for root, table in runs.items():
        path: KeyPath = ("runs", root)
        try:
            name = validate_prefix(root).rstrip("/")
        except InvalidKey as e:
            problems.append(f'{origin.at(path)}: [runs."{root}"] is not a run root: {e.message}')
            continue
        if not name or name in out:
            why = "the tier's top" if not name else f"{name!r} twice"
            problems.append(f'{origin.at(path)}: [runs."{root}"] names {why}')
            continue
        if "step_pattern" in table:
            try:
                StepPattern(table["step_pattern"])
            except ValueError as e:
                problems.append(
                    f'{origin.at((*path, "step_pattern"))}: [runs."{root}"] step_pattern: {e}'
                )
                continue
        out[name] = table
    return out


def _apply_env(data: dict[str, Any], env: Mapping[str, str], origin: _Origin) -> None:
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
        origin.env[tuple(path)] = (var, value)


def _scalar(value: str) -> Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


# ---- checking against the schema -------------------------------------------------------

KeyPath = tuple[str | int, ...]


@dataclass(frozen=True)
class _Origin:
    """Where values came from, for messages: the file (its text, to find a key's line) and
    the environment variables that set values (path -> (variable, its text))."""

    source: str | None = None
    text: str | None = None
    env: dict[KeyPath, tuple[str, str]] = field(default_factory=dict)

    def at(self, path: KeyPath) -> str:
        """``fmstore.toml, line 7`` / ``fmstore.toml, set by $FMSTORE__S3__REGION``."""
        for n in range(len(path), 0, -1):
            if path[:n] in self.env:
                var = f"${self.env[path[:n]][0]}"
                return f"{self.source}, set by {var}" if self.source else var
        where = self.source or "config"
        if self.text is not None:
            lines = _key_lines(self.text)
            for n in range(len(path), 0, -1):
                if path[:n] in lines:
                    return f"{where}, line {lines[path[:n]]}"
        return where


def _children(pattern: str) -> set[str]:
    """Names of the tables that may appear in the table ``pattern``."""
    prefix = f"{pattern}." if pattern else ""
    names = {s[len(prefix) :].split(".")[0] for s in SCHEMA if s.startswith(prefix) and s != ""}
    return {n.removesuffix("[]") for n in names} - {"*"}


def _name(path: KeyPath) -> str:
    if path and isinstance(path[-1], int):
        return f"[[{'.'.join(map(str, path[:-1]))}]] #{path[-1] + 1}"
    return f"[{'.'.join(map(str, path))}]" if path else ""


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return f"{str(v).lower()} (a boolean)"
    if isinstance(v, str):
        return f'"{v if len(v) <= 60 else v[:57] + "..."}" (a string)'
    if isinstance(v, int | float):
        return f"{v} ({'an integer' if isinstance(v, int) else 'a number'})"
    if isinstance(v, list):
        return "an array"
    return "a table" if isinstance(v, Mapping) else repr(v)


def _table_of(v: Any, path: KeyPath, origin: _Origin, what: str = "a table") -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{origin.at(path)}: {_name(path)} must be {what}, not {_show(v)}")
    return v


def _checked(
    raw: Mapping[str, Any], pattern: str, path: KeyPath, origin: _Origin, problems: list[str]
) -> dict:
    """``raw`` (the table at ``path``, described by ``SCHEMA[pattern]``) with every key
    checked and converted; what is wrong with a key is added to ``problems`` and the key
    left out, so that every problem is found in one pass."""
    out: dict[str, Any] = {}
    for k, v in raw.items():
        try:
            out[k] = _checked_key(k, v, pattern, path, origin, problems)
        except ConfigError as e:
            problems.append(e.message)
    return out


def _checked_key(
    k: str, v: Any, pattern: str, path: KeyPath, origin: _Origin, problems: list[str]
) -> Any:
    keys, tables = SCHEMA.get(pattern, {}), _children(pattern)
    child, p = f"{pattern}.{k}" if pattern else k, (*path, k)
    if f"{child}.*" in SCHEMA:
        each = _table_of(v, p, origin, "a table of tables")
        return {
            n: _checked(_table_of(t, (*p, n), origin), f"{child}.*", (*p, n), origin, problems)
            for n, t in each.items()
        }
    if f"{child}[]" in SCHEMA:
        items = [v] if isinstance(v, Mapping) else v
        if not isinstance(items, list):
            raise ConfigError(f"{origin.at(p)}: {_name(p)} must be an array of tables")
        return [
            _checked(_table_of(t, (*p, i), origin), f"{child}[]", (*p, i), origin, problems)
            for i, t in enumerate(items)
        ]
    if k in tables:
        return _checked(_table_of(v, p, origin), child, p, origin, problems)
    if k in keys:
        return _value(keys[k], v, p, origin)
    if not pattern:
        raise ConfigError(
            f"{origin.at(p)}: unknown section or key {k!r}{_suggest(k, [*keys, *tables])}"
        )
    known = sorted({*keys, *tables})
    raise ConfigError(
        f"{origin.at(p)}: {_name(path)} unknown key {k!r}{_suggest(k, known)}; "
        f"allowed: {', '.join(known) or 'none yet'}"
    )


def _value(check: Check, v: Any, path: KeyPath, origin: _Origin) -> Any:
    try:
        return check.parse(v)
    except (ValueError, TypeError):
        pass
    if path in origin.env:  # a variable's text that TOML read as a number: the text itself
        try:
            return check.parse(origin.env[path][1])
        except (ValueError, TypeError):
            pass
    key = f"{_name(path[:-1])} {path[-1]}".strip()
    raise ConfigError(f"{origin.at(path)}: {key} must be {check.expected}, not {_show(v)}")


_SEG = r"""(?:[A-Za-z0-9_-]+|"[^"\\]*"|'[^']*')"""
_DOTTED = rf"{_SEG}(?:\s*\.\s*{_SEG})*"
_HEADER = re.compile(rf"\s*(\[\[?)\s*({_DOTTED})\s*\]")
_ASSIGN = re.compile(rf"\s*({_DOTTED})\s*=")


def _segments(dotted: str) -> tuple[str, ...]:
    return tuple(s.strip("\"'") for s in re.findall(_SEG, dotted))


def _key_lines(text: str) -> dict[KeyPath, int]:
    """The line (1-based) where each table and key of a TOML text first appears: a line
    scan good enough for messages (a nested array spread over lines may confuse it, then a
    message names the line of an enclosing key)."""
    lines: dict[KeyPath, int] = {}
    table: KeyPath = ()
    arrays: dict[KeyPath, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if m := _HEADER.match(line):
            parts = _segments(m.group(2))
            if m.group(1) == "[[":
                arrays[parts] = arrays.get(parts, -1) + 1
                table = (*parts, arrays[parts])
            else:
                table = parts
            lines.setdefault(table, n)
        elif m := _ASSIGN.match(line):
            lines.setdefault((*table, *_segments(m.group(1))), n)
    return lines


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


#: Environment variable naming this node (containers, several nodes on one host).
NODE_ENV = "FMSTORE_NODE_ID"
#: The one grammar of a node id, checked wherever one is read (environment, records,
#: leases, manifests, peers): ASCII letters, digits and ``._:@+-``, starting with a letter
#: or a digit (so never ``..``, a path or a line break), at most 200 characters.
NODE = r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,199}"
_NODE_RE = re.compile(NODE, re.ASCII)


def is_node_id(value: object) -> bool:
    """Whether ``value`` is a node id (a string of the one grammar, :data:`NODE`)."""
    return isinstance(value, str) and _NODE_RE.fullmatch(value) is not None


#: Environment variable naming this node's failure domain (set from the scheduler's
#: topology); it overrides ``[tiers.X] failure_domain``.
FAILURE_DOMAIN_ENV = "FMSTORE_FAILURE_DOMAIN"
_DOMAIN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,127}", re.ASCII)


def is_failure_domain(value: object) -> bool:
    """Whether ``value`` can name a failure domain: 1-128 ASCII letters, digits or
    ``._:@+/-``, starting with a letter or a digit."""
    return isinstance(value, str) and _DOMAIN_RE.fullmatch(value) is not None


def failure_domain(tier: TierConfig) -> str | None:
    """This node's failure domain for ``tier``: ``$FMSTORE_FAILURE_DOMAIN`` where set, else
    the tier's ``failure_domain``; None where neither says."""
    raw = os.environ.get(FAILURE_DOMAIN_ENV) or tier.failure_domain
    if raw is not None and not is_failure_domain(raw):
        raise ConfigError(
            f"failure domain {raw!r} (from ${FAILURE_DOMAIN_ENV} or [tiers.{tier.name}] "
            "failure_domain) must be 1-128 ASCII letters, digits or ._:@+/-"
        )
    return raw


def node_id() -> str:
    """This node's stable id: ``$FMSTORE_NODE_ID`` where set, else the host name.  The
    checkpoints' node parts and the dataset loader's node partitioning both use it."""
    import socket

    raw = os.environ.get(NODE_ENV) or socket.gethostname()
    if not is_node_id(raw):
        raise ConfigError(
            f"node id {raw!r} (from ${NODE_ENV} or the host name) must be 1-200 ASCII "
            "letters, digits or ._:@+-, starting with a letter or a digit"
        )
    return raw
