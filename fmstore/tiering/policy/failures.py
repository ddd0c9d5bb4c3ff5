"""Failures nobody can miss: how a failing policy action is logged, counted and reported.

A failing action (an export that cannot reach its destination, a delete the tier refuses)
is logged at ``warning`` the first time, at ``error`` when it fails again, and then at most
once per :data:`REPEAT_EVERY` seconds per action (the lines in between are counted, not
dropped silently).  Exports count their failures in the catalog
(:meth:`~fmstore.tiering.inventory.catalog.Catalog.record_failure`), so the count survives a restart
and ``fmstore ckpt list`` shows it; the reason a failure is counted under in
``fmstore_tier_export_failures_total`` is the error's class (:func:`reason_of`), never a
match on its message.

:class:`PolicyWait` is what ``CheckpointManager.wait_for_policies`` returns: falsy while
work remains, with the pending steps and the last error.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...config import Config
from ..inventory.catalog import Catalog, Copy
from .policies import Export, Policies, plan
from .policies import State as PlanState

log = logging.getLogger("fmstore.tiering")

#: After the first two failures of one action, at most one log line per this many seconds.
REPEAT_EVERY = 300.0
#: The command that finishes pending exports by hand.
DRAIN_COMMAND = "fmstore daemon --drain"


def drain_command(config: Config) -> str:
    """The drain command for this process's config: with ``-c FILE`` whenever a file is in
    effect, since the same command run from another directory may find another config (or
    the embedded default) and drain nothing."""
    if config.source is None:
        return DRAIN_COMMAND
    return f"fmstore -c {shlex.quote(config.source)} daemon --drain"


def reason_of(e: BaseException) -> str:
    """The label a failure is counted under: the class of the error (``NotFound``,
    ``PermissionDenied``, ``StoreUnavailable``, ``TierFull``, ...)."""
    return type(e).__name__


@dataclass(frozen=True)
class ActionFailure:
    """One failed attempt of a policy action, as a step reports it.  ``failures``: how
    many times in a row this action has failed, this one included (0: not counted yet,
    :class:`FailureLog` counts it)."""

    action: str
    root: str
    step: int
    src: str | None
    dst: str
    reason: str
    error: str
    failures: int

    def describe(self) -> str:
        what = f"{self.src} → {self.dst}" if self.src else self.dst
        times = "once" if self.failures == 1 else f"{self.failures} times"
        return (
            f"{self.action} {what} of {self.root!r} step {self.step} has failed {times}: "
            f"{self.error}"
        )


class FailureLog:
    """Logs failures of actions: ``warning`` the first time, ``error`` when repeated, at
    most once per ``every`` seconds per action after the second."""

    def __init__(self, every: float = REPEAT_EVERY, clock: Callable[[], float] = time.monotonic):
        self.every = every
        self.clock = clock
        self._lock = threading.Lock()
        #: action key -> (failures seen, when last logged, lines held back since)
        self._seen: dict[tuple[object, ...], tuple[int, float, int]] = {}

    def failed(self, f: ActionFailure) -> None:
        key = (f.action, f.root, f.step, f.src, f.dst)
        now = self.clock()
        with self._lock:
            seen, last, held = self._seen.get(key, (0, -1e18, 0))
            if not f.failures:  # not counted elsewhere (the catalog counts exports'): here
                f = dataclasses.replace(f, failures=seen + 1)
            if f.failures > 2 and now - last < self.every:
                self._seen[key] = (f.failures, last, held + 1)
                return
            self._seen[key] = (f.failures, now, 0)
        level = logging.WARNING if f.failures <= 1 else logging.ERROR
        msg = f.describe()
        if held:
            msg += f" ({held} more failures since the last line)"
        fields = {
            "action": f.action,
            "root": f.root,
            "step": f.step,
            "src": f.src,
            "dst": f.dst,
            "reason": f.reason,
            "failures": f.failures,
            "error": f.error,
        }
        log.log(level, msg, extra={"event": f"{f.action}_failed", "fields": fields})

    def succeeded(self, action: str, root: str, step: int, src: str | None, dst: str) -> None:
        with self._lock:
            self._seen.pop((action, root, step, src, dst), None)


@dataclass(frozen=True)
class PolicyWait:
    """What :meth:`CheckpointManager.wait_for_policies` found: truthy when every policy
    is satisfied.  ``pending``: ``(step, destination tier)`` of the exports still to make;
    ``failing``: the copies whose export keeps failing; ``last_error`` the newest error."""

    done: bool
    pending: tuple[tuple[int, str], ...] = ()
    failing: tuple[Copy, ...] = field(default=(), repr=False)
    last_error: str | None = None
    reason: str | None = None

    def __bool__(self) -> bool:
        return self.done

    @property
    def pending_steps(self) -> list[int]:
        return sorted({s for s, _ in self.pending})

    def describe(self) -> str:
        if self.done:
            return "every policy is satisfied"
        parts = []
        if self.pending:
            by_dst: dict[str, list[int]] = {}
            for s, d in self.pending:
                by_dst.setdefault(d, []).append(s)
            parts.append(
                "; ".join(f"{_steps(v)} not yet exported to {d}" for d, v in sorted(by_dst.items()))
            )
        elif self.reason:
            parts.append(self.reason)
        if self.failing:
            worst = max(self.failing, key=lambda c: c.failures).failures
            parts.append(f"the export has failed {'once' if worst == 1 else f'{worst} times'}")
        if self.last_error:
            parts.append(f"last error: {self.last_error}")
        return "; ".join(parts) or "work remains"


def _steps(steps: list[int]) -> str:
    s = sorted(set(steps))
    return f"step{'s' if len(s) > 1 else ''} {', '.join(map(str, s))}"


def pending_exports(policies: Policies, catalog: Catalog, root: str) -> tuple[tuple[int, str], ...]:
    """``(step, destination)`` of every export the policies still want for ``root``."""
    state = PlanState(
        checkpoints=catalog.checkpoints(root),
        copies=catalog.copies(root),
        pins=catalog.pins(),
        now=catalog.now(),
    )
    return tuple(sorted({(a.step, a.dest) for a in plan(policies, state) if isinstance(a, Export)}))


def policy_wait(
    done: bool, policies: Policies, catalog: Catalog, root: str, reason: str | None = None
) -> PolicyWait:
    """The :class:`PolicyWait` of ``root`` now (``done``: the runner found nothing to do)."""
    failing = tuple(catalog.failing(root))
    pending = () if done else pending_exports(policies, catalog, root)
    newest = max(failing, key=lambda c: c.error_at or 0.0, default=None)
    return PolicyWait(
        done=done,
        pending=pending,
        failing=failing,
        last_error=newest.error if newest is not None else None,
        reason=reason,
    )


def failing_since_wait(
    catalog: Catalog, root: str, since: float, policies: Policies
) -> Callable[[], bool]:
    """For a wait that began at ``since``: true once an export of ``root`` has failed
    again after that, ``warn_after_failures`` times in a row or more."""
    every = policies.warn_after_failures

    def stuck() -> bool:
        return any(
            c.failures >= every and (c.error_at or 0.0) > since for c in catalog.failing(root)
        )

    return stuck


def close_warning(wait: PolicyWait, root: str, daemon_running: bool, config: Config) -> str | None:
    """The warning ``CheckpointManager.close()`` logs, or None when nothing is left (or a
    daemon on the node will finish what is pending and nothing fails)."""
    if wait.done or (not wait.pending and not wait.failing):
        return None
    if daemon_running and not wait.failing:
        return None
    steps = _steps(wait.pending_steps or [c.step for c in wait.failing])
    what = "failing" if wait.failing else "pending"
    msg = f"exports of {root!r} are {what} at close ({steps}): {wait.describe()}"
    if daemon_running:
        return msg + "; the fmstore daemon on this node keeps retrying"
    return msg + f"; run `{drain_command(config)}` on this node to finish them"


def warn_due(failures: int, every: int) -> bool:
    """Whether the ``failures``-th failure in a row is one to warn the training process
    about: the ``every``-th, then twice as many, four times... (3, 6, 12, 24 for 3)."""
    if every < 1 or failures < every or failures % every:
        return False
    k = failures // every
    return k & (k - 1) == 0
