"""Export cadence is a function of the run, not of the catalog's history: a run whose
catalog is lost (or whose node is replaced) exports exactly the steps an uninterrupted run
exports."""

from __future__ import annotations

from tiering_helpers import posix_config
from tiering_runs import held, lose_catalog, replace_node, run_saves

from fmstore.tiering.inventory.catalog import PRESENT, Checkpoint, Copy
from fmstore.tiering.policy import policies as pol

EVERY_2_SAVES = {
    "export": [{"to": "lustre", "every_saves": 1}, {"to": "s3", "every_saves": 2}],
    "retention": {"nvme": {"keep_latest": 2}, "lustre": {"keep_latest": 4}},
}
EVERY_4_STEPS = {
    "export": [{"to": "lustre", "every_saves": 1}, {"to": "s3", "every_steps": 4}],
    "retention": {"nvme": {"keep_latest": 1}, "lustre": {"keep_latest": 1}},
}


def test_every_steps_exports_the_steps_divisible_by_n():
    p = pol.from_dict({"export": [{"to": "s3", "every_steps": 100}]}, tiers=["nvme", "s3"])
    cks = [Checkpoint("r", s, i + 1, float(i), 1, 1) for i, s in enumerate([0, 50, 100, 150, 300])]
    wanted = pol.wanted_tiers(p, cks)
    assert sorted(s for (_, s), t in wanted.items() if "s3" in t) == [0, 100, 300]


def test_every_saves_counts_in_step_order_not_in_the_order_steps_were_recorded():
    p = pol.from_dict({"export": [{"to": "s3", "every_saves": 2}]}, tiers=["nvme", "s3"])
    # Recorded out of order (a rescan finds slower tiers' steps last): seq says nothing.
    order = [4, 5, 6, 1, 2, 3]
    cks = [Checkpoint("r", s, i + 1, 0.0, 1, 1) for i, s in enumerate(order)]
    wanted = pol.wanted_tiers(p, cks)
    assert sorted(s for (_, s), t in wanted.items() if "s3" in t) == [2, 4, 6]


def test_every_saves_counts_from_the_newest_checkpoint_already_on_the_destination():
    p = pol.from_dict({"export": [{"to": "s3", "every_saves": 3}]}, tiers=["nvme", "s3"])
    # A rebuilt catalog: older saves are gone, 9 is on s3 (it was the 3rd of its three).
    cks = [Checkpoint("r", s, 0, 0.0, 1, 1) for s in (9, 10, 11, 12, 13)]
    copies = [Copy("r", 9, "s3", PRESENT, 1, 0.0, 0.0, None, 1.0)]
    wanted = pol.wanted_tiers(p, cks, copies)
    assert sorted(s for (_, s), t in wanted.items() if "s3" in t) == [9, 12]


def uninterrupted(base, policies, steps):
    cfg = posix_config(str(base), policies)
    run_saves(cfg, "run", steps)
    return cfg


def test_every_saves_survives_a_lost_catalog_and_a_replaced_node(tmp_path):
    steps = list(range(0, 24))
    ref = uninterrupted(tmp_path / "ref", EVERY_2_SAVES, steps)
    want = held(ref, "s3", "run")
    assert want == list(range(1, 24, 2))  # the 2nd, 4th, … save

    cfg = posix_config(str(tmp_path / "cut"), EVERY_2_SAVES)
    base = str(tmp_path / "cut")
    run_saves(cfg, "run", steps[:7])  # killed after 7 saves…
    lose_catalog(base)  # …and its catalog lost with it
    run_saves(cfg, "run", steps[7:11])
    replace_node(base)  # a new node after 11 saves (an odd count)
    run_saves(cfg, "run", steps[11:17])
    lose_catalog(base)
    run_saves(cfg, "run", steps[17:])
    assert held(cfg, "s3", "run") == want
    assert held(cfg, "lustre", "run") == held(ref, "lustre", "run")


def test_every_steps_survives_a_lost_catalog_even_when_older_saves_are_gone(tmp_path):
    steps = list(range(0, 20))
    ref = uninterrupted(tmp_path / "ref", EVERY_4_STEPS, steps)
    assert held(ref, "s3", "run") == [0, 4, 8, 12, 16]

    base = str(tmp_path / "cut")
    cfg = posix_config(base, EVERY_4_STEPS)
    run_saves(cfg, "run", steps[:6])
    replace_node(base)  # lustre keeps only the latest: steps 1..4 are gone everywhere
    run_saves(cfg, "run", steps[6:13])
    lose_catalog(base)
    run_saves(cfg, "run", steps[13:])
    assert held(cfg, "s3", "run") == [0, 4, 8, 12, 16]
