"""Export, retention, release and restore policies: declared in TOML, objects in Python,
validated at start-up, applied by pure decision functions.

The ``[policies]`` section of ``fmstore.toml``::

    [policies]
    ladder = ["nvme", "lustre", "s3"]   # fastest first; default: the configured tiers
    write_tier = "nvme"                 # where CheckpointManager.save writes
    on_full = "fallback"                # or "fail": what save does when the write tier is full

    [[policies.export]]                 # one table per destination
    to = "lustre"
    every_saves = 1                     # the N-th save after the last one on 'lustre'; and/or
    every_seconds = 600                 # a save at least this long after the last one exported
    [[policies.export]]
    to = "s3"
    every_steps = 5000                  # steps divisible by 5000

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

The policy objects and their parsing live in :mod:`fmstore.tiering.policy.rules` and are
re-exported here.  Guarantees of :func:`plan` (state in, actions out):

* a copy that no rule keeps is deleted, the last copy of its checkpoint included, unless the
  checkpoint is pinned (being restored) or being written, an export still to do (planned,
  or left ``exporting``) would have no verified source left without it (any complete,
  verified copy on another tier serves, or the rule's ``from`` tier), or another tier's
  rule keeps a broken (corrupt, missing) copy of it that this copy could repair; a copy
  some rule keeps is never deleted (docs/tiering.md has the table);
* it never releases a copy without a verified durable copy, nor one of a checkpoint that is
  pinned or being written, nor one an export still to do needs as its source;
* a pending export is superseded (skipped) when a newer checkpoint that the same rule
  wants is committed and the destination's retention would not keep the older one;
* it is deterministic in its input, so the daemon can re-plan after a crash and reach the
  same target: which tiers a checkpoint belongs on depends only on the run's steps, their
  creation times and which steps the destination already holds (what a rescan of the
  tiers finds again), never on the order the catalog learnt of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..inventory.catalog import CORRUPT, EXPORTING, MISSING, PRESENT, WRITING, Checkpoint, Copy, Pin
from .rules import (
    ExportRule,
    Policies,
    ReleaseRule,
    RestoreRule,
    RetentionRule,
    from_config,
    from_dict,
)

__all__ = [
    "Action",
    "Delete",
    "Export",
    "ExportLag",
    "ExportRule",
    "Policies",
    "Release",
    "ReleaseRule",
    "RestoreRule",
    "RetentionRule",
    "State",
    "Supersede",
    "TierUsage",
    "export_lag",
    "export_lags",
    "from_config",
    "from_dict",
    "plan",
    "plan_exports",
    "plan_release",
    "plan_retention",
    "plan_supersede",
    "wanted_tiers",
]


@dataclass(frozen=True)
class Export:
    root: str
    step: int
    source: str
    dest: str


@dataclass(frozen=True)
class Supersede:
    """Backlog control: skip the pending export of ``step`` to ``dest`` (recorded as
    ``superseded``): a newer checkpoint the same rule wants is committed, and ``dest``'s
    retention would not keep this one once the newer ones are there."""

    root: str
    step: int
    source: str
    dest: str


@dataclass(frozen=True)
class Delete:
    """Retention: remove the copy from the tier.  ``last_copy``: no other complete copy of
    the checkpoint exists, and no rule keeps it anywhere: the checkpoint goes."""

    root: str
    step: int
    tier: str
    last_copy: bool = False


@dataclass(frozen=True)
class Release:
    """Drop the fast-tier copy; a verified durable copy exists."""

    root: str
    step: int
    tier: str


Action = Export | Supersede | Delete | Release


@dataclass(frozen=True)
class TierUsage:
    """A POSIX tier's file system: used and total bytes; ``replicas``: of the used bytes,
    those of the replicas this node holds of other nodes' parts (``.replicas/`` of a
    node-local tier), which no retention or release rule removes."""

    used: int
    total: int
    replicas: int = 0

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


def wanted_tiers(
    p: Policies, checkpoints: Sequence[Checkpoint], copies: Sequence[Copy] = ()
) -> dict[tuple[str, int], set[str]]:
    """For each checkpoint, the tiers its export rules want it on (besides where it was
    written).

    Per run root, the checkpoints are walked in step order (never in the order the catalog
    recorded them): ``every_steps = N`` picks steps divisible by N; ``every_saves = N``
    picks the N-th checkpoint after the newest one already on the destination (any catalog
    row there counts, so a rebuilt catalog resumes the count where the tiers say it is);
    ``every_seconds`` picks one created at least that long after the previous pick.
    """
    out: dict[tuple[str, int], set[str]] = {(c.root, c.step): set() for c in checkpoints}
    # With node-local tiers every node must pick alike, so only what every node sees counts:
    # copies committed on the (shared) destination, never a node's own rows (a superseded,
    # deleted or half-made export) that a replaced node would not have.
    on = {(cp.root, cp.step, cp.tier) for cp in copies if not p.node_tiers or cp.state == PRESENT}
    by_root: dict[str, list[Checkpoint]] = {}
    for c in checkpoints:
        by_root.setdefault(c.root, []).append(c)
    for rule in p.exports:
        for cks in by_root.values():
            since = 0
            last: float | None = None
            for c in sorted(cks, key=lambda c: c.step):
                pick = bool(rule.every_steps and c.step % rule.every_steps == 0)
                if rule.every_saves:
                    since += 1
                    pick = pick or since >= rule.every_saves or (c.root, c.step, rule.to) in on
                if rule.every_seconds is not None and (
                    last is None or c.created - last >= rule.every_seconds
                ):
                    pick = True
                if pick:
                    out[(c.root, c.step)].add(rule.to)
                    since, last = 0, c.created
    return out


def _index(copies: Sequence[Copy]) -> dict[tuple[str, int], dict[str, Copy]]:
    idx: dict[tuple[str, int], dict[str, Copy]] = {}
    for cp in copies:
        idx.setdefault((cp.root, cp.step), {})[cp.tier] = cp
    return idx


def _candidates(p: Policies, s: State) -> list[Export]:
    """Every copy the export rules want and no tier holds yet, with its source, oldest
    first.  A destination copy that is absent, half-written (``writing``/``exporting``:
    resumed), ``corrupt`` or ``missing`` is (re)made; one deleted, released or superseded
    is not."""
    idx = _index(s.copies)
    out: list[Export] = []
    wanted = wanted_tiers(p, s.checkpoints, s.copies)
    rules = {e.to: e for e in p.exports}
    for c in sorted(s.checkpoints, key=lambda c: (c.created, c.root, c.step)):
        copies = idx.get((c.root, c.step), {})
        present = [t for t in p.ladder if t in copies and copies[t].state == PRESENT]
        if not present:
            continue  # not committed anywhere (yet)
        for dest in sorted(wanted[(c.root, c.step)], key=p.rank):
            cur = copies.get(dest)
            if cur is not None and cur.state not in (WRITING, EXPORTING, CORRUPT, MISSING):
                continue
            source = _source(p, rules[dest].source, dest, present)
            if source is not None:
                out.append(Export(c.root, c.step, source, dest))
    return out


def _source(p: Policies, rule_from: str | None, dest: str, present: Sequence[str]) -> str | None:
    """Where an export to ``dest`` reads: the rule's ``from`` tier when it names one (the
    only way to carry a copy up the ladder), else the fastest tier above ``dest`` holding a
    complete copy.  Exports go down the ladder only: a checkpoint found on S3 alone (an
    older run, another config's run on a shared prefix) is listed, never pulled into
    Lustre; bringing a copy up is a restore (``cache_tier``)."""
    if rule_from is not None:
        return rule_from if rule_from in present and rule_from != dest else None
    return next((t for t in present if p.rank(t) < p.rank(dest)), None)


def _coalesce(p: Policies, s: State) -> tuple[list[Export], list[Supersede]]:
    """Split the candidate exports into those to make and those superseded."""
    cands = _candidates(p, s)
    ckpts = {(c.root, c.step): c for c in s.checkpoints}
    on_dest: dict[tuple[str, str], set[int]] = {}
    for cp in s.copies:
        if cp.state == PRESENT:
            on_dest.setdefault((cp.root, cp.tier), set()).add(cp.step)
    # A copy that another rule exports *from* (``from = dest``) is a stage of that export,
    # not only a copy for dest's sake: never skipped while that export waits for it.
    wanted = wanted_tiers(p, s.checkpoints, s.copies)
    relays = {e.to: [r.to for r in p.exports if r.source == e.to] for e in p.exports}

    def relay(e: Export) -> bool:
        return any(
            nxt in wanted[(e.root, e.step)] and e.step not in on_dest.get((e.root, nxt), set())
            for nxt in relays[e.dest]
        )

    queued: dict[tuple[str, str], list[Export]] = {}
    for e in cands:
        queued.setdefault((e.root, e.dest), []).append(e)
    keep: list[Export] = []
    skip: list[Supersede] = []
    for (root, dest), exports in queued.items():
        rule = p.retention.get(dest)
        if rule is None:  # the destination keeps everything: every export matters
            keep.extend(exports)
            continue
        # What the destination will hold once the queue is done; keep_latest counts it.
        will_hold = sorted(on_dest.get((root, dest), set()) | {e.step for e in exports})
        latest = set(will_hold[len(will_hold) - rule.keep_latest :] if rule.keep_latest else [])
        newest = max(will_hold)
        for e in exports:
            ck = ckpts[(root, e.step)]
            kept = (
                e.step in latest
                or (rule.keep_every is not None and e.step % rule.keep_every == 0)
                or (rule.keep_for is not None and s.now - ck.created < rule.keep_for)
            )
            if kept or e.step >= newest or relay(e):
                keep.append(e)
            else:
                skip.append(Supersede(root, e.step, e.source, dest))
    return keep, skip


def plan_exports(p: Policies, s: State) -> list[Export]:
    """Copies still to make after coalescing (see :func:`plan_supersede`), newest
    checkpoint first, so the newest one is always next."""
    keep, _ = _coalesce(p, s)
    ckpts = {(c.root, c.step): c for c in s.checkpoints}
    return sorted(
        keep,
        key=lambda e: (-ckpts[(e.root, e.step)].created, -e.step, e.root, p.rank(e.dest)),
    )


def plan_supersede(p: Policies, s: State) -> list[Supersede]:
    """Pending exports to skip: for each root and destination with a retention rule, an
    export is superseded when a newer checkpoint the same rule wants is committed (has a
    present copy somewhere) and the destination's rule would not keep the older one once
    the queue is done (not among its ``keep_latest`` newest, not a ``keep_every`` step, not
    younger than ``keep_for``).  A destination without a retention table keeps every
    export."""
    return sorted(_coalesce(p, s)[1], key=lambda a: (a.root, a.step, p.rank(a.dest)))


def _blocked(p: Policies, s: State) -> set[tuple[str, int]]:
    """Checkpoints no copy of which may be deleted or released now: pinned (being
    restored), or with a copy being written."""
    blocked = {(pin.root, pin.step) for pin in s.pins if pin.expires >= s.now}
    for cp in s.copies:
        if cp.state == WRITING:
            blocked.add((cp.root, cp.step))
    return blocked


class _Sources:
    """The copies the exports still to make may read from.  A pending export (planned, or a
    destination copy left ``exporting``) may be served by any complete, verified copy on
    a tier above its destination (its ``from`` tier when it names one), so a copy may go
    while another such copy stays: a destination that keeps failing never holds the
    faster tiers' copies once a slower tier has a verified one."""

    def __init__(self, p: Policies, s: State) -> None:
        self.p = p
        rules = {e.to: e.source for e in p.exports}
        self.pending: dict[tuple[str, int], set[tuple[str, str | None]]] = {}
        for e in plan_exports(p, s):
            self.pending.setdefault((e.root, e.step), set()).add((e.dest, rules.get(e.dest)))
        for cp in s.copies:
            if cp.state == EXPORTING:
                dest = (cp.tier, rules.get(cp.tier))
                self.pending.setdefault((cp.root, cp.step), set()).add(dest)
        #: per checkpoint, the tiers holding a complete, verified copy
        self.verified: dict[tuple[str, int], set[str]] = {}
        for cp in s.copies:
            if cp.state == PRESENT and cp.verified is not None:
                self.verified.setdefault((cp.root, cp.step), set()).add(cp.tier)

    def may_drop(self, key: tuple[str, int], tier: str) -> bool:
        """Whether every pending export of ``key`` keeps a source without ``tier``'s copy."""
        for dest, source in self.pending.get(key, ()):
            if source is not None:
                if source == tier:
                    return False
                continue
            left = self.verified.get(key, set()) - {tier}
            if not any(self.p.rank(t) < self.p.rank(dest) for t in left):
                return False
        return True

    def dropped(self, key: tuple[str, int], tier: str) -> None:
        self.verified.get(key, set()).discard(tier)


def _kept(p: Policies, s: State) -> dict[tuple[str, int], set[str]]:
    """For each checkpoint, the tiers whose rule keeps its copy there (a tier without a
    table keeps every copy).  Looks at ``present``, ``corrupt`` and ``missing`` copies;
    ``keep_latest`` counts the tier's present copies of the root, newest step first."""
    ckpts = {(c.root, c.step): c for c in s.checkpoints}
    out: dict[tuple[str, int], set[str]] = {}
    latest: dict[tuple[str, str], set[int]] = {}
    present: dict[tuple[str, str], list[int]] = {}
    for cp in s.copies:
        if cp.state == PRESENT:
            present.setdefault((cp.root, cp.tier), []).append(cp.step)
    steps_of: dict[str, list[int]] = {}
    for c in s.checkpoints:
        steps_of.setdefault(c.root, []).append(c.step)
    for (root, tier), steps in present.items():
        rule = p.retention.get(tier)
        n = (rule.keep_latest or 0) if rule else 0
        if tier in p.node_tiers:
            # A node-local tier: the run's newest steps, whether this node still holds
            # them or released them, so that a release on one node never moves the window
            # of what the others keep.
            steps = steps_of.get(root, steps)
        latest[(root, tier)] = set(sorted(steps, reverse=True)[:n])
    for cp in s.copies:
        if cp.state not in (PRESENT, CORRUPT, MISSING):
            continue
        rule = p.retention.get(cp.tier)
        ck = ckpts.get((cp.root, cp.step))
        if (
            rule is None
            or cp.step in latest.get((cp.root, cp.tier), ())
            or (rule.keep_every is not None and cp.step % rule.keep_every == 0)
            or (rule.keep_for is not None and ck is not None and s.now - ck.created < rule.keep_for)
        ):
            out.setdefault((cp.root, cp.step), set()).add(cp.tier)
    return out


def plan_retention(p: Policies, s: State) -> list[Delete]:
    """Copies that no retention rule keeps, minus every copy that must stay (see the
    module docstring), fastest tier first."""
    idx = _index(s.copies)
    blocked = _blocked(p, s)
    sources = _Sources(p, s)
    kept = _kept(p, s)
    complete = {k: {t for t, cp in v.items() if cp.state == PRESENT} for k, v in idx.items()}
    shared = [t for t in p.ladder if t not in p.node_tiers]
    for c in _newest(s):
        # A node never deletes its part of a run's newest step while no shared tier holds
        # it: some rank could restore it from nowhere else.
        if not complete.get((c.root, c.step), set()) & set(shared):
            blocked.add((c.root, c.step))
    out: list[Delete] = []
    for tier in p.ladder:
        if tier not in p.retention:
            continue
        for cp in sorted(s.copies, key=lambda cp: (cp.root, cp.step)):
            if cp.tier != tier or cp.state not in (PRESENT, CORRUPT):
                continue
            key = (cp.root, cp.step)
            keepers = kept.get(key, set())
            if tier in keepers or key in blocked or not sources.may_drop(key, tier):
                continue
            last = not (complete.get(key, set()) - {tier})
            if last and keepers:
                continue  # another tier keeps a broken copy that only this one can repair
            out.append(Delete(cp.root, cp.step, tier, last_copy=last))
            complete.get(key, set()).discard(tier)
            sources.dropped(key, tier)
    return out


def _newest(s: State) -> list[Checkpoint]:
    """Each root's newest checkpoint."""
    out: dict[str, Checkpoint] = {}
    for c in s.checkpoints:
        if c.root not in out or c.step > out[c.root].step:
            out[c.root] = c
    return list(out.values())


def plan_release(p: Policies, s: State, *, after_deletes: Sequence[Delete] = ()) -> list[Release]:
    """Fast-tier copies to drop: verified durable copy elsewhere, not blocked, then by age
    since last access and/or down to the low watermark (least recently used first)."""
    idx = _index(s.copies)
    blocked = _blocked(p, s)
    sources = _Sources(p, s)
    gone = {(d.root, d.step, d.tier) for d in after_deletes}
    for deleted in after_deletes:
        sources.dropped((deleted.root, deleted.step), deleted.tier)
    ckpts = {(c.root, c.step): c for c in s.checkpoints}
    out: list[Release] = []
    for tier, rule in p.release.items():
        durable = p.durable_for(tier)
        candidates: list[Copy] = []
        for key, copies in idx.items():
            cp = copies.get(tier)
            if cp is None or cp.state != PRESENT or key in blocked or (*key, tier) in gone:
                continue
            if not sources.may_drop(key, tier):
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
    """Everything to do now: superseded exports first (catalog records only), then exports
    (newest first), deletions, releases.  Safe to call again after any subset was carried
    out: it recomputes from the state."""
    deletes = plan_retention(p, s)
    releases = plan_release(p, s, after_deletes=deletes)
    return [*plan_supersede(p, s), *plan_exports(p, s), *deletes, *releases]


def export_lag(p: Policies, s: State) -> float:
    """Seconds since the oldest committed checkpoint that still has an export to do was
    created (0 when nothing waits; superseded exports do not wait)."""
    ckpts = {(c.root, c.step): c for c in s.checkpoints}
    waiting = [ckpts[(e.root, e.step)].created for e in plan_exports(p, s)]
    return max(0.0, s.now - min(waiting)) if waiting else 0.0


@dataclass(frozen=True)
class ExportLag:
    """How far one destination is behind for one run root: exports still to make (after
    coalescing), the oldest of them and its age, and the newest step complete there."""

    root: str
    dest: str
    pending: int
    oldest_pending_step: int | None
    oldest_pending_age: float
    newest_step: int | None


def export_lags(p: Policies, s: State) -> list[ExportLag]:
    """One :class:`ExportLag` per run root and export destination, in (root, ladder)
    order."""
    ckpts = {(c.root, c.step): c for c in s.checkpoints}
    pending: dict[tuple[str, str], list[Export]] = {}
    for e in plan_exports(p, s):
        pending.setdefault((e.root, e.dest), []).append(e)
    newest: dict[tuple[str, str], int] = {}
    for cp in s.copies:
        if cp.state == PRESENT:
            k = (cp.root, cp.tier)
            newest[k] = max(newest.get(k, cp.step), cp.step)
    out = []
    for root in sorted({c.root for c in s.checkpoints}):
        for dest in sorted({e.to for e in p.exports}, key=p.rank):
            waiting = pending.get((root, dest), [])
            oldest = min(waiting, key=lambda e: ckpts[(root, e.step)].created, default=None)
            out.append(
                ExportLag(
                    root,
                    dest,
                    len(waiting),
                    oldest.step if oldest else None,
                    max(0.0, s.now - ckpts[(root, oldest.step)].created) if oldest else 0.0,
                    newest.get((root, dest)),
                )
            )
    return out
