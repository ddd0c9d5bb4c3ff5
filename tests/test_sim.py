"""The deterministic simulation of exports in node parts (tests/sim_parts.py): a fixed set
of seeds finds no violation of I1/I2/I4; a schedule is a function of its seed and
switches alone; and with each fix or protection taken back, the search from fresh seeds
finds the violation it prevents (``make test-sim`` searches at length)."""

from __future__ import annotations

import contextlib
import random

import pytest
import sim_parts as sim

#: Each protection a switch takes back, with the schedules the search gets to find it from
#: fresh seeds (about nine times the most it took in docs/distributed.md's runs: a miss
#: has a chance of about 1e-4).
FRESH = {
    "count": 60,
    "record": 300,
    "retention": 60,
    "release": 60,
    "supersede": 600,
    "sweep": 600,
    "sweep-leases": 600,
}


def test_schedules_of_two_and_three_nodes_keep_every_invariant(capsys):
    out = sim.search(range(150))
    with capsys.disabled():
        print(f"\nschedules: {len(out)}, violations: 0, store calls: {sum(o.steps for o in out)}")
    assert len(out) == 150


def test_a_schedule_is_a_function_of_its_seed_and_switches_alone():
    """The same seed twice in one process, with other schedules between (with and
    without switches, one cut short by a violation): the same trace, store call for
    store call with what each found or wrote."""
    seed, switch = 3, frozenset(["sweep"])  # a kill, transient errors, priorities
    first = sim.run(seed, switch).trace
    sim.search(range(500, 530))
    with contextlib.suppress(sim.Violation):
        sim.search(range(600, 630), frozenset(["retention"]))
    assert sim.run(seed, switch).trace == first
    for fault in ("(transient error", "killed", "by priority"):
        assert any(fault in t for t in first), fault


@pytest.mark.parametrize("revert", sorted(FRESH))
def test_each_protection_taken_back_is_found_from_fresh_seeds(revert, capsys):
    start = random.SystemRandom().randrange(1 << 40)
    with pytest.raises(sim.Violation) as found:
        sim.search(range(start, start + FRESH[revert]), frozenset([revert]))
    with capsys.disabled():
        print(f"\n{revert} taken back: {found.value} (seeds from {start})")
