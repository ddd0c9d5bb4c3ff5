"""The deterministic simulation of exports in node parts (tests/sim_parts.py): a fixed set
of seeds finds no violation of I1/I2/I4, and with each fix of the three findings taken
back, the search from fresh seeds finds the violation it prevents.  ``make test-sim`` runs
the search at length."""

from __future__ import annotations

import random

import pytest
import sim_parts as sim


def test_schedules_of_two_nodes_keep_every_invariant(capsys):
    out = sim.search(range(100))
    with capsys.disabled():
        print(f"\nschedules: {len(out)}, violations: 0, store calls: {sum(o.steps for o in out)}")
    assert len(out) == 100


def test_a_schedule_replays_from_its_seed():
    assert sim.run(7).trace == sim.run(7).trace


@pytest.mark.parametrize("revert", sim.REVERTS)
def test_each_fix_taken_back_is_found_from_fresh_seeds(revert, capsys):
    start = random.SystemRandom().randrange(1 << 40)
    with pytest.raises(sim.Violation) as found:
        sim.search(range(start, start + 2000), frozenset([revert]))
    with capsys.disabled():
        print(f"\n{revert} taken back: {found.value} (seeds from {start})")
