"""Retention deletes what no rule keeps, last copy included: one test per row of the table
in docs/tiering.md ("Retention"), then the run of the issue that grew Lustre without bound."""

from __future__ import annotations

from tiering_helpers import posix_config
from tiering_runs import held, run_saves

from fmstore.tiering.inventory.catalog import (
    CORRUPT,
    EXPORTING,
    MISSING,
    PRESENT,
    WRITING,
    Checkpoint,
    Copy,
    Pin,
)
from fmstore.tiering.policy import policies as pol

TIERS = ["nvme", "lustre", "s3"]


def parse(data):
    return pol.from_dict(data, tiers=TIERS)


def ck(step, created=None):
    return Checkpoint("run", step, step, float(step if created is None else created), 10, 1)


def cp(step, tier, st=PRESENT):
    return Copy("run", step, tier, st, 10, float(step), float(step), None, 1.0)


def deletes(p, cks, copies, **kw):
    s = pol.State(checkpoints=[ck(c) for c in cks], copies=copies, **kw)
    return sorted((d.step, d.tier) for d in pol.plan_retention(p, s))


NVME_2_LUSTRE_EVEN = {
    "export": [{"to": "lustre", "every_saves": 2}],
    "retention": {"nvme": {"keep_latest": 1}},
}


def test_row1_a_copy_no_rule_keeps_goes_when_another_complete_copy_exists():
    p = parse(NVME_2_LUSTRE_EVEN)
    got = deletes(p, [1, 2], [cp(1, "nvme"), cp(1, "lustre"), cp(2, "nvme"), cp(2, "lustre")])
    assert got == [(1, "nvme")]


def test_row2_the_last_copy_goes_when_no_rule_on_any_tier_keeps_it():
    p = parse(NVME_2_LUSTRE_EVEN)
    # the 1st save: no export wants it; nvme keeps only the latest (2).
    got = deletes(p, [1, 2], [cp(1, "nvme"), cp(2, "nvme"), cp(2, "lustre")])
    assert got == [(1, "nvme")]


def test_row3_the_last_copy_stays_while_an_export_of_it_is_pending():
    p = parse(NVME_2_LUSTRE_EVEN)
    # the 2nd save is wanted on lustre and not copied yet; the 1st is wanted nowhere.
    got = deletes(p, [1, 2, 3], [cp(1, "nvme"), cp(2, "nvme"), cp(3, "nvme")])
    assert got == [(1, "nvme")]


def test_row4_a_copy_its_tier_keeps_stays():
    p = parse(
        {
            "export": [{"to": "lustre", "every_saves": 1}],
            "retention": {"nvme": {"keep_latest": 1, "keep_every": 10, "keep_for": 100}},
        }
    )
    s = pol.State(
        checkpoints=[ck(5, 0), ck(10, 0), ck(15, 950), ck(20, 0)],
        copies=[cp(x, t) for x in (5, 10, 15, 20) for t in ("nvme", "lustre")],
        now=1000,
    )
    # 10: every 10th; 15: younger than 100 s; 20: latest
    assert pol.plan_retention(p, s) == [pol.Delete("run", 5, "nvme")]


def test_row5_a_tier_without_a_table_keeps_everything():
    p = parse({"export": [{"to": "lustre", "every_saves": 1}]})
    assert deletes(p, [1, 2, 3], [cp(x, t) for x in (1, 2, 3) for t in ("nvme", "lustre")]) == []


def test_row6_pinned_written_or_exported_checkpoints_keep_every_copy():
    p = parse(
        {
            "export": [{"to": "lustre", "every_saves": 1}],
            "retention": {"nvme": {"keep_latest": 0}, "lustre": {"keep_latest": 1}},
        }
    )
    copies = [
        cp(1, "nvme"),  # pinned
        cp(2, "nvme"),
        cp(2, "lustre", WRITING),  # being written
        cp(3, "nvme"),
        cp(3, "lustre", EXPORTING),  # being exported
        cp(4, "nvme"),
        cp(4, "lustre"),
    ]
    got = deletes(p, [1, 2, 3, 4], copies, pins=[Pin(1, "run", 1, "restore", "x", 99.0)], now=5)
    assert got == [(4, "nvme")]


def test_row7_when_no_tier_keeps_a_checkpoint_every_copy_goes():
    p = parse(
        {
            "export": [{"to": "lustre", "every_saves": 1}],
            "retention": {"nvme": {"keep_latest": 1}, "lustre": {"keep_latest": 1}},
        }
    )
    copies = [cp(x, t) for x in (1, 2) for t in ("nvme", "lustre")]
    assert deletes(p, [1, 2], copies) == [(1, "lustre"), (1, "nvme")]


def test_row8_the_last_good_copy_stays_while_a_tier_keeps_a_broken_copy_of_it():
    p = parse(
        {
            "export": [{"to": "lustre", "every_saves": 1}],
            "retention": {"nvme": {"keep_latest": 1}, "lustre": {"keep_every": 10}},
        }
    )
    # lustre keeps step 10 (every 10th) but its copy is corrupt; nvme's is the only good one.
    copies = [cp(10, "nvme"), cp(10, "lustre", CORRUPT), cp(11, "nvme"), cp(11, "lustre")]
    got = deletes(p, [10, 11], copies)
    assert (10, "nvme") not in got
    copies[1] = cp(10, "lustre", MISSING)
    assert (10, "nvme") not in deletes(p, [10, 11], copies)


def test_issue_run_keep_latest_on_a_middle_tier_is_honoured(tmp_path):
    # exports nvme→lustre every save, lustre→s3 every 5 saves; nvme keeps 2, lustre keeps 4.
    cfg = posix_config(
        str(tmp_path),
        {
            "export": [{"to": "lustre", "every_saves": 1}, {"to": "s3", "every_saves": 5}],
            "retention": {"nvme": {"keep_latest": 2}, "lustre": {"keep_latest": 4}},
        },
    )
    run_saves(cfg, "run", range(1, 31))
    assert held(cfg, "nvme", "run") == [29, 30]
    assert held(cfg, "lustre", "run") == [27, 28, 29, 30]
    assert held(cfg, "s3", "run") == [5, 10, 15, 20, 25, 30]
