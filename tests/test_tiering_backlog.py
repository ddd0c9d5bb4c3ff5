"""A backlog of exports is coalesced: when a newer checkpoint is committed on the source,
pending exports of older ones that the destination's retention would not keep are skipped
(``superseded``), so the newest checkpoint goes next and the source does not fill up."""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY
from tiering_helpers import posix_config
from tiering_runs import held, run_saves, settle

from fmstore.config import Config
from fmstore.tiering.inventory.catalog import PRESENT, WRITING, Catalog, Checkpoint, Copy
from fmstore.tiering.policy import policies as pol
from fmstore.tiering.policy.runner import PolicyRunner

TIERS = ["nvme", "lustre", "s3"]
BACKLOG = {
    "export": [{"to": "lustre", "every_saves": 1}],
    "retention": {"nvme": {"keep_latest": 2}, "lustre": {"keep_latest": 2}},
}


def ck(step):
    return Checkpoint("run", step, step, float(step), 10, 1)


def cp(step, tier, st=PRESENT):
    return Copy("run", step, tier, st, 10, float(step), float(step), None, 1.0)


def test_older_pending_exports_the_destination_would_not_keep_are_superseded():
    p = pol.from_dict(BACKLOG, tiers=TIERS)
    s = pol.State(
        checkpoints=[ck(i) for i in range(1, 7)], copies=[cp(i, "nvme") for i in range(1, 7)]
    )
    actions = pol.plan(p, s)
    sup = [a for a in actions if isinstance(a, pol.Supersede)]
    exp = [a for a in actions if isinstance(a, pol.Export)]
    assert [(a.step, a.source, a.dest) for a in sup] == [(i, "nvme", "lustre") for i in range(1, 5)]
    assert [a.step for a in exp] == [6, 5]  # the newest first
    # Once superseded, the older checkpoints are wanted nowhere: nvme drops them.
    dels = [a for a in actions if isinstance(a, pol.Delete)]
    assert sorted(d.step for d in dels) == [1, 2, 3, 4]


def test_a_checkpoint_the_destination_keeps_is_never_superseded():
    p = pol.from_dict(
        {
            "export": [{"to": "lustre", "every_saves": 1}],
            "retention": {"lustre": {"keep_latest": 1, "keep_every": 3}},
        },
        tiers=TIERS,
    )
    s = pol.State(
        checkpoints=[ck(i) for i in range(1, 5)], copies=[cp(i, "nvme") for i in range(1, 5)]
    )
    sup = sorted(a.step for a in pol.plan(p, s) if isinstance(a, pol.Supersede))
    assert sup == [1, 2]  # 3: every 3rd step; 4: the latest


def test_a_newer_checkpoint_still_being_written_supersedes_nothing():
    p = pol.from_dict(
        {
            "export": [{"to": "lustre", "every_saves": 1}],
            "retention": {"lustre": {"keep_latest": 1}},
        },
        tiers=TIERS,
    )
    s = pol.State(checkpoints=[ck(1), ck(2)], copies=[cp(1, "nvme"), cp(2, "nvme", WRITING)])
    assert not [a for a in pol.plan(p, s) if isinstance(a, pol.Supersede)]


def test_without_a_retention_table_on_the_destination_every_export_is_made():
    p = pol.from_dict({"export": [{"to": "lustre", "every_saves": 1}]}, tiers=TIERS)
    s = pol.State(
        checkpoints=[ck(i) for i in range(1, 5)], copies=[cp(i, "nvme") for i in range(1, 5)]
    )
    assert not [a for a in pol.plan(p, s) if isinstance(a, pol.Supersede)]


def superseded_total(src: str, dst: str) -> float:
    v = REGISTRY.get_sample_value("fmstore_tier_exports_superseded_total", {"src": src, "dst": dst})
    return v or 0.0


def test_saves_outpacing_exports_leave_a_bounded_source_and_the_newest_goes_first(tmp_path, caplog):
    cfg = posix_config(str(tmp_path), BACKLOG, tiers=("nvme", "lustre"))
    # 12 saves while no export ran (a slow destination, a loaded node).
    run_saves(cfg, "run", range(1, 13), settle_each=False)
    assert len(held(cfg, "nvme", "run")) == 12
    before = superseded_total("nvme", "lustre")
    with Catalog.for_state_dir(cfg.state_dir) as catalog:
        runner = PolicyRunner(cfg, pol.from_config(cfg), catalog)
        lag = {(g.root, g.dest): g for g in pol.export_lags(runner.policies, runner.state())}
        # Counted after coalescing: the exports that will really be made.
        assert lag[("run", "lustre")].pending == 2
        assert lag[("run", "lustre")].oldest_pending_step == 11
        assert lag[("run", "lustre")].newest_step is None
        with caplog.at_level(logging.INFO, logger="fmstore.tiering"):
            settle(runner)
        states = {c.step: c.state for c in catalog.copies("run", tier="lustre")}
        lag = {(g.root, g.dest): g for g in pol.export_lags(runner.policies, runner.state())}
    assert [s for s in range(1, 11) if states[s] == "superseded"] == list(range(1, 11))
    assert superseded_total("nvme", "lustre") - before == 10
    started = [
        r.fields["step"] for r in caplog.records if getattr(r, "event", "") == "export_start"
    ]
    assert started[0] == 12
    assert held(cfg, "lustre", "run") == [11, 12]
    assert held(cfg, "nvme", "run") == [11, 12]
    assert lag[("run", "lustre")].pending == 0 and lag[("run", "lustre")].newest_step == 12


def test_ckpt_list_shows_the_export_lag(tmp_path, capsys, monkeypatch):
    from fmstore.cli.main import main

    cfg: Config = posix_config(str(tmp_path), BACKLOG, tiers=("nvme", "lustre"))
    run_saves(cfg, "run", range(1, 4), settle_each=False)
    toml = tmp_path / "fmstore.toml"
    toml.write_text(
        f'state_dir = "{tmp_path}/state"\n[tiers.nvme]\nurl = "{tmp_path}/nvme"\n'
        f'[tiers.lustre]\nurl = "{tmp_path}/lustre"\n[[policies.export]]\nto = "lustre"\n'
        "every_saves = 1\n[policies.retention.lustre]\nkeep_latest = 2\n"
    )
    capsys.readouterr()
    try:
        main(["ckpt", "list", "run", "--config", str(toml)])
    except SystemExit as e:
        assert not e.code
    out = " ".join(capsys.readouterr().out.split())
    assert "lag run → lustre: 2 pending, oldest step 2" in out
    assert "newest step none" in out


def test_a_copy_another_export_is_made_from_is_never_superseded():
    p = pol.from_dict(
        {
            "export": [
                {"to": "lustre", "every_saves": 1},
                {"to": "s3", "every_saves": 2, "from": "lustre"},
            ],
            "retention": {"lustre": {"keep_latest": 1}},
        },
        tiers=TIERS,
    )
    s = pol.State(
        checkpoints=[ck(i) for i in range(1, 5)], copies=[cp(i, "nvme") for i in range(1, 5)]
    )
    sup = sorted(a.step for a in pol.plan(p, s) if isinstance(a, pol.Supersede))
    assert sup == [1, 3]  # 2 must reach lustre: s3 takes it from there


def queue_depth(action: str) -> float | None:
    return REGISTRY.get_sample_value("fmstore_tier_queue_depth", {"action": action})


def test_queue_gauges_after_a_step_show_what_is_left_not_what_it_began_with(tmp_path):
    policies = {
        "export": [{"to": "lustre", "every_saves": 1}],
        "retention": {"nvme": {"keep_latest": 2}},
    }
    cfg = posix_config(str(tmp_path), policies, tiers=("nvme", "lustre"))
    run_saves(cfg, "run", range(1, 5), settle_each=False)
    with Catalog.for_state_dir(cfg.state_dir) as catalog:
        runner = PolicyRunner(cfg, pol.from_config(cfg), catalog)
        # nvme keeps its oldest two until they are on lustre: the first step only exports.
        rep = runner.step(blocking_lock=True)
        assert not rep.errors and held(cfg, "lustre", "run") == [1, 2, 3, 4]
        assert held(cfg, "nvme", "run") == [1, 2, 3, 4]
        assert (queue_depth("export"), queue_depth("delete")) == (0, 2)
        settle(runner)
        assert held(cfg, "nvme", "run") == [3, 4]
        assert (queue_depth("export"), queue_depth("delete")) == (0, 0)
