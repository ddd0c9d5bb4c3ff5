"""The deterministic simulation of exports in node parts and restores (fmstore.testing.sim,
its switches in tests/sim_parts.py): a fixed set of seeds finds no violation of I1-I4; a
schedule is a function of its seed and switches alone, and of nothing of the process (two
run at once in threads keep their own clocks); with each fix or protection taken back the
search finds the violation it prevents from fresh seeds, and at the seed the search from
seed 0 finds it at (for ``sweep-leases`` only there: ``python tests/sim_parts.py
--switches`` finds it from fresh seeds)."""

from __future__ import annotations

import contextlib
import os
import random
import threading

import pytest
import sim_parts as sim

#: Protections the search finds from fresh seeds, with the schedules it gets (about nine
#: times the most any of six runs took, docs/distributed.md: a miss has a chance below 1e-8
#: each).  The races (supersede, sweep, restore-unknown) within a few hundred
#: schedules thanks to the schedules' shapes (``sim_parts.AIMS``).
FRESH = {
    "count": 400,
    "record": 420,
    "retention": 150,
    "release": 160,
    "supersede": 1800,
    "restore-unknown": 2250,
    "sweep": 4050,
}
#: Again, by the first seed from 0 that breaks an invariant with it taken back (and
#: ``sweep-leases``, which fresh seeds find only within thousands of schedules).
FOUND_AT = sim.FOUND_AT


def test_schedules_keep_every_invariant(capsys):
    out = sim.search(range(150))
    with capsys.disabled():
        print(f"\nschedules: {len(out)}, violations: 0, store calls: {sum(o.steps for o in out)}")
    assert len(out) == 150


def test_a_schedule_is_a_function_of_its_seed_and_switches_alone():
    """The same seed twice in one process, with other schedules between (with and
    without switches, one cut short by a violation): the same trace, store call for
    store call with what each found or wrote."""
    seed, switch = 23, frozenset(["sweep"])  # a kill, transient errors, slow calls, PCT
    first = sim.run(seed, switch).trace
    sim.search(range(500, 530))
    with contextlib.suppress(sim.Violation):
        sim.search(range(600, 630), frozenset(["retention"]))
    assert sim.run(seed, switch).trace == first
    for fault in ("(transient error", "killed", "(slow)", "by priority"):
        assert any(fault in t for t in first), fault


def test_nothing_of_the_process_reaches_a_schedule(monkeypatch):
    """Its settings (``$FMSTORE_EXPORT_LEASE_TTL``, ``$FMSTORE_CLOCK_SKEW``), its id and its
    node's name change no schedule: every node's clock, id, process and lease settings
    come from the :class:`~fmstore.protocol.env.Env` the simulation hands it."""
    first = [o.trace for o in sim.search(range(8))]
    monkeypatch.setenv("FMSTORE_EXPORT_LEASE_TTL", "60")
    monkeypatch.setenv("FMSTORE_CLOCK_SKEW", "5")
    monkeypatch.setattr(os, "getpid", lambda: 7)
    monkeypatch.setenv("FMSTORE_NODE_ID", "n0")
    assert [o.trace for o in sim.search(range(8))] == first


def test_two_simulations_with_their_own_clocks_run_at_once_in_threads():
    """No clock, node or lease setting is set in a module: two searches whose virtual
    clocks start years apart, run together in two threads, each give the traces they give
    alone (a lease's renewal time is in the bytes each put's trace line checksums, so a
    clock shared between them would show)."""
    seeds, late = range(40, 52), 2_000_000_000.0
    alone = {
        sim.START: [o.trace for o in sim.search(seeds)],
        late: [o.trace for o in sim.search(seeds, start=late)],
    }
    assert alone[sim.START] != alone[late]
    together: dict[float, list[list[str]]] = {}
    failed: list[BaseException] = []
    go = threading.Barrier(2)

    def one(start: float) -> None:
        try:
            go.wait(timeout=60)
            together[start] = [o.trace for o in sim.search(seeds, start=start)]
        except BaseException as e:  # reported below, in the test's thread
            failed.append(e)

    threads = [threading.Thread(target=one, args=(t,)) for t in alone]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not failed, failed
    assert together == alone


@pytest.mark.parametrize("revert", sorted(FRESH))
def test_each_protection_taken_back_is_found_from_fresh_seeds(revert, capsys):
    start = random.SystemRandom().randrange(1 << 40)
    with pytest.raises(sim.Violation) as found:
        sim.search(range(start, start + FRESH[revert]), frozenset([revert]))
    with capsys.disabled():
        print(f"\n{revert} taken back: {found.value} (seeds from {start})")


@pytest.mark.parametrize("revert", sorted(FOUND_AT))
def test_each_rarer_protection_taken_back_fails_its_seed(revert):
    seed, invariant = FOUND_AT[revert]
    if seed < 0:
        pytest.skip(f"no seed known for {revert}: python tests/sim_parts.py --switches finds one")
    sim.run(seed)  # holds with the protection
    with pytest.raises(sim.Violation, match=f"^{invariant}"):
        sim.run(seed, frozenset([revert]))
