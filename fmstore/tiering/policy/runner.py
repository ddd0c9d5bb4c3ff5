"""Carry out the policies: one idempotent step at a time.

:class:`PolicyRunner` is what both the daemon and a training process without a daemon run.
One :meth:`PolicyRunner.step`:

1. **reconciles** the catalog with the tiers: a copy left ``writing`` whose manifest validates
   on the tier is ``present`` (the save committed, its process died before recording it); a
   copy left ``deleting`` is deleted to the end;
2. **plans** with :func:`fmstore.tiering.policy.policies.plan` (pure: catalog in, actions out);
3. **acts**, one action at a time, re-checking on the tiers before anything destructive
   that another complete copy really exists.

Crash anywhere → the next step finds the same plan minus what was finished, so running it
again repairs everything.  Only one runner works at a time per state directory: a file lock
(``runner.lock``) held for the runner's lifetime (the daemon) or for one step (a training
process), so a daemon and a training process never race on the same copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import filelock

from ... import runtime
from ...config import Config
from ...errors import CorruptData, FmstoreError, NotFound, VersionError
from .. import metrics as m
from ..copy.transfer import TransferOptions
from ..exports.mover import CHECKPOINT_COPY, copy_checkpoint, delete_checkpoint, has_checkpoint
from ..exports.parts import remove_uncommitted
from ..exports.replica_export import export_replicas
from ..inventory import catalog as cat
from ..inventory.catalog import Catalog
from ..inventory.discovery import repair_writing
from ..tiers import Tiers
from .backoff import TierBackoff
from .failures import ActionFailure, FailureLog, reason_of
from .policies import (
    Delete,
    Export,
    Policies,
    Release,
    State,
    Supersede,
    TierUsage,
    export_lag,
    export_lags,
    plan,
)

log = logging.getLogger("fmstore.tiering")

LOCK_NAME = "runner.lock"
_RELEASE_NOTE = "pending:released"


@dataclass
class StepReport:
    """What one step did (counts per action) and the errors it met."""

    exported: int = 0
    superseded: int = 0
    deleted: int = 0
    released: int = 0
    repaired: int = 0
    pending: int = 0
    #: planned actions left for a later step: a tier they use is backing off
    deferred: int = 0
    errors: list[str] = field(default_factory=list)
    skipped_locked: bool = False
    #: The actions that failed in this step, with how many times in a row each has.
    failed: list[ActionFailure] = field(default_factory=list)
    #: Nodes whose parts this node's exports wait for (their commit needs them).
    waiting_for: list[str] = field(default_factory=list)

    @property
    def did_something(self) -> bool:
        return bool(
            self.exported or self.superseded or self.deleted or self.released or self.repaired
        )


def event(kind: str, **fields: object) -> None:
    """One structured log line (the daemon formats records as JSON)."""
    log.info(kind, extra={"event": kind, "fields": fields})


def warn_event(kind: str, message: str, **fields: object) -> None:
    """A structured line at ``warning``: something failed and someone should look."""
    log.warning(message, extra={"event": kind, "fields": fields})


class PolicyRunner:
    """Applies ``policies`` to the checkpoints in ``catalog`` on the tiers of ``config``."""

    def __init__(
        self,
        config: Config,
        policies: Policies,
        catalog: Catalog,
        *,
        mover: TransferOptions = CHECKPOINT_COPY,
        tiers: Tiers | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.policies = policies
        self.catalog = catalog
        self.mover = mover
        self.tiers = tiers or Tiers(config)
        self.clock = clock or catalog.now
        self.lock = filelock.FileLock(os.path.join(config.state_dir, LOCK_NAME))
        #: Checked between actions: set it to stop after the current copy.
        self.stop = threading.Event()
        #: Failing actions: warning, then error, rate-limited (:mod:`.failures`).
        self.failure_log = FailureLog()
        #: Tiers whose actions failed wait on their own; the others' actions go on.
        self.backoff = TierBackoff()

    # ---- the step --------------------------------------------------------------------

    def step(self, *, blocking_lock: bool = False) -> StepReport:
        """Run one step (sync facade).  Without the lock (another runner holds it) it
        returns a report with ``skipped_locked`` set and does nothing."""
        try:
            self.lock.acquire(timeout=-1 if blocking_lock else 0)
        except filelock.Timeout:
            return StepReport(skipped_locked=True)
        try:
            return runtime.run(self.astep())
        finally:
            self.lock.release()

    async def astep(self) -> StepReport:
        """One step; the caller holds the lock."""
        rep = StepReport()
        await self._reconcile(rep)
        state = self.state()
        actions = plan(self.policies, state)
        self._gauges(state, actions)
        rep.pending = len(actions)
        for action in actions:
            if self.stop.is_set():
                break
            tiers = _tiers_of(action)
            if self.backoff.waiting(tiers):
                rep.deferred += 1
                continue
            recorded = len(rep.failed)
            try:
                if isinstance(action, Export):
                    await self._export(action, rep)
                elif isinstance(action, Supersede):
                    await self._supersede(action, rep)
                elif isinstance(action, Delete):
                    await self._remove(
                        action.root,
                        action.step,
                        action.tier,
                        "retention",
                        rep,
                        last_copy=action.last_copy,
                    )
                elif isinstance(action, Release):
                    await self._remove(action.root, action.step, action.tier, "release", rep)
            except FmstoreError as e:
                # A tier down, full, missing or refusing us: that tier backs off on its own
                # and the actions on the other tiers go on; all the copies stay resumable.
                # Logged loud (warning, then error), never only at info.
                kind = type(action).__name__.lower()
                m.ERRORS.labels(kind, reason_of(e)).inc()
                rep.errors.append(str(e))
                if len(rep.failed) == recorded:  # not an export's copy (it records itself)
                    src, dst = _tiers_of(action)
                    f = ActionFailure(
                        kind, action.root, action.step, src, dst, reason_of(e), str(e), 0
                    )
                    rep.failed.append(f)
                self.failure_log.failed(rep.failed[-1])
                self.backoff.failed(e.tier if e.tier is not None and e.tier in tiers else tiers[1])
                continue
            self.backoff.succeeded(tiers)
        if not self.stop.is_set():
            try:
                await self._replica_exports(rep)
            except FmstoreError as e:  # tried again at the next step; the others went on
                m.ERRORS.labels("replica_export", reason_of(e)).inc()
                rep.errors.append(str(e))
        # Planned again for the gauges: the queues left after this step, not the ones it
        # began with (deletes wait for exports, so a step that exports leaves deletes).
        state = self.state()
        self._gauges(state, plan(self.policies, state))
        return rep

    def state(self) -> State:
        usage: dict[str, TierUsage] = {}
        for tier in self.policies.release:
            u = self.tiers.usage(tier)
            if u is not None:
                usage[tier] = u
        return State(
            checkpoints=self.catalog.checkpoints(),
            copies=self.catalog.copies(),
            pins=self.catalog.pins(),
            now=self.clock(),
            usage=usage,
        )

    def _gauges(self, state: State, actions: list) -> None:
        m.EXPORT_LAG.set(export_lag(self.policies, state))
        for lag in export_lags(self.policies, state):
            m.EXPORT_PENDING.labels(lag.root, lag.dest).set(lag.pending)
            step = lag.oldest_pending_step
            m.EXPORT_OLDEST_PENDING_STEP.labels(lag.root, lag.dest).set(
                -1 if step is None else step
            )
            m.EXPORT_OLDEST_PENDING_SECONDS.labels(lag.root, lag.dest).set(lag.oldest_pending_age)
        since: dict[str, float] = {e.to: state.now for e in self.policies.exports}
        for cp in state.copies:
            if cp.state == cat.EXPORTING and cp.failures and cp.failing_since is not None:
                since[cp.tier] = min(since.get(cp.tier, state.now), cp.failing_since)
        for dst, t in since.items():
            m.EXPORT_FAILING_SECONDS.labels(dst).set(max(0.0, state.now - t))
        newest: dict[tuple[str, str], int] = {}
        for cp in state.copies:
            if cp.state == cat.PRESENT:
                newest[(cp.root, cp.tier)] = max(newest.get((cp.root, cp.tier), -1), cp.step)
        for root in {c.root for c in state.checkpoints}:
            for tier in self.policies.ladder:
                m.NEWEST_STEP.labels(root, tier).set(newest.get((root, tier), -1))
        for kind in ("export", "supersede", "delete", "release"):
            m.QUEUE_DEPTH.labels(kind).set(
                sum(1 for a in actions if type(a).__name__.lower() == kind)
            )
        if self.policies.node_tiers:
            self._part_gauges(state)
        held = self.catalog.tier_bytes()
        for tier in self.policies.ladder:
            m.TIER_BYTES.labels(tier).set(held.get(tier, 0))
            u = state.usage.get(tier) or self.tiers.usage(tier)
            if u is not None:
                m.TIER_FS_USED.labels(tier).set(u.fraction)
                m.TIER_REPLICA_BYTES.labels(tier).set(u.replicas)

    def _part_gauges(self, state: State) -> None:
        """Per node: its parts held, exported and waiting, committed; its export lag."""
        node = self.tiers.env.node_id()
        local = set(self.policies.node_tiers)
        on_node = {(cp.root, cp.step) for cp in state.copies if cp.tier in local}
        counts = {(t, s): 0 for t in self.policies.ladder for s in ("held", "waiting", "committed")}
        for cp in state.copies:
            if (cp.root, cp.step) not in on_node:
                continue
            if cp.tier in local and cp.state == cat.PRESENT:
                counts[(cp.tier, "held")] += 1
            elif cp.state == cat.PRESENT:
                counts[(cp.tier, "committed")] += 1
            elif cp.state == cat.EXPORTING and (cp.error or "").startswith("waiting for the parts"):
                counts[(cp.tier, "waiting")] += 1
        for (tier, st), n in counts.items():
            m.PARTS.labels(node, tier, st).set(n)
        lag: dict[str, float] = {e.to: 0.0 for e in self.policies.exports}
        for x in export_lags(self.policies, state):
            lag[x.dest] = max(lag.get(x.dest, 0.0), x.oldest_pending_age)
        for dest, seconds in lag.items():
            m.NODE_EXPORT_LAG.labels(node, dest).set(seconds)

    # ---- reconcile -------------------------------------------------------------------

    async def _reconcile(self, rep: StepReport) -> None:
        # A copy left writing whose manifest validates was committed: the same repair a
        # rescan makes (discovery.record_found).
        for cp in await repair_writing(self.catalog, self.tiers):
            rep.repaired += 1
            event("repaired", root=cp.root, step=cp.step, tier=cp.tier, state="present")
        for cp in self.catalog.copies(states=[cat.DELETING]):
            store = self.tiers.checkpoint(cp.tier, cp.root, cp.step)
            final = cat.RELEASED if cp.error == _RELEASE_NOTE else cat.DELETED
            await delete_checkpoint(store)
            self.catalog.set_copy(cp.root, cp.step, cp.tier, final, expect=[cat.DELETING])
            rep.repaired += 1
            event("repaired", root=cp.root, step=cp.step, tier=cp.tier, state=final)

    # ---- actions ---------------------------------------------------------------------

    def journal_path(self, root: str, step: int, src: str, dst: str) -> str:
        h = hashlib.sha256(f"{root}\0{step}\0{src}\0{dst}".encode()).hexdigest()[:24]
        return os.path.join(self.config.state_dir, "transfers", f"ckpt-{h}.jsonl")

    async def _export(self, a: Export, rep: StepReport) -> None:
        c = self.catalog
        c.set_copy(a.root, a.step, a.dest, cat.EXPORTING, count_attempt=True)
        src = self.tiers.checkpoint(a.source, a.root, a.step)
        dst = self.tiers.checkpoint(a.dest, a.root, a.step)
        jpath = self.journal_path(a.root, a.step, a.source, a.dest)
        t0 = time.monotonic()
        event("export_start", root=a.root, step=a.step, src=a.source, dst=a.dest)
        try:
            res = await copy_checkpoint(
                src, dst, options=self.mover, journal_path=jpath, **self._part_args(a.source)
            )
        except VersionError as e:
            # Written by a newer fmstore: not damage.  The source stays as it is (a newer
            # daemon can carry it); the export is reported as failing until then.
            m.ERRORS.labels("export", "VersionError").inc()
            rep.errors.append(str(e))
            event("export_unreadable", root=a.root, step=a.step, tier=a.source, error=str(e))
            self.failure_log.failed(self._failed(a, e, rep))
            return
        except CorruptData as e:
            bad = a.dest if e.tier == dst.tier else a.source
            m.COPIES.labels(a.source, a.dest, "corrupt").inc()
            m.ERRORS.labels("export", "CorruptData").inc()
            c.set_copy(a.root, a.step, bad, cat.CORRUPT, error=str(e))
            rep.errors.append(str(e))
            warn_event(
                "export_corrupt",
                f"export {a.source} → {a.dest} of {a.root!r} step {a.step}: {e}",
                root=a.root,
                step=a.step,
                tier=bad,
                error=str(e),
            )
            return
        except NotFound as e:
            if e.tier == dst.tier:  # the destination's bucket or directory is missing
                self._failed(a, e, rep)
                raise
            m.ERRORS.labels("export", "NotFound").inc()
            c.set_copy(a.root, a.step, a.source, cat.MISSING, error=str(e))
            rep.errors.append(str(e))
            warn_event(
                "export_source_missing",
                f"export {a.source} → {a.dest} of {a.root!r} step {a.step}: {e}",
                root=a.root,
                step=a.step,
                tier=a.source,
                error=str(e),
            )
            return
        except FmstoreError as e:
            self._failed(a, e, rep)
            raise
        seconds = time.monotonic() - t0
        if res.retired:
            # A restore fell back from this step and retired the generation exported here
            # (docs/distributed.md, "Steps moved aside"): nothing to record on the
            # destination; the redo of the step, once saved, is exported afresh.
            c.forget_copy(a.root, a.step, a.dest)
            with contextlib.suppress(OSError):
                os.unlink(jpath)
            event("export_retired", root=a.root, step=a.step, src=a.source, dst=a.dest)
            return
        if res.waiting_for:
            # This node's part is there and verified; the commit waits for the others'
            # (whichever node finds them all commits: docs/distributed.md).  Not a failure:
            # the next step looks again, on this node or any other.
            waiting = ", ".join(res.waiting_for)
            rep.waiting_for += [n for n in res.waiting_for if n not in rep.waiting_for]
            c.set_copy(
                a.root, a.step, a.dest, cat.EXPORTING, error=f"waiting for the parts of {waiting}"
            )
            with contextlib.suppress(OSError):
                os.unlink(jpath)
            m.COPY_BYTES.labels(a.source, a.dest).inc(res.bytes_copied)
            event(
                "export_part_done",
                root=a.root,
                step=a.step,
                src=a.source,
                dst=a.dest,
                bytes=res.bytes_copied,
                waiting_for=list(res.waiting_for),
            )
            return
        c.record_checkpoint(
            a.root, a.step, bytes=res.manifest.stored_bytes, manifest_crc32c=res.manifest_crc32c
        )
        c.set_copy(
            a.root,
            a.step,
            a.dest,
            cat.PRESENT,
            bytes=res.manifest.stored_bytes,
            # Verified only where a check of the destination passed, never from an option.
            verified=c.now() if res.check is not None and res.check.ok else None,
        )
        with contextlib.suppress(OSError):
            os.unlink(jpath)
        self.failure_log.succeeded("export", a.root, a.step, a.source, a.dest)
        m.COPY_BYTES.labels(a.source, a.dest).inc(res.bytes_copied)
        m.COPY_SECONDS.labels(a.source, a.dest).observe(seconds)
        m.COPIES.labels(a.source, a.dest, "ok").inc()
        rep.exported += 1
        event(
            "export_done",
            root=a.root,
            step=a.step,
            src=a.source,
            dst=a.dest,
            bytes=res.bytes_copied,
            seconds=round(seconds, 3),
        )

    async def _replica_exports(self, rep: StepReport) -> None:
        """The parts of lost nodes whose replicas this node holds, exported in their place
        once their steps have waited long enough (:mod:`.replica_export`)."""
        if not any(self.config.tier(t).replicas for t in self.policies.node_tiers):
            return
        for x in await export_replicas(
            self.config, self.policies, self.tiers, self.tiers.env.node_id(), options=self.mover
        ):
            rep.exported += int(x.committed)
            log.info(
                x.describe(),
                extra={
                    "event": "replica_export_done",
                    "fields": {
                        "node": x.node,
                        "why": x.why,
                        "newest_saved": x.newest_saved,
                        "root": x.root,
                        "step": x.step,
                        "src": x.source,
                        "dst": x.dest,
                        "committed": x.committed,
                    },
                },
            )

    def _part_args(self, source: str) -> dict[str, Any]:
        """How to copy from ``source``: this node's part of a checkpoint in node parts on
        a node-local tier (under the tiers' protocol env), the whole checkpoint from a
        shared one."""
        if self.config.tier(source).scope == "node":
            return {"node": self.tiers.env.node_id(), "env": self.tiers.env}
        return {"shared_source": True}

    def _failed(self, a: Export, e: FmstoreError, rep: StepReport) -> ActionFailure:
        """Record a failed attempt of export ``a`` (catalog, metrics, the step's report);
        the caller logs it (:class:`~.failures.FailureLog`) or raises it on."""
        m.COPIES.labels(a.source, a.dest, "error").inc()
        m.EXPORT_FAILURES.labels(a.source, a.dest, reason_of(e)).inc()
        cp = self.catalog.record_failure(a.root, a.step, a.dest, str(e))
        f = ActionFailure(
            "export", a.root, a.step, a.source, a.dest, reason_of(e), str(e), cp.failures
        )
        rep.failed.append(f)
        return f

    async def _supersede(self, a: Supersede, rep: StepReport) -> None:
        """Record the skipped export; remove what a started copy left on the destination
        (no manifest there, so it never was a checkpoint) and its journals."""
        c = self.catalog
        cur = c.copy(a.root, a.step, a.dest)
        before = cur.state if cur is not None else None
        if not c.set_copy(
            a.root,
            a.step,
            a.dest,
            cat.SUPERSEDED,
            error="superseded by a newer checkpoint",
            expect=[None, cat.WRITING, cat.EXPORTING, cat.CORRUPT, cat.MISSING],
        ):
            return
        if before in (cat.WRITING, cat.EXPORTING, cat.CORRUPT):
            dstore = self.tiers.checkpoint(a.dest, a.root, a.step)
            sstore = self.tiers.checkpoint(a.source, a.root, a.step)
            if not await remove_uncommitted(dstore, sstore, **self._part_args(a.source)):
                await delete_checkpoint(dstore)
            for src in self.policies.ladder:
                with contextlib.suppress(OSError):
                    os.unlink(self.journal_path(a.root, a.step, src, a.dest))
        m.EXPORTS_SUPERSEDED.labels(a.source, a.dest).inc()
        rep.superseded += 1
        event("export_superseded", root=a.root, step=a.step, src=a.source, dst=a.dest)

    async def _remove(
        self,
        root: str,
        step: int,
        tier: str,
        reason: str,
        rep: StepReport,
        *,
        last_copy: bool = False,
    ) -> None:
        """Delete (retention) or release one copy.  ``last_copy``: retention decided that no
        rule keeps the checkpoint anywhere, so no other copy is needed."""
        c = self.catalog
        if any(pin.root == root and pin.step == step for pin in c.pins()):
            # A restore pinned it after the plan was made: it reads this copy, maybe only it.
            event("remove_refused", root=root, step=step, tier=tier, reason="pinned")
            return
        # Otherwise never trust the catalog alone before deleting: another complete copy
        # must really be on its tier now.
        others = [cp for cp in c.copies(root, step=step, states=[cat.PRESENT]) if cp.tier != tier]
        confirmed = last_copy
        for cp in [] if last_copy else others:
            if await has_checkpoint(self.tiers.checkpoint(cp.tier, root, step)):
                confirmed = True
                break
            c.set_copy(root, step, cp.tier, cat.MISSING, error="manifest not found on the tier")
        if not confirmed:
            event("remove_refused", root=root, step=step, tier=tier, reason="no other copy")
            return
        note = _RELEASE_NOTE if reason == "release" else None
        if not c.set_copy(
            root, step, tier, cat.DELETING, error=note, expect=[cat.PRESENT, cat.CORRUPT]
        ):
            return
        freed = await delete_checkpoint(self.tiers.checkpoint(tier, root, step))
        final = cat.RELEASED if reason == "release" else cat.DELETED
        c.set_copy(root, step, tier, final, expect=[cat.DELETING])
        m.DELETIONS.labels(tier, reason).inc()
        if reason == "release":
            rep.released += 1
        else:
            rep.deleted += 1
        event(
            "removed",
            root=root,
            step=step,
            tier=tier,
            reason=reason,
            bytes=freed,
            last_copy=last_copy,
        )


def _tiers_of(action: object) -> tuple[str | None, str]:
    """(source, tier acted on) of a planned action, for its failure's report."""
    if isinstance(action, Export | Supersede):
        return action.source, action.dest
    return None, str(getattr(action, "tier", ""))


def log_record_json(record: logging.LogRecord) -> str:
    """Format a record as one JSON object (used by the daemon's log handler)."""
    out: dict[str, object] = {
        "ts": round(record.created, 3),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    ev = getattr(record, "event", None)
    if ev:
        out["event"] = ev
        out.update(getattr(record, "fields", {}) or {})
    if record.exc_info:
        out["exc"] = logging.Formatter().formatException(record.exc_info)
    return json.dumps(out, default=str)
