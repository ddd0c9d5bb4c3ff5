"""Sharded checkpoints of a job of two nodes on node-local NVMe, on real nodes.

Each node is a ``torchrun`` agent on loopback (``--nnodes=2 --nproc-per-node=2``, c10d
rendezvous on a store this test owns, ``is_host=false`` agents, so killing a node never
takes the rendezvous with it), with its own ``FMSTORE_CONFIG`` (its own ``nvme`` directory,
``scope = "node"``, and state directory) and ``FMSTORE_NODE_ID``; the ``lustre`` directory
is shared.  One launch after another (tests/node_worker.py): save and restore; a node
killed mid-save; the relaunched job falling back and saving again; a replaced node; a
restore on fewer ranks from the shared tier.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_dcp import equal_trees

from fmstore.checkpoint.dcp.api import load_full_state_dict
from fmstore.checkpoint.gc import gc
from fmstore.testing.seaweed import free_ports

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "node_worker.py")
STEP = "run/step_{:012d}"


class Cluster:
    """Node directories, the rendezvous store, and ``torchrun`` agents started per launch."""

    def __init__(self, base: Path) -> None:
        import torch.distributed as dist

        self.base = base
        self.out = base / "out"
        self.out.mkdir()
        self.lustre = base / "lustre"
        self.port = free_ports(1)[0]
        self.store = dist.TCPStore(
            "127.0.0.1",
            self.port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=300),
        )
        self.launches = 0
        self.saved: list[dict[str, Any]] = []

    def nvme(self, node: str) -> Path:
        return self.base / node / "nvme"

    def config(self, node: str) -> Path:
        d = self.base / node
        d.mkdir(exist_ok=True)
        cfg = d / "fmstore.toml"
        cfg.write_text(
            f'state_dir = "{d / "state"}"\n'
            f'[tiers.nvme]\nurl = "{d / "nvme"}"\nscope = "node"\n'
            f'[tiers.lustre]\nurl = "{self.lustre}"\n'
        )
        return cfg

    def start(self, scenario: str, nodes: list[str], pg_timeout: int = 60) -> list[Any]:
        self.launches += 1
        procs = []
        for node in nodes:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={len(nodes)}",
                "--nproc-per-node=2",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.port}",
                f"--rdzv-id=launch{self.launches}",
                "--rdzv-conf=is_host=false",
                "--local-addr=127.0.0.1",
                "--max-restarts=0",
                WORKER,
                scenario,
                str(self.out),
            ]
            env = {
                **os.environ,
                "FMSTORE_CONFIG": str(self.config(node)),
                "FMSTORE_NODE_ID": node,
                "NODE_WORKER_PG_TIMEOUT": str(pg_timeout),
            }
            log = open(self.out / f"{scenario}-{node}.log", "w")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            log.close()
            # The rendezvous orders nodes by (host, pid): started in order, n0 gets ranks 0-1.
            time.sleep(0.2)
        return procs

    def logs(self, scenario: str, nodes: list[str]) -> str:
        return "\n".join((self.out / f"{scenario}-{n}.log").read_text()[-4000:] for n in nodes)

    def run(self, scenario: str, nodes: list[str], timeout: float = 300) -> list[dict[str, Any]]:
        procs = self.start(scenario, nodes)
        try:
            rcs = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                _kill(p)
        assert rcs == [0] * len(nodes), self.logs(scenario, nodes)
        return [
            json.loads((self.out / f"{scenario}-{r}.json").read_text())
            for r in range(2 * len(nodes))
        ]


def _kill(p: Any) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _wait_for(path: Path, procs: list[Any], timeout: float) -> None:
    """Until ``path`` exists (the event), or fail when every agent already exited."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert any(p.poll() is None for p in procs), "every node exited before the event"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("nodes"))
    c.saved = c.run("save", ["n0", "n1"])
    yield c


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
    env = {
        **os.environ,
        "FMSTORE_CONFIG": str(cluster.config(node)),
        "FMSTORE_NODE_ID": node,
        "COLUMNS": "400",
    }
    return subprocess.run(
        [sys.executable, "-m", "fmstore", *args], env=env, capture_output=True, text=True
    )


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
    procs = cluster.start("kill", ["n0", "n1"], pg_timeout=20)
    try:
        _wait_for(cluster.out / "blocked", procs, timeout=300)
        victim = (cluster.out / "blocked").read_text()
        assert victim == "n1"
        _kill(procs[1])  # SIGKILL of n1's agent and ranks
        # n0's ranks give up at their group's timeout (seconds, not gloo's 30 minutes).
        procs[0].wait(timeout=240)
        assert procs[0].returncode != 0
    finally:
        for p in procs:
            _kill(p)
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
    reps = cluster.run("resume", ["n0", "n1"])
    # Step 20 was never committed, and n1 cannot read step 10 from its NVMe: every rank
    # fell back together to step 10 on Lustre (bit-exact, checked by the worker); step 20's
    # pending parts are gone, and step 30 saved and restored.
    assert all(r["used"] == "lustre:" + STEP.format(10) for r in reps)
    assert all(r["used30"] == "nvme:" + STEP.format(30) for r in reps)
    assert not list((cluster.nvme("n0") / step20).glob("g*/rank-*.json"))
    for node in ("n0", "n1"):
        assert (cluster.nvme(node) / STEP.format(30) / "manifest.json").is_file()


def test_replaced_node_gets_an_error_naming_its_missing_part(cluster):
    if not (cluster.nvme("n1") / STEP.format(30) / "manifest.json").is_file():
        pytest.skip("needs the relaunched job's step 30")
    shutil.rmtree(cluster.nvme("n1"))
    shutil.rmtree(cluster.base / "n1" / "state", ignore_errors=True)
    reps = cluster.run("replaced", ["n0", "n1"])
    errors = {r["error"] for r in reps}
    assert len(errors) == 1, errors  # the same answer on every rank
    (err,) = errors
    assert err.startswith("CandidatesFailed"), err  # a NotFound
    assert "node n1 lacks its part" in err and STEP.format(30) in err, err


def test_four_rank_checkpoint_restores_on_two_ranks_from_the_shared_tier(cluster):
    reps = cluster.run("reshard", ["n0"])
    # nvme's parts were saved by 4 ranks: not used; lustre's copy is resharded by DCP.
    assert all(r["used"] == "lustre:" + STEP.format(10) for r in reps)
