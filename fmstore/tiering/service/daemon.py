"""``fmstore daemon``: export, retention and release, continuously, with metrics.

Start-up validates the whole configuration (tiers, policies, the ``[daemon]`` section)
before any data moves, takes the runner lock of the state directory (one daemon per
catalog), and starts the HTTP endpoint:

* ``/metrics``: Prometheus text format (every ``fmstore_*`` metric of the process);
* ``/healthz``: ``200`` and a JSON status while the loop runs.

Before its first step the daemon rescans every tier for committed checkpoints the
catalog does not know (:func:`~fmstore.tiering.inventory.discovery.rediscover`), so a lost catalog or
a new node carries on with every existing step, and logs at warning, once per run root and
daemon run, what it found there and does not count (a native DCP directory, torchtitan's
``step-4``: :mod:`.foreign`), and at warning on every rescan the checkpoints whose
manifests were created in the future (a node's clock is off: :mod:`.skew`), rescanning every
minute until they count; a catalog SQLite cannot read is moved aside
(``catalog.sqlite3.corrupt-<time>``, one ``catalog_corrupt`` log line) and rebuilt the same
way.  The loop runs one :class:`~fmstore.tiering.policy.runner.PolicyRunner` step every
``interval`` seconds.  A step that meets an unreachable or full tier stops early; the daemon then backs
off (doubling up to ``max_backoff``) while the export-lag metric keeps growing, and catches
up once the tier answers again.  SIGTERM (or SIGINT) lets the current copy finish, or —
on a second signal — cancels it, leaving it resumable from its journal; either way the
process exits 0.  Logs are one JSON object per line on stderr.

``[daemon]`` keys: ``host`` (default ``127.0.0.1``), ``port`` (``9464``; ``0`` picks a free
one), ``interval`` (seconds, ``10``), ``max_backoff`` (``60``), ``concurrency`` (``16``),
``bwlimit`` (bytes/s or a string like ``"200MB"``), ``verify_destination`` (``true``),
``orphan_grace`` (``1h``: how long a leftover of a dead writer must be idle before the orphan
sweep of :mod:`.sweep` removes it; ``0`` removes at once), ``sweep_interval`` (``1h``) and
``priority`` (``"idle"``, ``"low"`` or ``"normal"``: the CPU and I/O priority of the daemon's
threads, see :mod:`.priority`; also that of a training process's policy helper).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import filelock
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ... import runtime
from ...config import Config
from ...errors import ConfigError, FmstoreError
from ...protocol.skew import clock_warning, future_groups
from ...units import parse_duration, parse_size
from .. import metrics as m
from ..copy.transfer import TransferOptions
from ..exports.mover import CHECKPOINT_COPY
from ..inventory.catalog import Catalog
from ..inventory.discovery import rediscover
from ..inventory.foreign import NotCounted
from ..policy.policies import Policies, from_config
from ..policy.runner import PolicyRunner, StepReport, event, log, log_record_json, warn_event
from ..policy.sweep import SweepReport, sweep
from ..probe import ProbeReport, probe_once_per_node
from .endpoint import Endpoint
from .priority import PRIORITIES, lower_priority

#: Seconds between rescans while manifests created in the future are found.
FUTURE_RESCAN = 60.0

_KEYS = {
    "host",
    "port",
    "interval",
    "max_backoff",
    "concurrency",
    "bwlimit",
    "verify_destination",
    "orphan_grace",
    "sweep_interval",
    "priority",
}


@dataclass(frozen=True)
class DaemonSettings:
    host: str = "127.0.0.1"
    port: int = 9464
    interval: float = 10.0
    max_backoff: float = 60.0
    #: How checkpoints are copied ([daemon] concurrency, bwlimit, verify_destination).
    transfer: TransferOptions = CHECKPOINT_COPY
    #: The orphan sweep: idle time before a leftover goes, and how often it runs.
    orphan_grace: float = 3600.0
    sweep_interval: float = 3600.0
    #: CPU and I/O priority of the background work (:mod:`.priority`).
    priority: str = "idle"


def settings_from_config(config: Config) -> DaemonSettings:
    raw, w = config.table("daemon", _KEYS)
    s = DaemonSettings()
    port = raw.get("port", s.port)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"{w} port must be 0..65535, not {port!r}")
    conc = raw.get("concurrency", s.transfer.concurrency)
    if not isinstance(conc, int) or isinstance(conc, bool) or conc < 1:
        raise ConfigError(f"{w} concurrency must be a whole number >= 1, not {conc!r}")
    verify = raw.get("verify_destination", True)
    if not isinstance(verify, bool):
        raise ConfigError(f"{w} verify_destination must be true or false")
    priority = raw.get("priority", s.priority)
    if priority not in PRIORITIES:
        raise ConfigError(f"{w} priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
    return DaemonSettings(
        host=str(raw.get("host", s.host)),
        port=port,
        interval=parse_duration(raw.get("interval", s.interval), f"{w} interval"),
        max_backoff=parse_duration(raw.get("max_backoff", s.max_backoff), f"{w} max_backoff"),
        orphan_grace=parse_duration(
            raw.get("orphan_grace", s.orphan_grace), f"{w} orphan_grace", allow_zero=True
        ),
        sweep_interval=parse_duration(
            raw.get("sweep_interval", s.sweep_interval), f"{w} sweep_interval"
        ),
        priority=priority,
        transfer=dataclasses.replace(
            CHECKPOINT_COPY,
            concurrency=conc,
            bwlimit=parse_size(raw["bwlimit"], f"{w} bwlimit") if "bwlimit" in raw else None,
            verify=verify,
        ),
    )


class _JsonHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(log_record_json(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def setup_logging(level: int = logging.INFO) -> None:
    """JSON lines on stderr for the ``fmstore`` logger hierarchy, as its one handler (the
    command line's plain stderr handler, named ``fmstore.cli``, is taken off)."""
    root = logging.getLogger("fmstore")
    for h in [h for h in root.handlers if h.name == "fmstore.cli"]:
        root.removeHandler(h)
    if not any(isinstance(h, _JsonHandler) for h in root.handlers):
        root.addHandler(_JsonHandler())
    root.setLevel(level)
    root.propagate = False


def _gave_up(timeout: float | None, rep: StepReport) -> None:
    """The last line of a drain that timed out: what is left, and why."""
    why = f"; last error: {rep.errors[-1]}" if rep.errors else ""
    if rep.waiting_for:
        why += (
            f"; waiting for the parts of node{'s' if len(rep.waiting_for) > 1 else ''} "
            f"{', '.join(rep.waiting_for)} (their daemons export them; a commit needs all)"
        )
    log.error(
        "drain timed out after %ss, actions left: %d (resumable)%s",
        timeout,
        rep.pending,
        why,
        extra={
            "event": "drain_timeout",
            "fields": {
                "pending": rep.pending,
                "errors": rep.errors[-3:],
                "waiting_for": rep.waiting_for,
            },
        },
    )


class Daemon:
    """The daemon's pieces, usable in-process (tests) or from :func:`main`."""

    def __init__(
        self,
        config: Config,
        *,
        policies: Policies | None = None,
        settings: DaemonSettings | None = None,
    ) -> None:
        # Everything is validated here, before any data moves.
        self.config = config
        self.policies = policies or from_config(config)
        self.settings = settings or settings_from_config(config)
        for tier in self.policies.ladder:
            config.tier(tier)
        # A catalog SQLite cannot read is moved aside; run() rebuilds it from the tiers.
        self.catalog, moved = Catalog.open_or_move_aside(config.state_dir)
        if moved is not None:
            log.warning(
                "the catalog was not readable; moved it to %s and rebuilding it from the tiers",
                moved,
                extra={"event": "catalog_corrupt", "fields": {"moved_to": moved}},
            )
        self.runner = PolicyRunner(
            config,
            self.policies,
            self.catalog,
            mover=self.settings.transfer,
        )
        self.runner.backoff.limit = self.settings.max_backoff
        self.stop = self.runner.stop
        self.server: Endpoint | None = None
        self.port: int | None = None
        #: When the last policy step ended (Unix time), and how many steps this run made.
        self.last_step: float | None = None
        self.steps = 0
        self.last_report: StepReport | None = None
        self.backoff = 0.0
        self._signals = 0
        #: Rescan the tiers before the next step: at start-up, and again while a tier was
        #: unreachable during the last scan.
        self.rescan_due = True
        #: Prefixes whose uncounted entries were logged at warning (once per daemon run).
        self._warned: set[str] = set()
        #: When to rescan again while manifests created in the future were found (they
        #: count once this node's clock reaches them; each rescan warns again).
        self._future_rescan: float | None = None
        self._next_sweep = 0.0  # the orphan sweep runs at start, then every sweep_interval

    # ---- HTTP ------------------------------------------------------------------------

    def start_http(self) -> int:
        """Serve ``/metrics`` and ``/healthz`` (:mod:`.endpoint`: safe against slow clients)."""
        daemon = self

        def metrics() -> tuple[int, str, bytes]:
            return 200, CONTENT_TYPE_LATEST, generate_latest()

        def healthz() -> tuple[int, str, bytes]:
            return 200, "application/json", json.dumps(daemon.health()).encode()

        self.server = Endpoint(
            self.settings.host,
            self.settings.port,
            {"/metrics": metrics, "/healthz": healthz},
        )
        self.port = self.server.start()
        return self.port

    def health(self) -> dict[str, Any]:
        rep = self.last_report
        return {
            "status": "ok",
            "pid": os.getpid(),
            # a policy step of this daemon (one pass over its rules), not a checkpoint's
            "last_step_at": self.last_step,
            "policy_steps": self.steps,
            "last_step": self.last_step,  # the same time, under its first name (kept)
            "backoff_seconds": self.backoff,
            "pending": rep.pending if rep else None,
            "last_errors": rep.errors[-3:] if rep else [],
        }

    # ---- the loop --------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals += 1
        event("signal", signal=signal.Signals(signum).name, count=self._signals)
        self.stop.set()
        if self._signals >= 2:
            # Second signal: stop the current copy now; its journal keeps it resumable.
            raise KeyboardInterrupt

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def run(
        self, *, max_steps: int | None = None, drain: bool = False, timeout: float | None = None
    ) -> int:
        """Run until stopped; returns the exit code.

        ``drain``: stop as soon as a step finds nothing to do (every policy satisfied; exit
        0), or when ``timeout`` seconds pass first (exit 3: work remains, resumable).
        ``max_steps`` (``--once``): exit 1 when an action of the last step failed.
        """
        try:
            self.runner.lock.acquire(timeout=0)
        except filelock.Timeout:
            raise ConfigError(
                f"another fmstore daemon already runs on state directory {self.config.state_dir!r}"
            ) from None
        m.UP.set(1)
        event(
            "daemon_start",
            pid=os.getpid(),
            port=self.port,
            tiers=list(self.policies.ladder),
            state_dir=self.config.state_dir,
        )
        steps = 0
        code = 0
        deadline = time.monotonic() + timeout if timeout is not None else None
        step_backoff = 0.0  # after a step that failed as a whole, or met errors and did nothing
        try:
            while not self.stop.is_set():
                try:
                    again = self._future_rescan
                    if self.rescan_due or (again is not None and time.monotonic() >= again):
                        self.rescan()
                    if time.monotonic() >= self._next_sweep:
                        self.sweep()
                    rep = self._step(deadline)
                except FmstoreError as e:
                    rep = StepReport(errors=[str(e)])
                    m.ERRORS.labels("step", type(e).__name__).inc()
                    warn_event("step_error", f"policy step failed: {e}", error=str(e))
                self.last_report = rep
                self.last_step = time.time()
                steps += 1
                self.steps += 1
                if rep.errors:
                    m.STEPS.labels("error").inc()
                else:
                    m.STEPS.labels("ok").inc()
                if rep.errors and not rep.did_something:
                    step_backoff = min(max(1.0, step_backoff * 2), self.settings.max_backoff)
                elif not rep.errors:
                    step_backoff = 0.0
                self.backoff = max(step_backoff, self.runner.backoff.largest)
                m.BACKOFF.set(self.backoff)
                if max_steps is not None and steps >= max_steps:
                    code = 1 if rep.errors else 0
                    break
                if drain and not rep.did_something and not rep.errors and not rep.pending:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    code = 3 if (rep.pending or rep.errors) else 0
                    if code:
                        _gave_up(timeout, rep)
                    break
                if rep.did_something:
                    continue  # more may be due (the plan changed while we acted)
                # A failing tier waits its own back-off; the others are not held up by it.
                wait = step_backoff or self.settings.interval
                due = self.runner.backoff.next_due()
                if due is not None:
                    wait = min(wait, max(due, 0.05))
                if deadline is not None:
                    wait = min(wait, max(0.0, deadline - time.monotonic()))
                self.stop.wait(wait)
        except KeyboardInterrupt:
            event("daemon_interrupted")
        finally:
            m.UP.set(0)
            event("daemon_stop", steps=steps)
            self.runner.lock.release()
        return code

    def _step(self, deadline: float | None) -> StepReport:
        """One policy step, cut short at ``deadline`` (``--drain --timeout``): a copy in
        flight then is cancelled and stays resumable (its journal and ``exporting`` row)."""
        if deadline is None:
            return runtime.run(self.runner.astep())

        async def bounded() -> StepReport:
            left = max(0.0, deadline - time.monotonic())
            try:
                return await asyncio.wait_for(self.runner.astep(), left)
            except TimeoutError:
                return StepReport(pending=1, errors=["the step was cut short at the deadline"])

        return runtime.run(bounded())

    def check_tiers(self) -> ProbeReport:
        """Prove every tier usable (:mod:`.probe`) under the node's probe lock, logging
        each problem at error; the daemon runs on (a tier down now may come back)."""
        rep = probe_once_per_node(self.config, self.policies, self.runner.tiers, force=True)
        for tier, offset in rep.clock.items():
            m.TIER_CLOCK_OFFSET.labels(tier).set(offset)
            if (line := clock_warning(tier, offset, self.runner.tiers.env.clock_skew)) is not None:
                warn_event("clock_skew", line, tier=tier, offset_seconds=round(offset, 1))
        for p in rep.problems:
            log.error(
                p.describe(),
                extra={
                    "event": "tier_check_failed",
                    "fields": {"tier": p.tier, "check": p.check, "error": p.error, "fix": p.fix},
                },
            )
        return rep

    def sweep(self) -> SweepReport:
        """The orphan sweep of :mod:`.sweep` over every configured tier (the runner lock is
        held: no export of this node's is half-way)."""
        self._next_sweep = time.monotonic() + self.settings.sweep_interval
        stores = {t: self.runner.tiers.store(t) for t in self.config.tiers}
        rep = runtime.run(
            sweep(self.config, stores, grace=self.settings.orphan_grace, env=self.runner.tiers.env)
        )
        event(
            "sweep",
            removed=len(rep.removed),
            bytes=rep.bytes_reclaimed,
            kept=len(rep.orphans) - len(rep.removed),
            errors=rep.errors,
        )
        return rep

    def rescan(self) -> None:
        """Record every committed checkpoint of every run root on the tiers that the
        catalog does not know (a lost, new or rebuilt catalog; a new node)."""
        found = runtime.run(rediscover(self.catalog, self.runner.tiers, self.policies.ladder))
        self.rescan_due = bool(found.unreachable)
        event(
            "rediscovered",
            roots=found.roots,
            checkpoints=found.checkpoints,
            copies=found.copies,
            unreachable=found.unreachable,
            not_counted=found.not_counted,
            not_counted_more=found.not_counted_more,
        )
        self.warn_not_counted(found.notes)
        self.warn_in_future(found.notes)

    def warn_in_future(self, notes: NotCounted) -> None:
        """At warning on every rescan: each run root, tier and node whose manifests were
        created in the future (:mod:`.skew`), with the offset; and the metrics."""
        skew = self.runner.tiers.env.clock_skew
        worst: dict[str, float] = {}
        count: dict[str, int] = {}
        for f in notes.future:
            count[f.tier] = count.get(f.tier, 0) + 1
            worst[f.tier] = max(worst.get(f.tier, 0.0), f.offset)
        for tier in self.policies.ladder:
            m.MANIFESTS_IN_FUTURE.labels(tier).set(count.get(tier, 0))
            m.MANIFEST_FUTURE_SECONDS.labels(tier).set(worst.get(tier, 0.0))
        for g in future_groups(notes.future):
            warn_event(
                "created_in_future",
                g.describe(skew),
                tier=g.tier,
                root=g.root,
                node=g.node,
                steps=list(g.steps),
                max_offset_seconds=round(g.max_offset, 1),
                clock_skew=skew,
            )
        self._future_rescan = (
            time.monotonic() + max(self.settings.interval, FUTURE_RESCAN) if notes.future else None
        )

    def warn_not_counted(self, notes: NotCounted) -> None:
        """One warning line per prefix holding what fmstore does not count, the first
        time this daemon finds it there (a rescan says nothing new about it)."""
        for root in notes.roots():
            if root in self._warned:
                continue
            self._warned.add(root)
            warn_event(
                "not_counted",
                notes.describe(root),
                root=root,
                entries=notes.by_root.get(root, {}),
                more=notes.more.get(root, 0),
            )

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        runtime.run(self.runner.tiers.close())
        self.catalog.close()


def main(
    config: Config,
    *,
    port: int | None = None,
    once: bool = False,
    drain: bool = False,
    timeout: float | None = None,
    http: bool = True,
    log_level: int | None = None,
) -> int:
    """Entry of ``fmstore daemon``; ``log_level``: of its JSON log lines (default info)."""
    setup_logging(logging.INFO if log_level is None else log_level)
    settings = settings_from_config(config)
    if port is not None:
        from dataclasses import replace

        settings = replace(settings, port=port)
    # Before the first thread: the HTTP server, the event loop and the pools inherit it.
    lower_priority(settings.priority)
    d = Daemon(config, settings=settings)
    # Which config the daemon acts by (once it is known to be valid), before it acts.
    log.info(
        config.provenance,
        extra={"event": "config", "fields": {"file": config.source, "found_by": config.found_by}},
    )
    d.install_signals()
    d.check_tiers()
    if http:
        d.start_http()
    try:
        return d.run(max_steps=1 if once else None, drain=drain, timeout=timeout)
    finally:
        d.close()
