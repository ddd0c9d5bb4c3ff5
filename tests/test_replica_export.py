"""A lost node's part exported from its replica (issue 46, point 2): two ranks, each its own
node (gloo, processes spawned by the test), save a step with replicas; n0's runner exports
its part to Lustre, where the step waits for n1's; n1 is lost.  Once the step has waited
``[policies] replica_export_after`` and n1 holds no live export lease, n0's runner exports
n1's part from its replica and the step commits without n1."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from gloo_ranks import run

from fmstore.protocol.decisions import replica_export_due

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

KEY = f"run/step_{10:012d}"


def test_replica_export_waits_for_the_delay_and_a_dead_lease():
    due = dict(committed=False, now=1000.0, after=600.0, ttl=60.0, skew=30.0)
    assert replica_export_due("n1", {"n0": 300.0}, {}, **due)
    assert not replica_export_due("n1", {"n0": 500.0}, {}, **due)  # waited 500 s only
    assert not replica_export_due("n1", {"n0": 300.0, "n1": 900.0}, {}, **due)  # n1's is there
    assert not replica_export_due("n1", {}, {}, **due)  # nobody waits for it
    assert not replica_export_due("n1", {"n0": 300.0}, {"n1": 950.0}, **due)  # n1 exports
    assert replica_export_due("n1", {"n0": 300.0}, {"n1": 800.0}, **due)  # its lease is dead
    assert not replica_export_due("n1", {"n0": 300.0}, {}, **{**due, "committed": True})


def config_text(tmp: str, node: str, after: str) -> str:
    return (
        f'state_dir = "{tmp}/{node}/state"\n'
        f'[tiers.nvme]\nurl = "{tmp}/{node}/nvme"\nscope = "node"\nreplicas = 1\n'
        f'[tiers.lustre]\nurl = "{tmp}/lustre"\n'
        f'[policies]\nladder = ["nvme", "lustre"]\nwrite_tier = "nvme"\n'
        f'replica_export_after = "{after}"\n'
        '[[policies.export]]\nto = "lustre"\nevery_saves = 1\n'
    )


def save(rank: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from fmstore import ShardedCheckpointManager

    pg = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(rank)
    state = {"w": torch.randn(4096, generator=g), "step": 10}
    with ShardedCheckpointManager("run", process_group=pg, config=f"{tmp}/n{rank}.toml") as m:
        m.save(10, state)


def step(cfg: str) -> None:
    from fmstore.config import load_config
    from fmstore.tiering.inventory.catalog import Catalog
    from fmstore.tiering.policy.policies import from_config
    from fmstore.tiering.policy.runner import PolicyRunner

    config = load_config(cfg)
    with Catalog.for_state_dir(config.state_dir) as c:
        PolicyRunner(config, from_config(config), c).step(blocking_lock=True)


def test_a_lost_nodes_part_is_exported_from_its_replica_and_the_step_commits(
    tmp_path, monkeypatch, caplog
):
    tmp = str(tmp_path)
    for node in ("n0", "n1"):
        Path(tmp, f"{node}.toml").write_text(config_text(tmp, node, "10m"))
    envs: list[dict[str, Any]] = [
        {"FMSTORE_NODE_ID": n, "FMSTORE_CONFIG": f"{tmp}/{n}.toml"} for n in ("n0", "n1")
    ]
    run(save, envs, tmp, init=str(tmp_path / "init"))
    lustre = Path(tmp, "lustre", KEY)
    n0 = f"{tmp}/n0.toml"
    monkeypatch.setenv("FMSTORE_NODE_ID", "n0")
    step(n0)  # n0 exports its own part: the step waits for n1's
    assert not (lustre / "manifest.json").exists()
    gen = json.loads(Path(tmp, "n0", "nvme", KEY, "manifest.json").read_text())["generation"]
    assert [p.name for p in (lustre / gen).glob("part-*.json")] == ["part-n0.json"]
    # n1 is lost.  Within replica_export_after nothing is exported in its place.
    step(n0)
    assert not (lustre / "manifest.json").exists()
    # The step has waited long enough (a config that waits 0 s), but n1's lease is alive.
    Path(n0).write_text(config_text(tmp, "n0", "0s"))
    from fmstore.protocol.records import ExportLease, lease_key

    lease = lustre / lease_key(gen, "n1")
    lease.write_bytes(ExportLease("n1", 1, time.time()).dumps())
    step(n0)
    assert not (lustre / "manifest.json").exists()
    # n1's lease is gone: n0 exports n1's part from its replica and the step commits.
    lease.unlink()
    caplog.set_level("INFO", logger="fmstore.tiering")
    step(n0)
    assert (lustre / "manifest.json").read_bytes() == (
        Path(tmp, "n0", "nvme", KEY, "manifest.json").read_bytes()
    )
    assert sorted(p.name for p in (lustre / gen).glob("part-*.json")) == [
        "part-n0.json",
        "part-n1.json",
    ]
    import fmstore.checkpoint.dcp as fdcp

    assert fdcp.verify_checkpoint(str(lustre)).ok
    # The export says why n1's part was missing: n1 saved nothing after this step that n0
    # holds a replica of (lost; a node whose ranks saved later steps is "daemon_not_exporting").
    done = [r for r in caplog.records if getattr(r, "event", None) == "replica_export_done"]
    assert [(r.fields["step"], r.fields["why"]) for r in done] == [(10, "node_lost")]
    assert "was lost" in done[0].getMessage() and "n1" in done[0].getMessage()
