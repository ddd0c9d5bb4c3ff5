"""Checkpoints on the tiers under names fmstore does not count: each is reported with why
(by the scan, ``ckpt list``, ``daemon --check`` and one daemon warning per root), the report
is bounded, and a run root that declares its step pattern gets its steps counted and
tiered."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tiering_helpers import state

import fmstore
from fmstore import CheckpointManager, runtime
from fmstore.config import from_dict, load_config
from fmstore.errors import ConfigError
from fmstore.keys import StepPattern
from fmstore.tiering.inventory import foreign
from fmstore.tiering.inventory.catalog import Catalog
from fmstore.tiering.inventory.discovery import Rediscovered, rediscover
from fmstore.tiering.managers.sharded import ShardedCheckpointManager
from fmstore.tiering.service.daemon import Daemon, DaemonSettings
from fmstore.tiering.tiers import Tiers

POLICIES = {
    "export": [{"to": "lustre", "every_saves": 1}],
    "retention": {"nvme": {"keep_latest": 1}},
}


def config(base, runs=None, policies=POLICIES):
    data = {
        "tiers": {t: {"url": os.path.join(base, t)} for t in ("nvme", "lustre")},
        "state_dir": os.path.join(base, "state"),
        "policies": policies,
    }
    if runs is not None:
        data["runs"] = runs
    return from_dict(data)


def toml(tmp_path, runs: str = "") -> str:
    p = tmp_path / "fmstore.toml"
    p.write_text(
        f'state_dir = "{tmp_path}/state"\n[tiers.nvme]\nurl = "{tmp_path}/nvme"\n'
        f'[tiers.lustre]\nurl = "{tmp_path}/lustre"\n'
        '[[policies.export]]\nto = "lustre"\nevery_saves = 1\n' + runs
    )
    return str(p)


def scan(cfg, roots=None) -> Rediscovered:
    tiers = Tiers(cfg)

    async def go() -> Rediscovered:
        try:
            with Catalog.for_state_dir(cfg.state_dir) as c:
                return await rediscover(c, tiers, ["nvme", "lustre"], roots)
        finally:
            await tiers.close()

    return runtime.run(go())


def native_dcp(path: str) -> None:
    """torch's own files (``.metadata`` + ``__0_0.distcp``), as a stack writes them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.arange(8.0)}, checkpoint_id=path)
    assert os.path.isfile(os.path.join(path, ".metadata"))


def cli(capsys, *args: str) -> tuple[int, str, str]:
    from fmstore.cli.main import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def foreign_tiers(nvme: str) -> dict[str, str]:
    """Every kind of checkpoint fmstore does not count, written by the real writers;
    URL -> the words its reason must hold."""
    st = state(1, n=16)
    fmstore.save(st, f"{nvme}/runs/tt/step-4")  # an fmstore checkpoint under torchtitan's name
    native_dcp(f"{nvme}/runs/titan/step-7")  # torchtitan through fmstore:// (native files)
    native_dcp(f"{nvme}/runs/a/step_000000000009")  # native files under fmstore's own name
    native_dcp(f"{nvme}/runs/pl/epoch=1-step=4.ckpt")  # Lightning's sharded checkpoint
    os.makedirs(f"{nvme}/runs/hf/checkpoint-500")  # what the HF Trainer writes
    torch.save(st, f"{nvme}/runs/hf/checkpoint-500/optimizer.pt")
    os.makedirs(f"{nvme}/runs/lt")
    torch.save(st, f"{nvme}/runs/lt/epoch=1-step=4.ckpt")  # Lightning's single file
    os.makedirs(f"{nvme}/models")
    torch.save(st, f"{nvme}/models/final.pt")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, f"{nvme}/models/model.safetensors")
    fmstore.save(st, f"{nvme}/runs/a/final")  # fmstore's, under a name with no step
    fmstore.save(st, f"{nvme}/runs/a/step_000000000001")  # the ones that count
    # a run root below a stack's name; a stray marker beside steps hides none of them
    fmstore.save(st, f"{nvme}/sweep/checkpoint-1/run/step_000000000002")
    open(f"{nvme}/runs/a/.metadata", "wb").close()
    dcp_why = "a native DCP checkpoint (.metadata), not an fmstore one: never tiered"
    return {
        "nvme:runs/tt/step-4": "named 'step-4', not step_NNNNNNNNNNNN: declare step_pattern = "
        '"step-{step}" for this run root ([runs."runs/tt"] in fmstore.toml) to tier it',
        "nvme:runs/titan/step-7": dcp_why,
        "nvme:runs/a/step_000000000009": dcp_why,
        "nvme:runs/pl/epoch=1-step=4.ckpt": dcp_why,
        "nvme:runs/hf/checkpoint-500": "Hugging Face Trainer's checkpoints, holding neither "
        "manifest.json nor .metadata",
        "nvme:runs/lt/epoch=1-step=4.ckpt": "a Lightning checkpoint file (torch.save)",
        "nvme:models/final.pt": "a bare torch.save file, not an fmstore checkpoint",
        "nvme:models/model.safetensors": "a bare safetensors file, not an fmstore checkpoint",
        "nvme:runs/a/final": "an fmstore checkpoint named 'final', not step_NNNNNNNNNNNN",
    }


def test_each_foreign_kind_is_reported_with_its_reason_and_never_counted(tmp_path, capsys):
    cfg = config(str(tmp_path))
    want = foreign_tiers(str(tmp_path / "nvme"))
    rep = scan(cfg)
    assert rep.roots == ["runs/a", "sweep/checkpoint-1/run"] and rep.checkpoints == 2
    assert set(rep.not_counted) == set(want), rep.not_counted
    for url, words in want.items():
        assert words in rep.not_counted[url], (url, rep.not_counted[url])
    assert "save it through fmstore.checkpoint.dcp" in rep.not_counted["nvme:runs/titan/step-7"]
    assert rep.not_counted_more == {}
    with Catalog.for_state_dir(cfg.state_dir) as c:
        assert sorted(c.roots()) == ["runs/a", "sweep/checkpoint-1/run"]
        assert [k.step for k in c.checkpoints("runs/a")] == [1]

    # a scan of one root (a manager's, `ckpt list ROOT`) says the same of that root
    assert scan(cfg, ["runs/tt"]).not_counted == {
        "nvme:runs/tt/step-4": rep.not_counted["nvme:runs/tt/step-4"]
    }

    # the commands say it too
    cfg_file = toml(tmp_path)
    code, out, err = cli(capsys, "ckpt", "list", "--config", cfg_file)
    assert code == 0, err
    assert "not counted: nvme:runs/tt: 1 entry not counted as checkpoints" in out
    flat = " ".join(out.split())
    assert "nvme:runs/titan/step-7: a native DCP checkpoint (.metadata)" in flat
    assert "nvme:runs/a/step_000000000009: a native DCP checkpoint (.metadata)" in flat
    code, out, err = cli(capsys, "ckpt", "list", "runs/tt", "--config", cfg_file)
    assert code != 0 and "no checkpoint of run root 'runs/tt'" in err
    assert 'declare step_pattern = "step-{step}"' in " ".join(err.split())
    code, out, err = cli(capsys, "daemon", "--check", "--config", cfg_file)
    assert code == 0 and out.startswith("ok: tiers"), err
    lines = [line for line in err.splitlines() if line.startswith("warning: ")]
    # one per prefix: runs/{tt,titan,a,pl,hf,lt}, models; listings only, no manifest read,
    # so the native files under a step_… name are the start-up scan's to find
    assert len(lines) == 7, lines
    assert any("nvme:runs/a/final: an fmstore checkpoint named 'final'" in x for x in lines)
    assert not any("step_000000000009" in line for line in lines)


def test_the_report_is_bounded_listed_per_root_and_counted_beyond(tmp_path, caplog):
    cfg = config(str(tmp_path))
    many = tmp_path / "nvme" / "runs" / "many"
    for i in range(3000):
        os.makedirs(many / f"step-{i}")
    for i in range(2000):
        (many / f"shard-{i}.pt").touch()
    for i in range(60):  # more prefixes than are listed
        os.makedirs(tmp_path / "nvme" / "spread" / f"r{i:02d}")
        (tmp_path / "nvme" / "spread" / f"r{i:02d}" / "m.pt").touch()
    rep = scan(cfg)
    assert len(rep.notes.by_root) == foreign.MAX_ROOTS
    listed = rep.notes.by_root["nvme:runs/many"]
    assert len(listed) == foreign.PER_ROOT
    assert rep.not_counted_more["nvme:runs/many"] == 5000 - foreign.PER_ROOT
    assert rep.not_counted_more["nvme:"] == 61 - foreign.MAX_ROOTS  # beyond: by tier
    assert len(rep.not_counted) == foreign.PER_ROOT + foreign.MAX_ROOTS - 1

    d = Daemon(cfg, settings=DaemonSettings(port=0))
    try:
        with caplog.at_level(logging.WARNING, logger="fmstore.tiering"):
            d.rescan()
    finally:
        d.close()
    lines = [r for r in caplog.records if getattr(r, "event", "") == "not_counted"]
    assert len(lines) == foreign.MAX_ROOTS + 1
    mine = next(r for r in lines if r.fields["root"] == "nvme:runs/many")
    assert mine.levelno == logging.WARNING and mine.fields["more"] == 4990
    assert "; and 4990 more not listed" in mine.getMessage()
    assert max(len(r.getMessage()) for r in lines) < 400 * foreign.PER_ROOT


def test_the_daemon_warns_once_per_root_per_run(tmp_path, caplog):
    cfg = config(str(tmp_path))
    native_dcp(str(tmp_path / "nvme" / "runs" / "titan" / "step-7"))
    fmstore.save(state(2, n=16), str(tmp_path / "nvme" / "runs" / "tt" / "step-4"))
    d = Daemon(cfg, settings=DaemonSettings(port=0))
    try:
        with caplog.at_level(logging.INFO, logger="fmstore.tiering"):
            d.rescan()
            d.rescan()  # a rescan (a tier came back) says nothing new about them
    finally:
        d.close()
    warned = [r for r in caplog.records if getattr(r, "event", "") == "not_counted"]
    assert sorted(r.fields["root"] for r in warned) == ["nvme:runs/titan", "nvme:runs/tt"]
    assert all(r.levelno == logging.WARNING for r in warned)
    scans = [r for r in caplog.records if getattr(r, "event", "") == "rediscovered"]
    assert len(scans) == 2 and "nvme:runs/titan/step-7" in scans[0].fields["not_counted"]


def test_a_declared_step_pattern_counts_exports_and_retains_those_steps(tmp_path):
    runs = {"runs/tt": {"step_pattern": "step-{step}"}}
    cfg = config(str(tmp_path), runs)
    nvme = tmp_path / "nvme" / "runs" / "tt"
    for s in (4, 8):  # committed fmstore checkpoints under torchtitan's names
        fmstore.save(state(s, n=16), str(nvme / f"step-{s}"))
    native_dcp(str(nvme / "step-16"))  # native files under a declared name: reported, not tiered
    fmstore.save(state(3, n=16), str(nvme / "step_000000000003"))  # not this root's name now
    rep = scan(cfg)
    assert rep.roots == ["runs/tt"] and rep.checkpoints == 2
    assert "a native DCP checkpoint" in rep.not_counted["nvme:runs/tt/step-16"]
    assert (
        "not 'step-{step}' (the step_pattern run root 'runs/tt' declares)"
        in (rep.not_counted["nvme:runs/tt/step_000000000003"])
    )

    # a manager on the root names its steps by the pattern too
    with CheckpointManager("runs/tt", config=cfg, run_policies=False, async_save=False) as m:
        m.save(12, state(12, n=16))
        assert m.latest_step() == 12
    assert (nvme / "step-12" / "manifest.json").is_file()

    d = Daemon(cfg, settings=DaemonSettings(port=0, interval=0.05))
    try:
        assert d.run(drain=True, timeout=120) == 0
    finally:
        d.close()
    lustre = tmp_path / "lustre" / "runs" / "tt"
    assert sorted(os.listdir(lustre)) == ["step-12", "step-4", "step-8"]
    got = fmstore.load(str(lustre / "step-8"))
    assert torch.equal(got["model"]["w"], state(8, n=16)["model"]["w"])
    # nvme keeps its latest only; what fmstore does not count is left alone
    assert sorted(os.listdir(nvme)) == ["step-12", "step-16", "step_000000000003"]
    with Catalog.for_state_dir(cfg.state_dir) as c:
        assert [k.step for k in c.checkpoints("runs/tt")] == [4, 8, 12]


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("step", "holds no {step} field"),
        ("{step}-{step}", "holds 2 {step} fields"),
        ("step-{n}", "'{n}' in 'step-{n}' is not a step field"),
        ("step-{step:x}", "is not a step field"),
        ("a/step-{step}", "holds '/'"),
        ("..step-{step}", "holds '..'"),
        (".step-{step}", "starts with '.'"),
        ("step-*{step}", "the glob character '*'"),
        ("step[{step}]", "the glob character '['"),
        ("step-{step}}", "holds '}' outside its {step} field"),
        (7, "must be a string"),
    ],
)
def test_a_bad_step_pattern_is_refused_with_why(tmp_path, pattern, words):
    with pytest.raises(ConfigError) as e:
        config(str(tmp_path), {"runs/tt": {"step_pattern": pattern}})
    assert "runs" in str(e.value) and words in str(e.value)


def test_bad_run_roots_are_refused_and_a_file_names_the_line(tmp_path):
    for root, words in [("../x", "is not a run root"), ("", "names the tier's top")]:
        with pytest.raises(ConfigError, match="runs") as e:
            config(str(tmp_path), {root: {"step_pattern": "s{step}"}})
        assert words in str(e.value)
    with pytest.raises(ConfigError, match="names 'runs/a' twice"):
        config(str(tmp_path), {"runs/a": {}, "runs/a/": {}})
    cfg_file = toml(tmp_path, '[runs."runs/tt"]\nstep_pattern = "step-{step}/x"\n')
    with pytest.raises(ConfigError) as e:
        load_config(cfg_file)
    assert f'{cfg_file}, line 10: [runs."runs/tt"] step_pattern:' in str(e.value)
    with pytest.raises(ConfigError, match="unknown key 'pattern'"):
        config(str(tmp_path), {"runs/tt": {"pattern": "step-{step}"}})


def test_the_sharded_manager_refuses_a_root_with_a_declared_pattern(tmp_path):
    cfg = config(str(tmp_path), {"runs/tt": {"step_pattern": "step-{step}"}})
    with pytest.raises(ConfigError, match="ShardedCheckpointManager names its steps step_"):
        ShardedCheckpointManager("runs/tt", config=cfg)


def test_step_patterns_round_trip_one_name_per_step():
    p = StepPattern("iter_{step:07d}")
    assert p.name(4) == "iter_0000004" and p.step("iter_0000004") == 4
    assert p.step("iter_12345678") == 12345678 and p.step("iter_004") is None
    q = StepPattern("step-{step}")
    assert [q.step(n) for n in ("step-4", "step-04", "step-", "step-4x", "step-٤")] == [
        4,
        None,
        None,
        None,
        None,
    ]
    assert foreign.suggest_pattern("checkpoint-500") == "checkpoint-{step}"
    assert foreign.suggest_pattern("final") is None
