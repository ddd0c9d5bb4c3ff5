"""Policies: parsing and start-up validation, and the pure decision functions."""

from __future__ import annotations

import pytest

from fmstore.config import from_dict as config_from_dict
from fmstore.errors import ConfigError
from fmstore.tiering.inventory.catalog import (
    CORRUPT,
    DELETED,
    EXPORTING,
    PRESENT,
    RELEASED,
    Checkpoint,
    Copy,
    Pin,
)
from fmstore.tiering.policy import policies as pol

TIERS = ["nvme", "lustre", "s3"]


def parse(data):
    return pol.from_dict(data, tiers=TIERS)


BASE = {
    "export": [{"to": "lustre", "every_saves": 1}, {"to": "s3", "every_saves": 2}],
    "retention": {"nvme": {"keep_latest": 2}},
}


def ck(step, seq=None, created=None):
    seq = seq if seq is not None else step
    return Checkpoint("run", step, seq, float(created if created is not None else step), 10, 1)


def cp(step, tier, state=PRESENT, verified=1.0, last_access=None, nbytes=10):
    return Copy("run", step, tier, state, nbytes, float(step), float(step), last_access, verified)


# ---- parsing and validation --------------------------------------------------------------


def test_parses_the_documented_example():
    p = parse(
        {
            "ladder": ["nvme", "lustre", "s3"],
            "write_tier": "nvme",
            "on_full": "fallback",
            "export": [
                {"to": "lustre", "every_saves": 1, "every_seconds": "10m"},
                {"to": "s3", "every_saves": 5},
            ],
            "retention": {
                "nvme": {"keep_latest": 2},
                "lustre": {"keep_latest": 10, "keep_every": 1000, "keep_for": "7d"},
            },
            "release": {"nvme": {"after": "30m", "high_watermark": 0.9, "low_watermark": 0.7}},
            "restore": {"mode": "lazy", "cache_tier": "nvme"},
        }
    )
    assert p.exports[0] == pol.ExportRule("lustre", every_saves=1, every_seconds=600.0)
    assert p.retention["lustre"].keep_for == 7 * 86400
    assert p.release["nvme"].after == 1800
    assert p.durable_for("nvme") == ("lustre", "s3")
    assert p.restore.mode == "lazy" and p.on_full == "fallback"


def test_defaults_follow_the_configured_tiers():
    cfg = config_from_dict({"tiers": {"nvme": {"url": "/a"}, "lustre": {"url": "/b"}}})
    p = pol.from_config(cfg)
    assert p.ladder == ("nvme", "lustre") and p.write_tier == "nvme" and not p.exports


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"export": [{"to": "tape", "every_saves": 1}]}, "tier 'tape', which is not configured"),
        ({"export": [{"to": "s4", "every_saves": 1}]}, "did you mean 's3'"),
        ({"write_tier": "ram"}, "write_tier names tier 'ram'"),
        ({"retention": {"glacier": {"keep_latest": 1}}}, "retention names tier 'glacier'"),
        ({"export": [{"to": "lustre"}]}, "needs every_steps, every_saves and/or every_seconds"),
        ({"export": [{"to": "nvme", "every_saves": 1}]}, "to the write tier"),
        ({"export": [{"to": "lustre", "every_saves": 0}]}, "every_saves must be"),
        ({"export": [{"to": "lustre", "every_seconds": "soon"}]}, "is not a duration"),
        ({"export": [{"to": "lustre", "evry_saves": 1}]}, "did you mean 'every_saves'"),
        ({"retention": {"nvme": {}}}, "has no rule"),
        (
            {
                "export": [{"to": "lustre", "every_saves": 1}],
                "retention": {"lustre": {"keep_latest": 0}},
            },
            "every export would be deleted",
        ),
        ({"retention": {"nvme": {"keep_latest": 0}}}, "its own last copy"),
        ({"release": {"nvme": {"after": "1h"}}}, "no export rule copies checkpoints there"),
        (
            {
                "export": [{"to": "s3", "every_saves": 1}],
                "release": {"nvme": {"high_watermark": 0.5, "low_watermark": 0.8}},
            },
            "must be below high_watermark",
        ),
        (
            {"export": [{"to": "s3", "every_saves": 1}], "release": {"s3": {"after": 1}}},
            "last tier of the ladder",
        ),
        ({"on_full": "maybe"}, "on_full must be"),
        ({"ladder": ["nvme", "nvme"]}, "lists a tier twice"),
        ({"restore": {"mode": "sometimes"}}, "restore.mode"),
        ({"retain": {}}, "did you mean 'retention'"),
    ],
)
def test_bad_policies_fail_at_start_up_with_a_clear_message(data, message):
    with pytest.raises(ConfigError, match=message):
        parse(data)


def test_validate_on_python_objects():
    p = pol.Policies(
        ladder=("nvme", "lustre"), write_tier="nvme", exports=(pol.ExportRule("tape", 1),)
    )
    with pytest.raises(ConfigError, match="'tape'"):
        p.validate(["nvme", "lustre"])


# ---- decisions ---------------------------------------------------------------------------


def test_export_every_n_saves_and_every_t_seconds():
    p = parse({"export": [{"to": "lustre", "every_seconds": 10}, {"to": "s3", "every_saves": 3}]})
    cks = [
        ck(s, seq=i + 1, created=t)
        for i, (s, t) in enumerate([(1, 0), (2, 4), (3, 11), (4, 15), (5, 22), (6, 30)])
    ]
    wanted = pol.wanted_tiers(p, cks)
    assert [s for (_, s), t in sorted(wanted.items()) if "lustre" in t] == [1, 3, 5]
    assert [s for (_, s), t in sorted(wanted.items()) if "s3" in t] == [3, 6]


def test_exports_are_planned_from_the_fastest_present_copy_and_resume_half_done_ones():
    p = parse(BASE)
    s = pol.State(
        checkpoints=[ck(1), ck(2), ck(3)],
        copies=[
            cp(1, "nvme"),
            cp(1, "lustre", EXPORTING),
            cp(2, "nvme", RELEASED),
            cp(2, "lustre"),
            cp(3, "nvme", "writing"),
        ],
        now=10,
    )
    got = pol.plan_exports(p, s)
    assert got == [  # the newest checkpoint first
        pol.Export("run", 2, "lustre", "s3"),
        pol.Export("run", 1, "nvme", "lustre"),
    ]


def test_no_re_export_of_a_copy_that_policy_deleted_but_corrupt_ones_are_recopied():
    p = parse(BASE)
    s = pol.State(
        checkpoints=[ck(1), ck(2)],
        copies=[cp(1, "nvme"), cp(1, "lustre", DELETED), cp(2, "nvme"), cp(2, "lustre", CORRUPT)],
    )
    assert pol.plan_exports(p, s) == [
        pol.Export("run", 2, "nvme", "lustre"),
        pol.Export("run", 2, "nvme", "s3"),
    ]


def test_retention_keeps_latest_n_and_pending_exports_and_drops_what_no_rule_keeps():
    p = parse(
        {"export": [{"to": "lustre", "every_saves": 2}], "retention": {"nvme": {"keep_latest": 1}}}
    )
    s = pol.State(
        checkpoints=[ck(1), ck(2), ck(3), ck(4)],
        copies=[
            cp(1, "nvme"),  # only copy, never exported (odd save): no rule keeps it
            cp(2, "nvme"),
            cp(2, "lustre"),  # exported: nvme copy may go
            cp(3, "nvme"),
            cp(4, "nvme"),  # latest: kept; its export is also pending
        ],
    )
    assert pol.plan_retention(p, s) == [
        pol.Delete("run", 1, "nvme", last_copy=True),
        pol.Delete("run", 2, "nvme"),
        pol.Delete("run", 3, "nvme", last_copy=True),
    ]


def test_retention_any_of_rules():
    p = parse(
        {
            "export": [{"to": "lustre", "every_saves": 1}],
            "retention": {"nvme": {"keep_latest": 1, "keep_every": 10, "keep_for": 100}},
        }
    )
    cks = [
        ck(5, seq=1, created=0),
        ck(10, seq=2, created=0),
        ck(15, seq=3, created=950),
        ck(20, seq=4, created=0),
    ]
    copies = [cp(c.step, t) for c in cks for t in ("nvme", "lustre")]
    s = pol.State(checkpoints=cks, copies=copies, now=1000)
    # 5: no rule keeps it; 10: every 10th; 15: younger than 100 s; 20: latest (and every 10th)
    assert pol.plan_retention(p, s) == [pol.Delete("run", 5, "nvme")]


def test_pinned_and_in_flight_checkpoints_are_never_deleted():
    p = parse(
        {
            "export": [{"to": "lustre", "every_saves": 1}],
            "retention": {"nvme": {"keep_latest": 0}, "lustre": {"keep_latest": 1}},
        }
    )
    cks = [ck(1), ck(2), ck(3)]
    copies = [
        cp(1, "nvme"),
        cp(1, "lustre"),
        cp(2, "nvme"),
        cp(2, "lustre"),
        cp(3, "nvme"),
        cp(3, "lustre", EXPORTING),
    ]
    s = pol.State(
        checkpoints=cks, copies=copies, pins=[Pin(1, "run", 1, "restore", "x", 99.0)], now=5
    )
    got = pol.plan_retention(p, s)
    assert pol.Delete("run", 2, "nvme") in got
    assert all(d.step not in (1, 3) for d in got)
    # lustre keeps only the latest present (2); step 2's nvme copy is deleted in the same plan,
    # so lustre's copy of 2 is its last one and must stay too.
    assert pol.Delete("run", 2, "lustre") not in got


def test_release_by_age_needs_a_verified_durable_copy():
    p = parse({"export": [{"to": "lustre", "every_saves": 1}], "release": {"nvme": {"after": 100}}})
    cks = [ck(1), ck(2), ck(3)]
    copies = [
        cp(1, "nvme", last_access=0),
        cp(1, "lustre"),
        cp(2, "nvme", last_access=0),
        cp(2, "lustre", verified=None),  # not verified: stays
        cp(3, "nvme", last_access=950),  # used recently: stays
        cp(3, "lustre"),
    ]
    s = pol.State(checkpoints=cks, copies=copies, now=1000)
    assert pol.plan_release(p, s) == [pol.Release("run", 1, "nvme")]


def test_release_by_watermark_goes_down_to_the_low_mark_least_recently_used_first():
    p = parse(
        {
            "export": [{"to": "s3", "every_saves": 1}],
            "release": {"nvme": {"high_watermark": 0.8, "low_watermark": 0.5}},
        }
    )
    cks = [ck(i) for i in range(1, 6)]
    copies = [cp(i, "nvme", last_access=10 - i, nbytes=20) for i in range(1, 6)]
    copies += [cp(i, "s3") for i in range(1, 6)]
    s = pol.State(checkpoints=cks, copies=copies, now=100, usage={"nvme": pol.TierUsage(90, 100)})
    # 90 → 70 → 50: the two least recently used (5 and 4) go
    assert pol.plan_release(p, s) == [pol.Release("run", 4, "nvme"), pol.Release("run", 5, "nvme")]
    s2 = pol.State(checkpoints=cks, copies=copies, now=100, usage={"nvme": pol.TierUsage(70, 100)})
    assert pol.plan_release(p, s2) == []


def test_plan_is_a_fixed_point_once_carried_out():
    p = parse(BASE)
    cks = [ck(i) for i in range(1, 5)]
    copies = {(i, "nvme"): cp(i, "nvme") for i in range(1, 5)}
    for _ in range(5):
        s = pol.State(checkpoints=cks, copies=list(copies.values()), now=10)
        actions = pol.plan(p, s)
        if not actions:
            break
        for a in actions:
            if isinstance(a, pol.Export):
                copies[(a.step, a.dest)] = cp(a.step, a.dest)
            elif isinstance(a, pol.Delete):
                copies[(a.step, a.tier)] = cp(a.step, a.tier, DELETED)
    else:
        pytest.fail("plan did not converge")
    states = {(k[0], k[1]): v.state for k, v in copies.items()}
    assert all(states[(i, "lustre")] == PRESENT for i in range(1, 5))
    assert [i for i in range(1, 5) if states.get((i, "s3")) == PRESENT] == [2, 4]
    assert [i for i in range(1, 5) if states[(i, "nvme")] == PRESENT] == [3, 4]


def test_export_lag_is_the_age_of_the_oldest_waiting_checkpoint():
    p = parse(BASE)
    s = pol.State(
        checkpoints=[ck(1, created=10), ck(2, created=20)],
        copies=[cp(1, "nvme"), cp(1, "lustre"), cp(2, "nvme")],
        now=50,
    )
    assert pol.export_lag(p, s) == 30.0  # 1 waits for nothing (s3 takes every 2nd); 2 waits
