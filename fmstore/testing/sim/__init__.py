"""A deterministic simulation of exports in node parts, retention, release, the orphan
sweep and restores: the real code of fmstore.tiering and fmstore.checkpoint.gc against in-memory stores
in which every store call is a scheduling point of one seeded scheduler.

One schedule (``docs/distributed.md``, "The simulation"): 2 or 3 nodes each hold their part
of two saved steps on their own node-local store; each node's exporter exports its parts to
the shared store (``parts.export_part``, the copy engine replaced by a byte-exact fake), one
may supersede its first export (``parts.delete_own_part``); each node's daemon rescans
(``Tiers.committed_facts``), plans retention and release (``policies.plan_retention``,
``policies.plan_release``), removes what they choose (``mover.delete_checkpoint``) and
sweeps orphans (``sweep.Sweeper``); a stranger may write a part record or a junk manifest.
Faults: a node killed between two store calls, clocks apart within the allowed skew, typed
transient store errors (a write or delete may land and still fail).  Virtual time advances
between calls, never past a parked call's deadline (a store call lands within half a lease
lifetime of being made: the protocol's stated assumption).  Each schedule draws a shape
(:data:`AIMS`): all of the actors, or a few aimed at one race (a superseder against the
others' commits, sweeps against exports mid-commit, restores on a flaky tier after the
exports) by which actors run and which of their calls are slow.  After every call the oracles
check I1 in full (the shared tier's ``keep_latest`` newest steps restorable from some tier)
and its counting half, I2 (a manifest's blobs all there, byte-exact) and I4 (no blob of a
committed manifest deleted).

A failing schedule raises :class:`Violation` naming the seed; ``run(seed)`` replays it.

Split by concept: :mod:`.scheduler` (the seeded choice of the next store call, virtual time,
each node's clock and :class:`~fmstore.protocol.env.Env`), :mod:`.stores` (the in-memory
stores, the checkpoints, the copy engine's fake), :mod:`.world` (one schedule's nodes,
stores, tiers and catalogs), :mod:`.actors` (exporters, daemons, a stranger, the job),
:mod:`.oracles` (the invariants) and :mod:`.run` (schedules and searches).  The switches
that take a protection back, to show the search finds what it prevents, are the tests'
(``tests/sim_parts.py``).
"""

from __future__ import annotations

from .run import Switches, fakes, run, schedule, search
from .scheduler import CLOCK_SKEW, LEASE_TTL, SIM_PID, START, Outcome, Scheduler, Violation
from .world import AIMS, ALL_NODES, ROOT, STEPS, World

__all__ = [
    "AIMS",
    "ALL_NODES",
    "CLOCK_SKEW",
    "LEASE_TTL",
    "ROOT",
    "SIM_PID",
    "START",
    "STEPS",
    "Outcome",
    "Scheduler",
    "Switches",
    "Violation",
    "World",
    "fakes",
    "run",
    "schedule",
    "search",
]
