"""A restore that falls back from a step a slow node is still exporting, on real nodes:
three ``torchrun`` agents x 1 rank on loopback (:class:`fmstore.testing.cluster.Cluster`),
each with its own NVMe, state directory and ``fmstore daemon``; Lustre shared.

Step 16 is committed on Lustre.  Step 24 is saved; n1's and n2's daemons export their parts
of it at once, n0's daemon is slow (a bandwidth limit, as with a slow S3) and is stopped
(SIGSTOP) in the middle of its export.  n1 is lost and the job relaunched without its NVMe,
with a 30 s process-group timeout: the restore chooses step 16 from Lustre without waiting
for n0's export (it used to wait up to 600 s between two collectives, and every relaunch
died), and the job redoes step 24.  Once n0's daemon goes on (SIGCONT), its export of the
abandoned step commits nothing, and the redone step is exported and verifies."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from cluster_support import wait_on_nodes

from fmstore.testing.cluster import Cluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "parts_node_worker.py")
NODES = ["n0", "n1", "n2"]
# ``[daemon]`` last: n0's own line (its node_toml) joins that table
POLICIES = """
[policies]
ladder = ["nvme", "lustre"]
[[policies.export]]
to = "lustre"
every_steps = 8
[protocol]
lease_ttl = "12s"
[daemon]
interval = "0.2s"
"""
SLOW = 'bwlimit = "2KB"\n'  # n0's part of a step (16 KiB) takes about 8 s to export


def step_dir(root: Path, step: int) -> Path:
    return root / "run" / f"step_{step:012d}"


def generation(root: Path, step: int) -> str:
    return json.loads((step_dir(root, step) / "manifest.json").read_bytes())["generation"]


def copying(state: Path, step: int) -> bool:
    """Whether a copy journal of this node names a destination in ``step`` (its record of
    the destination is written within a quarter second of the copy's start)."""
    want = f"/step_{step:012d}".encode()
    return any(want in j.read_bytes() for j in (state / "transfers").glob("*.jsonl"))


def test_a_fallback_past_a_slow_export_neither_waits_for_it_nor_lets_it_commit(tmp_path):
    with Cluster(tmp_path, nproc=1, policies=POLICIES, pg_timeout=30, node_toml={"n0": SLOW}) as c:
        # One launch saves step 16, waits while the daemons drain it to lustre, saves 24.
        env = {"PARTS_WORKER_TEST_PORT": str(c.port)}
        job = c.start(WORKER, ["save", str(c.out), "16", "pause", "24"], NODES, env=env)
        paused = [f"parts/paused-{r}" for r in range(3)]
        wait_on_nodes(lambda: c.store.check(paused), job, "step 16 saved", 300, each=True)
        drains = [c.start_daemon(n, "--drain", "--timeout", "200") for n in NODES]
        assert [p.wait(300) for p in drains] == [0] * 3, c.logs("daemon", NODES)
        assert (step_dir(c.lustre, 16) / "manifest.json").is_file()
        assert not step_dir(c.lustre, 24).exists()

        c.store.set("parts/go", "1")
        assert [p.wait(300) for p in job] == [0] * 3, c.logs("job", NODES)
        gen = generation(c.nvme("n0"), 24)
        abandoned = step_dir(c.lustre, 24) / gen
        d1, d2 = c.start_daemon("n1"), c.start_daemon("n2")
        wait_on_nodes(
            lambda: all((abandoned / f"part-{n}.json").is_file() for n in ("n1", "n2")),
            [d1, d2],
            "n1's and n2's parts of step 24 on lustre",
            240,
            each=True,
        )
        d0 = c.start_daemon("n0")
        wait_on_nodes(
            lambda: copying(c.state("n0"), 24),
            [d0],
            "n0's copy of its part of step 24",
            240,
            each=True,
        )
        os.kill(d0.pid, signal.SIGSTOP)  # mid-copy: its journal held, its part not there
        try:
            assert not (abandoned / "part-n0.json").exists()
            c.replace("n1")  # lost: its NVMe, state and daemon gone
            rcs = c.run(WORKER, ["redo", str(c.out), "24"], NODES, name="redo", timeout=400)
            assert rcs == [0] * 3, c.logs("redo", NODES)
        finally:
            os.kill(d0.pid, signal.SIGCONT)
        reps = [json.loads((c.out / f"restore-{r}.json").read_text()) for r in range(3)]
        for r in reps:
            assert (r["step"], r["tier"], r["exact"]) == (16, "lustre", True), r
            assert r["moved_aside"] == [24], r
        # the restore committed nothing and retired the abandoned generation on lustre
        assert (abandoned / "retired.json").is_file()
        redo = (step_dir(c.nvme("n0"), 24) / "manifest.json").read_bytes()
        assert generation(c.nvme("n0"), 24) != gen
        for n in NODES:
            assert (step_dir(c.nvme(n), 24) / "manifest.json").read_bytes() == redo

        # n0's daemon goes on: its export of the abandoned step ends, committing nothing
        log0 = c.log("daemon", "n0")
        wait_on_nodes(
            lambda: "export_retired" in log0.read_text(),
            [d0],
            "the end of n0's old export",
            240,
            each=True,
        )
        manifest = step_dir(c.lustre, 24) / "manifest.json"
        assert not manifest.exists() or manifest.read_bytes() == redo
        # every node's daemon exports the redone step (n1's is a new one)
        d1 = c.start_daemon("n1")
        wait_on_nodes(
            lambda: manifest.is_file() and manifest.read_bytes() == redo,
            [d0, d1, d2],
            "the redone step 24 committed on lustre",
            240,
            each=True,
        )
        for n in NODES:
            r = c.fmstore(n, "ckpt", "verify", "--all-tiers", "run")
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        r = c.fmstore("n0", "ckpt", "list", "run", "--json")
        assert r.returncode == 0, r.stderr
        assert "corrupt" not in r.stdout, r.stdout
        for n in NODES:
            assert "export_corrupt" not in c.log("daemon", n).read_text(), n
