"""Policy objects (export, retention, release, restore rules) and their parsing and
validation from the ``[policies]`` section of ``fmstore.toml``; the decisions made from them
are in :mod:`fmstore.tiering.policy.policies`, which re-exports everything here."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ...config import Config
from ...errors import ConfigError
from ...units import parse_duration

# ---- policy objects ----------------------------------------------------------------------


@dataclass(frozen=True)
class ExportRule:
    """Copy checkpoints to ``to``: steps divisible by ``every_steps``; the ``every_saves``-th
    save after the newest checkpoint already on ``to``; any save at least ``every_seconds``
    after the previous one selected (a checkpoint is exported if any clause picks it); from
    ``source`` (default: the fastest tier above ``to`` holding a present copy: exports go down
    the ladder only; a ``from`` slower than ``to`` carries copies up).  See
    :func:`fmstore.tiering.policy.policies.wanted_tiers`."""

    to: str
    every_saves: int | None = None
    every_seconds: float | None = None
    source: str | None = None
    every_steps: int | None = None


@dataclass(frozen=True)
class RetentionRule:
    """Which copies on one tier to keep; a copy is kept if any rule keeps it.  A tier
    without a rule keeps everything."""

    keep_latest: int | None = None
    keep_every: int | None = None
    keep_for: float | None = None


@dataclass(frozen=True)
class ReleaseRule:
    """Drop copies on a fast tier once verified on one of ``durable``: after ``after``
    seconds without access, and/or while the file system is above ``high_watermark`` (down to
    ``low_watermark``), least recently accessed first."""

    after: float | None = None
    high_watermark: float | None = None
    low_watermark: float | None = None
    durable: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestoreRule:
    mode: Literal["lazy", "eager"] = "eager"
    cache_tier: str | None = None


@dataclass(frozen=True)
class Policies:
    """Every policy for one deployment; build with :func:`from_config` or directly, then
    call :meth:`validate` (``from_config`` does)."""

    ladder: tuple[str, ...]
    write_tier: str
    exports: tuple[ExportRule, ...] = ()
    retention: Mapping[str, RetentionRule] = field(default_factory=dict)
    release: Mapping[str, ReleaseRule] = field(default_factory=dict)
    restore: RestoreRule = RestoreRule()
    on_full: Literal["fail", "fallback"] = "fail"
    #: A training process is warned when an export has failed this many times in a row.
    warn_after_failures: int = 3
    #: How long a step waits on a shared tier for a node's part before the node holding
    #: that part's replica exports it in its place (seconds; :mod:`.replica_export`).
    replica_export_after: float = 600.0
    #: Tiers each node has its own copy of (``scope = "node"``): a checkpoint there may be
    #: in node parts, and what every node decides of it must come out alike on every node
    #: (``docs/distributed.md``: cadence and retention of parts).
    node_tiers: tuple[str, ...] = ()

    def rank(self, tier: str) -> int:
        return self.ladder.index(tier)

    def durable_for(self, tier: str) -> tuple[str, ...]:
        rule = self.release.get(tier)
        if rule is not None and rule.durable:
            return rule.durable
        return self.ladder[self.rank(tier) + 1 :]

    def validate(self, tiers: Iterable[str] | None = None) -> Policies:
        """Raise :class:`ConfigError` naming the first problem; returns ``self``."""
        _validate(self, set(tiers) if tiers is not None else None)
        return self


# ---- parsing and validation --------------------------------------------------------------


_TOP_KEYS = {
    "ladder",
    "write_tier",
    "on_full",
    "warn_after_failures",
    "replica_export_after",
    "export",
    "retention",
    "release",
    "restore",
}
_EXPORT_KEYS = {"to", "from", "every_saves", "every_steps", "every_seconds"}
_RETENTION_KEYS = {"keep_latest", "keep_every", "keep_for"}
_RELEASE_KEYS = {"after", "high_watermark", "low_watermark", "durable"}
_RESTORE_KEYS = {"mode", "cache_tier"}


def from_config(config: Config) -> Policies:
    """The ``[policies]`` section of ``config``, parsed and validated against its tiers."""
    return from_dict(
        config.section("policies"),
        tiers=list(config.tiers),
        where=config.source,
        node_tiers=[t for t, c in config.tiers.items() if c.scope == "node"],
    )


def from_dict(
    data: Mapping[str, Any],
    *,
    tiers: Sequence[str],
    where: str | None = None,
    node_tiers: Sequence[str] = (),
) -> Policies:
    """Parse a ``[policies]`` table; ``tiers``: the configured tier names, in config order;
    ``node_tiers``: those of them with ``scope = "node"``."""
    w = f"{where or 'config'}: [policies]"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{w} must be a table")
    _unknown(w, data, _TOP_KEYS)
    default_ladder = [t for t in ("nvme", "lustre", "s3") if t in tiers] or list(tiers)
    ladder = data.get("ladder", default_ladder)
    if not isinstance(ladder, list) or not all(isinstance(t, str) for t in ladder):
        raise ConfigError(f"{w} ladder must be a list of tier names, fastest first")
    if not ladder:
        raise ConfigError(f"{w} no tiers: configure [tiers] or set policies.ladder")
    write_tier = data.get("write_tier", ladder[0])
    on_full = data.get("on_full", "fail")
    if on_full not in ("fail", "fallback"):
        raise ConfigError(f"{w} on_full must be 'fail' or 'fallback', not {on_full!r}")

    warn_after = data.get("warn_after_failures", 3)
    if not isinstance(warn_after, int) or isinstance(warn_after, bool) or warn_after < 1:
        raise ConfigError(f"{w} warn_after_failures must be a whole number >= 1")
    rea = data.get("replica_export_after")
    replica_after = (
        600.0 if rea is None else parse_duration(rea, f"{w} replica_export_after", allow_zero=True)
    )
    raw_exports = data.get("export", [])
    if isinstance(raw_exports, Mapping):
        raw_exports = [raw_exports]
    if not isinstance(raw_exports, list):
        raise ConfigError(f"{w} export must be an array of tables ([[policies.export]])")
    exports = []
    for i, e in enumerate(raw_exports):
        ew = f"{w} export #{i + 1}"
        if not isinstance(e, Mapping):
            raise ConfigError(f"{ew} must be a table")
        _unknown(ew, e, _EXPORT_KEYS)
        if "to" not in e:
            raise ConfigError(f"{ew} needs 'to' (the destination tier)")
        every_saves, every_steps = e.get("every_saves"), e.get("every_steps")
        for name, n in (("every_saves", every_saves), ("every_steps", every_steps)):
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise ConfigError(f"{ew} {name} must be a whole number >= 1, not {n!r}")
        every_seconds = e.get("every_seconds")
        exports.append(
            ExportRule(
                to=str(e["to"]),
                every_saves=every_saves,
                every_steps=every_steps,
                every_seconds=(
                    parse_duration(every_seconds, f"{ew} every_seconds")
                    if every_seconds is not None
                    else None
                ),
                source=str(e["from"]) if "from" in e else None,
            )
        )

    retention: dict[str, RetentionRule] = {}
    raw_ret = data.get("retention", {})
    if not isinstance(raw_ret, Mapping):
        raise ConfigError(f"{w} retention must be a table of per-tier tables")
    for tier, r in raw_ret.items():
        rw = f"{w} retention.{tier}"
        if not isinstance(r, Mapping):
            raise ConfigError(f"{rw} must be a table")
        _unknown(rw, r, _RETENTION_KEYS)
        keep_latest, keep_every = r.get("keep_latest"), r.get("keep_every")
        for name, v, least in (("keep_latest", keep_latest, 0), ("keep_every", keep_every, 1)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < least):
                raise ConfigError(f"{rw} {name} must be a whole number >= {least}, not {v!r}")
        keep_for = r.get("keep_for")
        retention[tier] = RetentionRule(
            keep_latest=keep_latest,
            keep_every=keep_every,
            keep_for=parse_duration(keep_for, f"{rw} keep_for") if keep_for is not None else None,
        )

    release: dict[str, ReleaseRule] = {}
    raw_rel = data.get("release", {})
    if not isinstance(raw_rel, Mapping):
        raise ConfigError(f"{w} release must be a table of per-tier tables")
    for tier, r in raw_rel.items():
        lw = f"{w} release.{tier}"
        if not isinstance(r, Mapping):
            raise ConfigError(f"{lw} must be a table")
        _unknown(lw, r, _RELEASE_KEYS)
        durable = r.get("durable", [])
        if not isinstance(durable, list) or not all(isinstance(t, str) for t in durable):
            raise ConfigError(f"{lw} durable must be a list of tier names")
        hi, lo = r.get("high_watermark"), r.get("low_watermark")
        for name, wm in (("high_watermark", hi), ("low_watermark", lo)):
            if wm is not None and (
                not isinstance(wm, int | float) or isinstance(wm, bool) or not 0 < wm <= 1
            ):
                raise ConfigError(f"{lw} {name} must be a fraction in (0, 1], not {wm!r}")
        release[tier] = ReleaseRule(
            after=parse_duration(r["after"], f"{lw} after") if "after" in r else None,
            high_watermark=float(hi) if hi is not None else None,
            low_watermark=float(lo) if lo is not None else None,
            durable=tuple(durable),
        )

    raw_restore = data.get("restore", {})
    if not isinstance(raw_restore, Mapping):
        raise ConfigError(f"{w} restore must be a table")
    _unknown(f"{w} restore", raw_restore, _RESTORE_KEYS)
    mode = raw_restore.get("mode", "eager")
    if mode not in ("lazy", "eager"):
        raise ConfigError(f"{w} restore.mode must be 'lazy' or 'eager', not {mode!r}")
    cache_tier = raw_restore.get("cache_tier")
    policies = Policies(
        ladder=tuple(ladder),
        write_tier=str(write_tier),
        exports=tuple(exports),
        retention=retention,
        release=release,
        restore=RestoreRule(mode=mode, cache_tier=str(cache_tier) if cache_tier else None),
        on_full=on_full,
        warn_after_failures=warn_after,
        replica_export_after=replica_after,
        node_tiers=tuple(t for t in ladder if t in node_tiers),
    )
    _validate(policies, set(tiers), where=w)
    for e in policies.exports:
        sources = [e.source] if e.source else list(policies.ladder[: policies.rank(e.to)])
        local = [t for t in sources if t in policies.node_tiers and t != e.to]
        if e.every_seconds is not None and local:
            # Each node would pick by its own history and clock: nodes would export
            # different steps, and a step commits on the destination only with every part.
            raise ConfigError(
                f"{w} export to {e.to!r}: every_seconds cannot be decided alike by every node "
                f'for checkpoints on node-local tier {local[0]!r} (scope = "node"); use '
                "every_steps or every_saves (docs/distributed.md)"
            )
    return policies


def _unknown(where: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{where}: unknown key {key!r}{hint}; allowed: {', '.join(sorted(allowed))}"
            )


def _validate(p: Policies, tiers: set[str] | None, where: str = "[policies]") -> None:
    def known(tier: str, what: str) -> None:
        if tiers is not None and tier not in tiers:
            close = difflib.get_close_matches(tier, sorted(tiers), n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{where} {what} names tier {tier!r}, which is not configured{hint}; "
                f"configured tiers: {', '.join(sorted(tiers)) or 'none'}"
            )
        if tier not in p.ladder:
            raise ConfigError(
                f"{where} {what} names tier {tier!r}, which is not in the ladder {list(p.ladder)}"
            )

    if len(set(p.ladder)) != len(p.ladder):
        raise ConfigError(f"{where} ladder lists a tier twice: {list(p.ladder)}")
    if tiers is not None:
        for t in p.ladder:
            if t not in tiers:
                known(t, "ladder")
    known(p.write_tier, "write_tier")
    if p.on_full not in ("fail", "fallback"):
        raise ConfigError(f"{where} on_full must be 'fail' or 'fallback'")
    if p.on_full == "fallback" and p.rank(p.write_tier) == len(p.ladder) - 1:
        raise ConfigError(
            f"{where} on_full = 'fallback' but the write tier {p.write_tier!r} is the last "
            "of the ladder: there is nothing to fall back to"
        )
    targets: set[str] = set()
    for i, e in enumerate(p.exports):
        what = f"export #{i + 1} to"
        known(e.to, what)
        if e.every_saves is None and e.every_steps is None and e.every_seconds is None:
            raise ConfigError(
                f"{where} export #{i + 1} to {e.to!r} needs every_steps, every_saves and/or "
                "every_seconds"
            )
        if e.to == p.write_tier:
            raise ConfigError(f"{where} export #{i + 1} exports to the write tier {e.to!r} itself")
        if e.source is not None:
            known(e.source, f"export #{i + 1} from")
            if e.source == e.to:
                raise ConfigError(f"{where} export #{i + 1} copies {e.to!r} onto itself")
        if e.to in targets:
            raise ConfigError(f"{where} two export rules go to {e.to!r}; merge them into one")
        targets.add(e.to)
    for tier, r in p.retention.items():
        known(tier, "retention")
        if r.keep_latest is None and r.keep_every is None and r.keep_for is None:
            raise ConfigError(
                f"{where} retention.{tier} has no rule (keep_latest, keep_every or keep_for); "
                "remove the table to keep everything"
            )
        keeps_nothing = (r.keep_latest or 0) == 0 and r.keep_every is None and r.keep_for is None
        if keeps_nothing and tier in targets:
            raise ConfigError(
                f"{where} retention.{tier} keeps nothing (keep_latest = 0) but an export copies "
                f"checkpoints to {tier!r}: every export would be deleted at once"
            )
        if keeps_nothing and not any(e.to != tier for e in p.exports):
            raise ConfigError(
                f"{where} retention.{tier} keeps nothing but no export copies checkpoints "
                "anywhere else: every checkpoint would be its own last copy"
            )
    for tier, rel in p.release.items():
        known(tier, "release")
        if rel.after is None and rel.high_watermark is None:
            raise ConfigError(f"{where} release.{tier} needs 'after' and/or 'high_watermark'")
        if (rel.high_watermark is None) != (rel.low_watermark is None):
            raise ConfigError(f"{where} release.{tier} needs both high_watermark and low_watermark")
        if (
            rel.high_watermark is not None
            and rel.low_watermark is not None
            and rel.low_watermark >= rel.high_watermark
        ):
            raise ConfigError(
                f"{where} release.{tier} low_watermark ({rel.low_watermark}) must be below "
                f"high_watermark ({rel.high_watermark})"
            )
        durable = p.durable_for(tier)
        if not durable:
            raise ConfigError(
                f"{where} release.{tier}: {tier!r} is the last tier of the ladder; there is no "
                "durable tier below it to release to"
            )
        for d in durable:
            known(d, f"release.{tier} durable")
            if d == tier:
                raise ConfigError(f"{where} release.{tier} lists {tier!r} as its own durable tier")
        if not any(d in targets for d in durable):
            raise ConfigError(
                f"{where} release.{tier} waits for a copy on {list(durable)}, but no export "
                "rule copies checkpoints there: nothing would ever be released"
            )
    if p.restore.cache_tier is not None:
        known(p.restore.cache_tier, "restore.cache_tier")
