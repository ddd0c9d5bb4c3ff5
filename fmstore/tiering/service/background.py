"""Policies in the background: :class:`BackgroundRunner` runs a
:class:`~fmstore.tiering.policy.runner.PolicyRunner` in a daemon thread (of the policy helper
process, or of the training process itself), and :class:`IdleSignal` tells whoever waits for
idle policies when a step found nothing left to do."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ...errors import FmstoreError
from ..policy.failures import drain_command, warn_due
from ..policy.policies import plan
from ..policy.runner import PolicyRunner, StepReport, log, warn_event

#: How often a wait for idle policies asks whether to give up (exports that keep failing).
GIVE_UP_EVERY = 0.25
#: How often a runner locked out by a daemon on the node looks at the catalog for the
#: daemon's progress while someone waits for idle policies.
LOCKED_POLL = 0.25


class IdleSignal:
    """Pokes counted, and the count a step that found nothing to do had seen: a waiter
    for poke ``n`` is released by such a step that began after it (or when ``gone``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.poked = 0
        self.idle_at = -1
        self.gone = False

    def poke(self) -> int:
        with self._cond:
            self.poked += 1
            return self.poked

    def waiting(self) -> bool:
        """Whether a poke is not yet answered by an idle step (someone may be waiting)."""
        with self._cond:
            return self.poked > self.idle_at

    def idle(self, seen: int) -> None:
        with self._cond:
            self.idle_at = max(self.idle_at, seen)
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self.gone = True
            self._cond.notify_all()

    def wait(
        self, n: int, timeout: float | None, give_up: Callable[[], bool] | None = None
    ) -> bool:
        """Wait for an idle step after poke ``n``; ``give_up`` is asked every
        :data:`GIVE_UP_EVERY` seconds and ends the wait (False) when it says so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if give_up is not None:
                    left = GIVE_UP_EVERY if left is None else min(left, GIVE_UP_EVERY)
                if self._cond.wait_for(lambda: self.idle_at >= n or self.gone, left):
                    return self.idle_at >= n
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                if give_up is not None and give_up():
                    return False


class BackgroundRunner:
    """Runs a :class:`PolicyRunner` in a daemon thread (of the policy helper process, see
    :mod:`.helper`, or of the training process itself).

    It wakes every ``interval`` seconds or when :meth:`poke` is called (after a save), at
    once after a step that moved data (so a wait for idle policies ends with the work), and
    runs a step only when it gets the runner lock, so with an ``fmstore daemon`` on the node
    it stays idle.  After a step that found nothing to do it calls ``on_idle(n)``, ``n``
    being the number of pokes it had seen before that step began.  :meth:`close` stops it
    after the current copy.

    ``on_warn`` hears what the training process must know: each problem ``startup_check``
    (run once, before the first step) returns, and an export that has failed
    ``[policies] warn_after_failures`` times in a row (again at twice, four times as
    many...).  Without it those are logged at warning here.
    """

    def __init__(
        self,
        runner: PolicyRunner,
        *,
        interval: float = 5.0,
        on_idle: Callable[[int], None] | None = None,
        on_warn: Callable[[str], None] | None = None,
        startup_check: Callable[[], list[str]] | None = None,
    ) -> None:
        self.runner = runner
        self.interval = interval
        self._on_idle = on_idle
        self._on_warn = on_warn or (lambda text: log.warning("%s", text))
        self._startup_check = startup_check
        self._wake = threading.Event()
        self._signal = IdleSignal()
        self._thread = threading.Thread(target=self._main, name="fmstore-policies", daemon=True)
        self.last: StepReport | None = None
        self._thread.start()

    def poke(self) -> int:
        n = self._signal.poke()
        self._wake.set()
        return n

    def _warn_failures(self, rep: StepReport) -> None:
        every = self.runner.policies.warn_after_failures
        for f in rep.failed:
            if f.action == "export" and warn_due(f.failures, every):
                self._on_warn(
                    f"{f.describe()}; the checkpoint is not on {f.dst} yet (`fmstore daemon "
                    f"--check` names the setting to fix; `{drain_command(self.runner.config)}` finishes the exports)"
                )

    def _check(self) -> None:
        if self._startup_check is None:
            return
        try:
            problems = self._startup_check()
        except Exception as e:  # the check must never take the training process down
            problems = [f"the tier check could not run: {e}"]
        for text in problems:
            self._on_warn(text)

    def _main(self) -> None:
        backoff = 0.0
        self._check()
        while not self.runner.stop.is_set():
            self._wake.clear()
            seen = self._signal.poked
            fresh: StepReport | None = None
            try:
                self.last = fresh = self.runner.step()
                backoff = 0.0 if not fresh.errors else min(max(1.0, backoff * 2), 60.0)
            except FmstoreError as e:
                warn_event("step_error", f"policy step failed: {e}", error=str(e))
                backoff = min(max(1.0, backoff * 2), 60.0)
            except Exception as e:  # keep the training process alive whatever happens here
                log.exception("policy step failed: %s", e)
                backoff = min(max(1.0, backoff * 2), 60.0)
            if fresh is not None:
                self._warn_failures(fresh)
            last = self.last
            locked = fresh is not None and fresh.skipped_locked
            idle = (
                last is not None
                and not last.skipped_locked
                and not last.did_something
                and not last.errors
                and not last.deferred
            )
            if locked:
                # A daemon on the node does the work: its progress is in the catalog (the
                # copies it commits, the exports it leaves ``exporting``), so the policies
                # are satisfied when a plan made from the catalog is empty.
                idle = self._nothing_planned()
            if idle:
                self._signal.idle(seen)
                if self._on_idle is not None:
                    self._on_idle(seen)
            if fresh is not None and fresh.did_something:
                continue  # more may be due (the plan changed while we acted), as in the daemon
            due = self.runner.backoff.next_due()
            wait = backoff or self.interval
            if locked and not idle and self._signal.waiting():
                wait = min(wait, LOCKED_POLL)
            self._wake.wait(wait if due is None else min(wait, max(due, 0.05)))

    def _nothing_planned(self) -> bool:
        try:
            state = self.runner.state()
            return not plan(self.runner.policies, state)
        except Exception as e:  # a catalog being rebuilt: look again at the next wake-up
            log.debug("could not read the catalog for the daemon's progress: %s", e)
            return False

    def wait_idle(
        self, timeout: float | None = None, give_up: Callable[[], bool] | None = None
    ) -> bool:
        """Wait until a step that began after this call finds nothing to do (every policy
        satisfied, including for the saves recorded before the call); False on timeout or
        as soon as ``give_up()`` is true."""
        return self._signal.wait(self.poke(), timeout, give_up)

    def close(self, timeout: float | None = 60.0) -> None:
        self.runner.stop.set()
        self._wake.set()
        self._thread.join(timeout)
