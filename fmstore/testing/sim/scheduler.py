"""The simulation's scheduler: one seeded choice of which parked store call goes next, and
virtual time, from which each simulated node's clock (and so its protocol
:class:`~fmstore.protocol.env.Env`) reads."""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...protocol.env import Env

__all__ = ["CLOCK_SKEW", "LEASE_TTL", "SIM_PID", "START", "Outcome", "Scheduler", "Violation"]

#: The protocol's lease lifetime and clock skew in every schedule (their defaults), whatever
#: ``$FMSTORE_EXPORT_LEASE_TTL`` / ``$FMSTORE_CLOCK_SKEW`` the process was started with:
#: each node's :class:`Env` is made here, never read from the process.
LEASE_TTL = 120.0
CLOCK_SKEW = 10.0
#: The process id every simulated exporter writes in its leases (all nodes run in this
#: process; a real id would make the bytes written depend on it).
SIM_PID = 4242
#: Where virtual time starts, by default (``run(seed, start=...)`` picks another).
START = 1_000_000.0
#: The actor running in this task (``node``, ``node:daemon``, ``stranger``, ``job``): who
#: each parked call is, in the trace and for the kills.
actor: contextvars.ContextVar[str] = contextvars.ContextVar("actor", default="")


class Violation(AssertionError):
    """An invariant broken; ``trace`` (set by the run) is the schedule, to read."""

    trace: list[str] = []


@dataclass
class _Call:
    actor: str
    issued: float
    go: asyncio.Future[None]
    slow: bool = False


@dataclass
class Scheduler:
    """Grants one parked store call at a time, chosen by ``rng``; owns virtual time.

    Two ways to choose, drawn per schedule: uniformly among the parked calls, or by
    priority (PCT: each actor a random priority, the highest parked one granted; at a few
    random steps the actor just granted drops below every other).  Priorities run one
    actor through many calls while another waits between two of its own: the narrow
    windows of the races (a committer paused before its manifest write while a superseder
    or a sweep runs) that uniform choice reaches rarely."""

    rng: random.Random
    offsets: dict[str, float]
    now: float = START
    #: Where virtual time started (the trace shows time since).
    start: float = START
    parked: list[_Call] = field(default_factory=list)
    steps: int = 0
    #: By priority: each actor's, and the steps after which the granted actor drops.
    prio: dict[str, float] | None = None
    drops: frozenset[int] = frozenset()
    #: The share of calls that are slow: granted only when every parked call is slow
    #: (at the latest half a lease lifetime after they were made, as any call).
    slow: float = 0.0
    #: The calls a schedule's shape aims at, each slow: (actors, verb, end of the key) each.
    aimed: tuple[tuple[frozenset[str], str, str], ...] = ()
    #: Puts and deletes that landed: the oracles look again only after one.
    writes: int = 0
    trace: list[str] = field(default_factory=list)

    def clock_of(self, node: str) -> Callable[[], float]:
        """Node ``node``'s clock: virtual time plus its own offset."""
        offset = self.offsets.get(node, 0.0)
        return lambda: self.now + offset

    def env(self, node: str) -> Env:
        """Node ``node``'s protocol environment: its clock, its id, :data:`SIM_PID`, the
        schedule's lease settings.  No renewal in the background (``lease_renew`` beyond
        any schedule): renewals come from the attempts' own lease writes only (fewer
        renewals: harder)."""
        return Env(
            lease_ttl=LEASE_TTL,
            lease_renew=1e9,
            clock_skew=CLOCK_SKEW,
            clock=self.clock_of(node),
            node=node,
            pid=SIM_PID,
        )

    async def point(self, what: str) -> None:
        call = _Call(actor.get(), self.now, asyncio.get_running_loop().create_future())
        call.slow = bool(self.slow) and self.rng.random() < self.slow
        call.slow = call.slow or any(
            call.actor in actors and what.startswith(verb) and what.endswith(end)
            for actors, verb, end in self.aimed
        )
        self.parked.append(call)
        await call.go
        slow = " (slow)" if call.slow else ""
        self.trace.append(f"{self.now - self.start:9.3f} {call.actor} {what}{slow}")

    def note(self, outcome: str) -> None:
        """What the call just granted found or left (the trace is the whole schedule)."""
        self.trace.append(f"  = {outcome}")

    async def settle(self, tasks: list[asyncio.Task[Any]]) -> None:
        """Run every task until it parks at a store call or ends."""
        for _ in range(10_000):
            await asyncio.sleep(0)
            if all(t.done() for t in tasks) or self._quiet(tasks):
                return
        raise Violation("an actor neither parks at a store call nor ends")

    def _quiet(self, tasks: list[asyncio.Task[Any]]) -> bool:
        live = {t.get_name() for t in tasks if not t.done()}
        return live <= {c.actor for c in self.parked if not c.go.done()}

    def grant(self) -> _Call:
        latest = min(c.issued for c in self.parked) + LEASE_TTL / 2 - 1e-3
        gap = self.rng.choice((0.0, 0.5, LEASE_TTL / 8, LEASE_TTL / 3, LEASE_TTL))
        self.now = max(self.now, min(self.now + gap, latest))
        ready = [i for i, c in enumerate(self.parked) if not c.slow] or range(len(self.parked))
        if self.prio is None:
            call = self.parked.pop(ready[self.rng.randrange(len(ready))])
        else:
            for c in self.parked:
                if c.actor not in self.prio:
                    self.prio[c.actor] = self.rng.random()
            prio = self.prio
            call = self.parked.pop(max(ready, key=lambda i: prio[self.parked[i].actor]))
            if self.steps in self.drops:
                self.prio[call.actor] = min(self.prio.values()) - 1.0
        call.go.set_result(None)
        self.steps += 1
        return call


@dataclass
class Outcome:
    """A schedule that kept every invariant: its seed, its store calls, its trace."""

    seed: int
    steps: int
    trace: list[str]
