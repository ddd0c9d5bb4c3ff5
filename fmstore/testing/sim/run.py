"""One schedule of the simulation, and searches over many: the schedule's shape drawn from
its seed, its actors started, every parked store call granted in turn with the oracles
checked after each (``docs/distributed.md``, "The simulation")."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

from ...errors import FmstoreError
from ...format.manifest import MANIFEST_KEY
from .actors import Actors
from .scheduler import CLOCK_SKEW, START, Outcome, Scheduler, Violation, actor
from .stores import fake_copy, fake_verify
from .world import AIMS, ALL_NODES, World

__all__ = ["Switches", "fakes", "run", "schedule", "search"]

#: (module, attribute, value) each: what a search sets while it runs.
Switches = Sequence[tuple[Any, str, Any]]


async def schedule(seed: int, start: float = START) -> Outcome:
    """The schedule of ``seed``, its virtual clock from ``start``; :class:`Violation` at
    the first invariant it breaks."""
    rng = random.Random(seed)
    aim = rng.choice(AIMS)
    offsets = {n: rng.uniform(-CLOCK_SKEW / 2, CLOCK_SKEW / 2) for n in ALL_NODES}
    sched = Scheduler(rng, offsets, now=start, start=start)
    w = World(seed, rng, sched, aim)
    if rng.random() < 0.5:
        sched.prio = {}
        sched.drops = frozenset(rng.randrange(150) for _ in range(rng.randint(1, 3)))
        sched.trace.append(f"  (by priority, drops after steps {sorted(sched.drops)})")
    # Swarm: a schedule leaves out some of what the daemons do and sweeps at its own rate
    # (fewer kinds of work in one schedule: more of each interleaving of the rest).
    plans = rng.random() < 0.7  # retention and release passes
    sweeps = rng.choice((0.0, 0.4, 0.9))
    sched.slow = rng.choice((0.0, 0.1, 0.3))
    super_node = rng.choice(w.nodes)
    actors = {"exporters", "daemons", "stranger", "job"}
    manifest = f"/{MANIFEST_KEY}"
    if aim == "commit":
        # A superseder and the others' commits of one generation together: slow, the
        # others' part records (written after the superseder's export looked) and
        # manifests, and the superseder's removal of its record (``delete_own_part``).
        plans, sweeps, actors = False, 0.0, {"exporters"}
        others = [n for n in w.nodes if n != super_node]
        sched.aimed = (
            (frozenset(others), "put ", manifest),
            (frozenset([super_node]), "delete ", f"/part-{super_node}.json"),
            *[(frozenset([n]), "put ", f"/part-{n}.json") for n in others],
        )
    elif aim == "sweep":  # sweeps while exports are between their records and manifest
        plans, sweeps, actors = False, 0.9, {"exporters", "daemons", "stranger"}
        sched.aimed = ((frozenset(w.nodes), "put ", manifest),)
    elif aim == "restore":  # the job looking after the exports, on a flaky shared tier
        sweeps, actors = 0.0, {"exporters", "daemons", "job"}
        sched.aimed = ((frozenset(["job"]), "", ""),)
    sched.trace.append(
        f"  (aim: {aim}, retention passes: {plans}, sweeps at {sweeps}, slow: {sched.slow})"
    )

    async def as_actor(name: str, coro: Any) -> None:
        actor.set(name)
        # A refusal the real code reports (CorruptData, ...): the protocol's to survive.
        with contextlib.suppress(FmstoreError):
            await coro

    cast = Actors(w, rng, super_node, plans, sweeps)
    plan: dict[str, Any] = {}
    for n in w.nodes:
        plan[n] = cast.exporter(n)
        if "daemons" in actors:
            plan[f"{n}:daemon"] = cast.daemon(n)
    if "stranger" in actors:
        plan["stranger"] = cast.stranger()
    if "job" in actors:
        plan["job"] = cast.restorer()
    tasks = [asyncio.create_task(as_actor(k, c), name=k) for k, c in plan.items()]
    kill = rng.choice([None, *w.nodes]) if rng.random() < 0.3 else None
    kill_at = rng.randint(1, 60)
    try:
        while True:
            await sched.settle(tasks)
            for t in tasks:
                if t.done() and not t.cancelled() and (err := t.exception()) is not None:
                    raise err
            if not sched.parked:
                break
            sched.grant()
            if kill is not None and sched.steps == kill_at:
                sched.trace.append(f"  (node {kill} killed)")
                for t in tasks:
                    if t.get_name().split(":")[0] == kill:
                        t.cancel()  # killed between two store calls
                sched.parked = [c for c in sched.parked if c.actor.split(":")[0] != kill]
            w.oracles()
        w.oracles()
    except Violation as e:
        e.trace = sched.trace  # the schedule, to read
        raise
    finally:
        for t in tasks:
            t.cancel()
    return Outcome(seed, sched.steps, sched.trace)


def run(
    seed: int, switches: Switches = (), *, key: Hashable = None, start: float = START
) -> Outcome:
    """One schedule, replayable from its seed (and switches) alone, its virtual clock from
    ``start``."""
    return search([seed], switches, key=key, start=start)[0]


def search(
    seeds: Iterable[int],
    switches: Switches = (),
    *,
    key: Hashable = None,
    deadline: float | None = None,
    start: float = START,
) -> list[Outcome]:
    """Run the schedules of ``seeds`` (stopping at ``deadline``, ``time.monotonic()``),
    raising :class:`Violation` at the first that breaks an invariant.  ``switches``:
    (module, name, value) set while they run, each taking a protection back (a test's,
    named by ``key``).  Searches may run in several threads at once (each schedule's
    clocks and nodes are its own, through its :class:`Env`); those with different
    switches take turns (:func:`_patched`)."""
    import logging
    import time

    logging.getLogger("fmstore.sweep").setLevel(logging.CRITICAL)  # its report says it all
    done: list[Outcome] = []
    with _patched(key, switches):
        for seed in seeds:
            if deadline is not None and time.monotonic() > deadline:
                break
            done.append(asyncio.run(schedule(seed, start)))
    return done


#: What :func:`patches` set, while any search runs: the switches in force and how many
#: searches use them (searches with the same switches share them; others wait).
_patch_turn = threading.Condition()
_patch_state: dict[str, Any] = {"key": None, "users": 0, "undo": []}


def fakes() -> list[tuple[Any, str, Any]]:
    """The copy engine (thread pools, multipart writers, journals on disk) is outside the
    simulation: a byte-exact fake copies and verifies, one store call a blob."""
    from ...tiering.exports import parts

    return [(parts, "copy_blobs", fake_copy), (parts, "verify_checkpoint", fake_verify)]


@contextlib.contextmanager
def _patched(key: Hashable, switches: Switches) -> Iterator[None]:
    """The copy engine's fake (:func:`fakes`) and ``switches`` set for the searches of
    ``key``.  The only globals the simulation sets: code, not environment (every schedule
    of a search runs the same code; its clocks, nodes and settings are its own)."""
    st = _patch_state
    with _patch_turn:
        while st["users"] and st["key"] != key:
            _patch_turn.wait()
        if not st["users"]:
            undo = []
            for mod, name, value in [*fakes(), *switches]:
                undo.append((mod, name, getattr(mod, name)))
                setattr(mod, name, value)
            st["key"], st["undo"] = key, undo
        st["users"] += 1
    try:
        yield
    finally:
        with _patch_turn:
            st["users"] -= 1
            if not st["users"]:
                for mod, name, value in reversed(st["undo"]):
                    setattr(mod, name, value)
                st["key"], st["undo"] = None, []
                _patch_turn.notify_all()
