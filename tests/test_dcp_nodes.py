"""Sharded checkpoints of a job of two nodes on node-local NVMe, on real nodes.

Each node is a ``torchrun`` agent on loopback started by the project's harness
(:class:`fmstore.testing.cluster.Cluster`: ``--nnodes=2 --nproc-per-node=2``, c10d rendezvous
on a store the harness owns, so killing a node never takes the rendezvous with it), with its
own ``FMSTORE_CONFIG`` (its own ``nvme`` directory, ``scope = "node"``, and state directory)
and ``FMSTORE_NODE_ID``; the ``lustre`` directory is shared.  One launch after another
(tests/node_worker.py): save and restore; a node killed mid-save; then one relaunch (a start
of the job costs more than its work) for the job falling back and saving again, a replaced
node (wiped while the relaunch waits on the test's signal) and the sharded manager falling
back from it and redoing a step; a restore on fewer ranks from the shared tier.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sharded_support import equal_trees

from fmstore.checkpoint.dcp.api import load_full_state_dict
from fmstore.checkpoint.gc import gc
from fmstore.testing.cluster import PG_TIMEOUT_ENV, Cluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "node_worker.py")
STEP = "run/step_{:012d}"


def run(
    cluster: Cluster, scenario: str, nodes: list[str], timeout: float = 300
) -> list[dict[str, Any]]:
    """One launch of ``scenario`` (or of several, ``a,b``: the last one's reports) on
    ``nodes``; every rank's report."""
    rcs = cluster.run(WORKER, [scenario, str(cluster.out)], nodes, name=scenario, timeout=timeout)
    assert rcs == [0] * len(nodes), cluster.logs(scenario, nodes)
    for node in nodes:  # an agent that exited left no rank behind
        assert not cluster.live(node, "job"), node
    return reports(cluster, scenario.split(",")[-1], nodes)


def reports(cluster: Cluster, scenario: str, nodes: list[str]) -> list[dict[str, Any]]:
    """Every rank's report of ``scenario``."""
    return [
        json.loads((cluster.out / f"{scenario}-{r}.json").read_text())
        for r in range(cluster.nproc * len(nodes))
    ]


def _wait_for(path: Path, procs: list[Any], timeout: float) -> None:
    """Until ``path`` exists (the event), or fail when every agent already exited."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert any(p.poll() is None for p in procs), "every node exited before the event"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("nodes"), nproc=2) as c:
        c.saved = run(c, "save", ["n0", "n1"])  # type: ignore[attr-defined]
        yield c
    assert not c.live(), "a process of the nodes outlived the cluster"


def test_two_nodes_save_commit_and_restore_bit_exact_from_their_nvme(cluster):
    reps = cluster.saved
    # n0 was started first and holds ranks 0-1; the worker checked the restore bit-exact.
    assert [r["node"] for r in reps] == ["n0", "n0", "n1", "n1"]
    assert all(r["used"] == "nvme:" + STEP.format(10) for r in reps)
    # Each node's own NVMe holds the manifest and its part; nothing of the other's.
    for node, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
        ck = cluster.nvme(node) / STEP.format(10)
        assert (ck / "manifest.json").is_file()
        m = json.loads((ck / "manifest.json").read_text())
        assert m["version"] == 2
        assert [p["node"] for p in m["parts"]] == ["n0", "n1"]
        gen = ck / m["generation"]
        on_disk = {p.name for p in gen.iterdir() if p.suffix == ".bin"}
        mine = {b["name"] for b in m["blobs"] if b["rank"] in ranks}
        assert on_disk == mine
        assert {p.name for p in gen.glob("rank-*.json")} == {f"rank-{r:06d}.json" for r in ranks}
    # DCP put the replicated values on rank 0 alone; n1's part holds its own copy.
    assert all(r["local_rep"] for r in reps)
    # A bare dcp.save with a Writer onto the node-local tier is refused, naming the way.
    assert all("fmstore.checkpoint.dcp.save" in r["bare"] for r in reps)
    assert not (cluster.nvme("n0") / STEP.format(11) / "manifest.json").exists()
    # Both parts put side by side (what a shared tier will hold): one process reads the
    # whole state from them, bit-exact.
    whole = cluster.base / "whole"
    shutil.copytree(cluster.nvme("n0") / STEP.format(10), whole)
    shutil.copytree(cluster.nvme("n1") / STEP.format(10), whole, dirs_exist_ok=True)
    full = load_full_state_dict(str(whole))
    ref = torch.load(cluster.out / "ref-10.pt", weights_only=False)
    equal_trees(full["model"], ref["model"])
    equal_trees(full["optim"], ref["optim"])
    equal_trees(full["extra"], ref["extra"])
    # gc with no grace keeps every part of the committed checkpoint on each node.
    for node in ("n0", "n1"):
        rep = gc(str(cluster.nvme(node)), older_than=0, dry_run=True)
        assert not [k for k in rep.removed if STEP.format(10) in k]


def fmstore_cli(cluster: Cluster, node: str, *args: str) -> subprocess.CompletedProcess[str]:
    return cluster.fmstore(node, *args)


def test_ckpt_list_and_verify_show_and_check_this_nodes_part(cluster):
    uri = "nvme:" + STEP.format(10)
    res = fmstore_cli(cluster, "n1", "ckpt", "verify", uri)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "the part of node n1" in res.stdout
    res = fmstore_cli(cluster, "n1", "ckpt", "list", "run", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    (row,) = [r for r in json.loads(res.stdout) if r["step"] == 10]
    part = row["tiers"]["nvme"]["part"]
    assert {k: part[k] for k in ("index", "of", "node")} == {"index": 2, "of": 2, "node": "n1"}
    # n1's own bytes: its blobs on its NVMe, not the whole checkpoint
    ck = cluster.nvme("n1") / STEP.format(10)
    gen = json.loads((ck / "manifest.json").read_text())["generation"]
    assert part["bytes"] == sum(p.stat().st_size for p in (ck / gen).glob("*.bin"))
    assert "part" not in row["tiers"]["lustre"]
    # Every tier of the run: n1's part on its NVMe, the whole checkpoint on Lustre.
    res = fmstore_cli(cluster, "n1", "ckpt", "verify", "--all-tiers", "run")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 bad" in res.stdout, res.stdout
    # A flipped byte in one of n1's blobs: verify on n1 names it and exits 1.
    ck = cluster.nvme("n1") / STEP.format(10)
    m = json.loads((ck / "manifest.json").read_text())
    blob = ck / m["generation"] / next(b["name"] for b in m["blobs"] if b["rank"] == 2)
    data = bytearray(blob.read_bytes())
    data[0] ^= 0xFF
    try:
        blob.write_bytes(bytes(data))
        res = fmstore_cli(cluster, "n1", "ckpt", "verify", uri)
        assert res.returncode == 1 and blob.name in res.stdout, res.stdout + res.stderr
    finally:
        data[0] ^= 0xFF
        blob.write_bytes(bytes(data))


def test_sharded_manager_saves_async_and_restores_on_nvme_and_on_a_shared_write_tier(cluster):
    # The worker checked each restore bit-exact against the state staged by save().
    for r in cluster.saved:
        assert r["mgr"] == [40, 40, 40, "nvme"]
        assert r["mgr2"] == [50, 50, 50, "lustre"]
    m = json.loads((cluster.nvme("n1") / "mgr" / f"step_{40:012d}" / "manifest.json").read_text())
    assert [p["node"] for p in m["parts"]] == ["n0", "n1"]
    m2 = json.loads((cluster.lustre / "mgr2" / f"step_{50:012d}" / "manifest.json").read_text())
    assert m2["version"] == 1 and "parts" not in m2


def test_node_killed_mid_save_commits_nothing_and_the_relaunch_falls_back_and_saves(cluster):
    procs = cluster.start(
        WORKER, ["kill", str(cluster.out)], ["n0", "n1"], name="kill", env={PG_TIMEOUT_ENV: "20"}
    )
    try:
        _wait_for(cluster.out / "blocked", procs, timeout=300)
        victim = (cluster.out / "blocked").read_text()
        assert victim == "n1"
        cluster.kill("n1")  # SIGKILL of n1's agent and of its ranks, in their own sessions
        assert not cluster.live("n1"), "a rank of the killed node still runs"
        # n0's ranks give up at their group's timeout (seconds, not gloo's 30 minutes).
        procs[0].wait(timeout=240)
        assert procs[0].returncode != 0
    finally:
        cluster.kill("n0")
        cluster.kill("n1")
    step20 = STEP.format(20)
    for node in ("n0", "n1"):
        assert not (cluster.nvme(node) / step20 / "manifest.json").exists()
    # What n0's ranks wrote is a pending part: no sweep's age rule removes it, neither the
    # daemon's sweep (fmstore gc) nor fmstore ckpt gc, with no grace at all.
    records = sorted((cluster.nvme("n0") / step20).glob("g*/rank-*.json"))
    assert records
    blobs = sorted((cluster.nvme("n0") / step20).glob("g*/*.bin"))
    res = fmstore_cli(cluster, "n0", "gc", "nvme:", "--older-than", "0")
    assert res.returncode == 0, res.stdout + res.stderr
    res = fmstore_cli(cluster, "n0", "ckpt", "gc", "nvme:run", "--older-than", "0")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "pending part" in res.stdout + res.stderr
    assert sorted((cluster.nvme("n0") / step20).glob("g*/rank-*.json")) == records
    assert sorted((cluster.nvme("n0") / step20).glob("g*/*.bin")) == blobs
    # A flipped byte in n1's part of step 10: rank 2's read fails its checksum.
    ck = cluster.nvme("n1") / STEP.format(10)
    m = json.loads((ck / "manifest.json").read_text())
    blob = ck / m["generation"] / next(b["name"] for b in m["blobs"] if b["rank"] == 2)
    data = bytearray(blob.read_bytes())
    data[0] ^= 0xFF
    blob.write_bytes(bytes(data))
    # One launch for this test's resume and the next two tests' scenarios: it pauses
    # after the resume while the next test replaces n1 (one start of the job fewer).
    procs = cluster.start(
        WORKER,
        ["resume,pause,replaced,redo", str(cluster.out)],
        ["n0", "n1"],
        name="relaunch",
        env={"NODE_WORKER_TEST_PORT": str(cluster.port)},
    )
    cluster.relaunch = procs  # type: ignore[attr-defined]
    _wait_paused(cluster, procs)
    reps = reports(cluster, "resume", ["n0", "n1"])
    # Step 20 was never committed, and n1 cannot read step 10 from its NVMe: every rank
    # fell back together to step 10 on Lustre (bit-exact, checked by the worker); step 20's
    # pending parts are gone, and step 30 saved and restored.
    assert all(r["used"] == "lustre:" + STEP.format(10) for r in reps)
    assert all(r["used30"] == "nvme:" + STEP.format(30) for r in reps)
    assert not list((cluster.nvme("n0") / step20).glob("g*/rank-*.json"))
    for node in ("n0", "n1"):
        assert (cluster.nvme(node) / STEP.format(30) / "manifest.json").is_file()


def _wait_paused(cluster: Cluster, procs: list[Any], timeout: float = 300) -> None:
    """Until every rank of the relaunch waits at its pause (the event)."""
    keys = [f"nodes/paused-{r}" for r in range(4)]
    deadline = time.monotonic() + timeout
    while not cluster.store.check(keys):
        assert all(p.poll() is None for p in procs), cluster.logs("relaunch", ["n0", "n1"])
        assert time.monotonic() < deadline, "the relaunch never paused"
        time.sleep(0.1)


def test_replaced_node_gets_an_error_naming_its_missing_part(cluster):
    procs = getattr(cluster, "relaunch", None)
    if procs is None or not (cluster.nvme("n1") / STEP.format(30) / "manifest.json").is_file():
        pytest.skip("needs the relaunched job's step 30")
    # n1 replaced while the relaunch waits: its NVMe and state directory wiped.
    shutil.rmtree(cluster.nvme("n1"))
    shutil.rmtree(cluster.base / "n1" / "state", ignore_errors=True)
    # The same launch then runs the next test's scenario: the replaced node's restore
    # fails first, as it must before any fallback.
    cluster.store.set("nodes/go", "1")
    rcs = [p.wait(timeout=300) for p in procs]
    assert rcs == [0, 0], cluster.logs("relaunch", ["n0", "n1"])
    for node in ("n0", "n1"):  # an agent that exited left no rank behind
        assert not cluster.live(node, "job"), node
    reps = reports(cluster, "replaced", ["n0", "n1"])
    errors = {r["error"] for r in reps}
    assert len(errors) == 1, errors  # the same answer on every rank
    (err,) = errors
    assert err.startswith("CandidatesFailed"), err  # a NotFound
    assert "node n1 lacks its part" in err and STEP.format(30) in err, err


def test_a_fallback_moves_the_newer_steps_aside_and_their_redo_saves(cluster):
    if not (cluster.out / "redo-0.json").is_file():
        pytest.skip("needs the replaced node's launch, which runs this scenario too")
    reps = reports(cluster, "redo", ["n0", "n1"])
    for r in reps:  # each restore checked bit-exact by the worker
        restored, tier, moved = r["restored"]
        assert (restored, tier) == (10, "lustre") and 30 in moved and min(moved) > 10
        assert r["redone"] == [30, "nvme"]
    aside = list((cluster.nvme("n0") / ".aside").glob("*/run/step_000000000030/manifest.json"))
    assert len(aside) == 1
    for node in ("n0", "n1"):
        assert (cluster.nvme(node) / STEP.format(30) / "manifest.json").is_file()


def test_four_rank_checkpoint_restores_on_two_ranks_from_the_shared_tier(cluster):
    reps = run(cluster, "reshard", ["n0"])
    # nvme's parts were saved by 4 ranks: not used; lustre's copy is resharded by DCP.
    assert all(r["used"] == "lustre:" + STEP.format(10) for r in reps)
