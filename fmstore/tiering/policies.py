"""Export, retention, release and restore policies: declared in TOML, objects in Python,
validated at start-up, applied by pure decision functions.

The ``[policies]`` section of ``fmstore.toml``::

    [policies]
    ladder = ["nvme", "lustre", "s3"]   # fastest first; default: the configured tiers
    write_tier = "nvme"                 # where CheckpointManager.save writes
    on_full = "fallback"                # or "fail": what save does when the write tier is full

    [[policies.export]]                 # one table per destination
    to = "lustre"
    every_saves = 1                     # the 1st, 2nd, … save; and/or
    every_seconds = 600                 # a save at least this long after the last one exported
    [[policies.export]]
    to = "s3"
    every_saves = 5

    [policies.retention.nvme]           # kept if ANY rule keeps it
    keep_latest = 2
    [policies.retention.lustre]
    keep_latest = 10
    keep_every = 1000                   # steps divisible by 1000
    keep_for = "7d"                     # created within the last 7 days

    [policies.release.nvme]             # drop the copy once verified on a durable tier
    after = "30m"                       # since the last access; and/or
    high_watermark = 0.90               # file system fuller than 90 % → release down to 70 %
    low_watermark = 0.70
    durable = ["lustre", "s3"]          # default: every slower tier of the ladder

    [policies.restore]
    mode = "lazy"                       # or "eager"
    cache_tier = "nvme"

Guarantees of :func:`plan` (the decision function; state in, actions out):

* it never deletes or releases the only complete (``present``) copy of a checkpoint, counting
  the other decisions it makes in the same call;
* it never deletes or releases a copy of a checkpoint that is pinned (being restored), being
  written or exported, or that still has an export to do;
* it is deterministic in its input, so the daemon can re-plan after a crash and reach the
  same target: which tiers a checkpoint belongs on depends only on the catalog's save
  ordinals and creation times, never on when the daemon happened to look.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config import Config
from ..errors import ConfigError
from ..units import parse_duration
from .catalog import CORRUPT, EXPORTING, PRESENT, WRITING, Checkpoint, Copy, Pin

# ---- policy objects ----------------------------------------------------------------------


@dataclass(frozen=True)
class ExportRule:
    """Copy checkpoints to ``to``: every ``every_saves``-th save and/or any save at least
    ``every_seconds`` after the previous one selected; from ``source`` (default: the fastest
    tier holding a present copy)."""

    to: str
    every_saves: int | None = None
    every_seconds: float | None = None
    source: str | None = None


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


_TOP_KEYS = {"ladder", "write_tier", "on_full", "export", "retention", "release", "restore"}
_EXPORT_KEYS = {"to", "from", "every_saves", "every_seconds"}
_RETENTION_KEYS = {"keep_latest", "keep_every", "keep_for"}
_RELEASE_KEYS = {"after", "high_watermark", "low_watermark", "durable"}
_RESTORE_KEYS = {"mode", "cache_tier"}


def from_config(config: Config) -> Policies:
    """The ``[policies]`` section of ``config``, parsed and validated against its tiers."""
    return from_dict(config.section("policies"), tiers=list(config.tiers), where=config.source)


def from_dict(
    data: Mapping[str, Any], *, tiers: Sequence[str], where: str | None = None
) -> Policies:
    """Parse a ``[policies]`` table; ``tiers``: the configured tier names, in config order."""
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
        every_saves = e.get("every_saves")
        if every_saves is not None and (
            not isinstance(every_saves, int) or isinstance(every_saves, bool) or every_saves < 1
        ):
            raise ConfigError(f"{ew} every_saves must be a whole number >= 1, not {every_saves!r}")
        every_seconds = e.get("every_seconds")
        exports.append(
            ExportRule(
                to=str(e["to"]),
                every_saves=every_saves,
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
    )
    _validate(policies, set(tiers), where=w)
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
        if e.every_saves is None and e.every_seconds is None:
            raise ConfigError(
                f"{where} export #{i + 1} to {e.to!r} needs every_saves and/or every_seconds"
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


# ---- decisions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Export:
    root: str
    step: int
    source: str
    dest: str


@dataclass(frozen=True)
class Delete:
    """Retention: remove the copy from the tier."""

    root: str
    step: int
    tier: str


@dataclass(frozen=True)
class Release:
    """Drop the fast-tier copy; a verified durable copy exists."""

    root: str
    step: int
    tier: str


Action = Export | Delete | Release


@dataclass(frozen=True)
class TierUsage:
    used: int
    total: int

    @property
    def fraction(self) -> float:
        return self.used / self.total if self.total else 0.0


@dataclass(frozen=True)
class State:
    """What the decision functions look at: the catalog, live pins, the time, and each
    tier's file-system usage (for watermarks; tiers without a local file system absent)."""

    checkpoints: Sequence[Checkpoint]
    copies: Sequence[Copy]
    pins: Sequence[Pin] = ()
    now: float = 0.0
    usage: Mapping[str, TierUsage] = field(default_factory=dict)


def wanted_tiers(p: Policies, checkpoints: Sequence[Checkpoint]) -> dict[tuple[str, int], set[str]]:
    """For each checkpoint, the tiers its export rules want it on (besides where it was
    written).  Depends only on save ordinals and creation times: deterministic."""
    out: dict[tuple[str, int], set[str]] = {(c.root, c.step): set() for c in checkpoints}
    by_root: dict[str, list[Checkpoint]] = {}
    for c in checkpoints:
        by_root.setdefault(c.root, []).append(c)
    for rule in p.exports:
        for cks in by_root.values():
            last: float | None = None
            for c in sorted(cks, key=lambda c: c.seq):
                pick = bool(rule.every_saves and c.seq % rule.every_saves == 0)
                if rule.every_seconds is not None and (
                    last is None or c.created - last >= rule.every_seconds
                ):
                    pick = True
                if pick:
                    out[(c.root, c.step)].add(rule.to)
                    last = c.created
    return out


def _index(copies: Sequence[Copy]) -> dict[tuple[str, int], dict[str, Copy]]:
    idx: dict[tuple[str, int], dict[str, Copy]] = {}
    for cp in copies:
        idx.setdefault((cp.root, cp.step), {})[cp.tier] = cp
    return idx


def plan_exports(p: Policies, s: State) -> list[Export]:
    """Copies still to make, oldest checkpoint first.  A destination copy that is absent,
    half-written (``writing``/``exporting``: resumed), ``corrupt`` or ``missing`` is (re)made;
    one deleted or released later by policy is not."""
    idx = _index(s.copies)
    out: list[Export] = []
    wanted = wanted_tiers(p, s.checkpoints)
    rules = {e.to: e for e in p.exports}
    for c in sorted(s.checkpoints, key=lambda c: (c.created, c.root, c.step)):
        copies = idx.get((c.root, c.step), {})
        present = [t for t in p.ladder if t in copies and copies[t].state == PRESENT]
        if not present:
            continue  # not committed anywhere (yet)
        for dest in sorted(wanted[(c.root, c.step)], key=p.rank):
            cur = copies.get(dest)
            if cur is not None and cur.state not in (WRITING, EXPORTING, CORRUPT, "missing"):
                continue
            src_rule = rules[dest].source
            sources = [src_rule] if src_rule else present
            source = next((t for t in sources if t in present and t != dest), None)
            if source is not None:
                out.append(Export(c.root, c.step, source, dest))
    return out


def _blocked(p: Policies, s: State) -> set[tuple[str, int]]:
    """Checkpoints no copy of which may be deleted or released now."""
    blocked = {(pin.root, pin.step) for pin in s.pins if pin.expires >= s.now}
    for cp in s.copies:
        if cp.state in (WRITING, EXPORTING):
            blocked.add((cp.root, cp.step))
    for e in plan_exports(p, s):
        blocked.add((e.root, e.step))
    return blocked


def plan_retention(p: Policies, s: State) -> list[Delete]:
    """Copies that no retention rule keeps, minus every copy that must stay (see module
    docstring)."""
    ckpts = {(c.root, c.step): c for c in s.checkpoints}
    idx = _index(s.copies)
    blocked = _blocked(p, s)
    complete = {k: {t for t, cp in v.items() if cp.state == PRESENT} for k, v in idx.items()}
    out: list[Delete] = []
    for tier in p.ladder:
        rule = p.retention.get(tier)
        if rule is None:
            continue
        on_tier: dict[str, list[Copy]] = {}
        for cp in s.copies:
            if cp.tier == tier and cp.state in (PRESENT, CORRUPT):
                on_tier.setdefault(cp.root, []).append(cp)
        for root, cps in on_tier.items():
            latest = sorted((cp.step for cp in cps if cp.state == PRESENT), reverse=True)
            keep_latest = set(latest[: rule.keep_latest or 0])
            for cp in sorted(cps, key=lambda cp: cp.step):
                key = (root, cp.step)
                ck = ckpts.get(key)
                kept = (
                    cp.step in keep_latest
                    or (rule.keep_every is not None and cp.step % rule.keep_every == 0)
                    or (
                        rule.keep_for is not None
                        and ck is not None
                        and s.now - ck.created < rule.keep_for
                    )
                )
                if kept or key in blocked:
                    continue
                others = complete.get(key, set()) - {tier}
                if cp.state == PRESENT and not others:
                    continue  # the only complete copy: never
                out.append(Delete(root, cp.step, tier))
                complete.get(key, set()).discard(tier)
    return out


def plan_release(p: Policies, s: State, *, after_deletes: Sequence[Delete] = ()) -> list[Release]:
    """Fast-tier copies to drop: verified durable copy elsewhere, not blocked, then by age
    since last access and/or down to the low watermark (least recently used first)."""
    idx = _index(s.copies)
    blocked = _blocked(p, s)
    gone = {(d.root, d.step, d.tier) for d in after_deletes}
    ckpts = {(c.root, c.step): c for c in s.checkpoints}
    out: list[Release] = []
    for tier, rule in p.release.items():
        durable = p.durable_for(tier)
        candidates: list[Copy] = []
        for key, copies in idx.items():
            cp = copies.get(tier)
            if cp is None or cp.state != PRESENT or key in blocked or (*key, tier) in gone:
                continue
            if not any(
                (d := copies.get(t)) is not None
                and d.state == PRESENT
                and d.verified is not None
                and (*key, t) not in gone
                for t in durable
            ):
                continue
            candidates.append(cp)

        def last_used(cp: Copy) -> float:
            ck = ckpts.get((cp.root, cp.step))
            return cp.last_access or (ck.created if ck else cp.created)

        chosen: dict[tuple[str, int], Copy] = {}
        if rule.after is not None:
            for cp in candidates:
                if s.now - last_used(cp) >= rule.after:
                    chosen[(cp.root, cp.step)] = cp
        usage = s.usage.get(tier)
        if rule.high_watermark is not None and usage is not None and usage.total > 0:
            used = usage.used - sum(cp.bytes for cp in chosen.values())
            if used / usage.total > rule.high_watermark:
                target = (rule.low_watermark or rule.high_watermark) * usage.total
                for cp in sorted(candidates, key=lambda cp: (last_used(cp), cp.step)):
                    if used <= target:
                        break
                    if (cp.root, cp.step) not in chosen:
                        chosen[(cp.root, cp.step)] = cp
                        used -= cp.bytes
        out.extend(Release(cp.root, cp.step, tier) for cp in chosen.values())
    return sorted(out, key=lambda r: (r.root, r.step, r.tier))


def plan(p: Policies, s: State) -> list[Action]:
    """Everything to do now: exports first (oldest first), then deletions, then releases.
    Safe to call again after any subset was carried out: it recomputes from the state."""
    exports = plan_exports(p, s)
    deletes = plan_retention(p, s)
    releases = plan_release(p, s, after_deletes=deletes)
    return [*exports, *deletes, *releases]


def export_lag(p: Policies, s: State) -> float:
    """Seconds since the oldest committed checkpoint that still has an export to do was
    created (0 when nothing waits)."""
    ckpts = {(c.root, c.step): c for c in s.checkpoints}
    waiting = [ckpts[(e.root, e.step)].created for e in plan_exports(p, s)]
    return max(0.0, s.now - min(waiting)) if waiting else 0.0
