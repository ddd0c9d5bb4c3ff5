"""Tiering of sharded checkpoints on real nodes: two ``torchrun`` agents on loopback (one
rank each, :class:`fmstore.testing.cluster.Cluster`), each with its own NVMe, state
directory and ``fmstore daemon``; Lustre and S3 (SeaweedFS) shared.  Each node's daemon
exports its own part to both shared tiers, the copies commit there with the save's
manifest, and a replaced node (NVMe and state wiped) restores with the other from them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fmstore.testing.cluster import Cluster, S3Tier

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "parts_node_worker.py")
NODES = ["n0", "n1"]
POLICIES = """
[policies]
ladder = ["nvme", "lustre", "s3"]
[[policies.export]]
to = "lustre"
every_steps = 10
[[policies.export]]
to = "s3"
every_steps = 20
[daemon]
interval = "0.2s"
"""


def step_dir(root: Path, step: int) -> Path:
    return root / "run" / f"step_{step:012d}"


def test_each_node_exports_its_part_and_a_replaced_node_restores_from_the_shared_tiers(
    tmp_path, s3_server, s3_bucket
):
    s3 = S3Tier(f"s3://{s3_bucket}/fm", s3_server.endpoint_url, s3_server.env(), s3_server.region)
    with Cluster(tmp_path, nproc=1, s3=s3, policies=POLICIES, pg_timeout=120) as c:
        assert c.run(WORKER, ["save", str(c.out), "10", "20"], NODES) == [0, 0], c.logs(
            "job", NODES
        )
        # Both nodes' daemons at once: each exports its own part; whichever finds the set
        # complete commits.
        drains = [c.start_daemon(n, "--drain", "--timeout", "240") for n in NODES]
        assert [p.wait(300) for p in drains] == [0, 0], c.logs("daemon", NODES)
        for step in (10, 20):
            saved = (step_dir(c.nvme("n0"), step) / "manifest.json").read_bytes()
            assert (step_dir(c.nvme("n1"), step) / "manifest.json").read_bytes() == saved
            assert (step_dir(c.lustre, step) / "manifest.json").read_bytes() == saved
            parts = sorted(p.name for p in step_dir(c.lustre, step).glob("*/part-*.json"))
            assert parts == ["part-n0.json", "part-n1.json"]
        for node in NODES:
            r = c.fmstore(node, "ckpt", "verify", "--all-tiers", "run")
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        r = c.fmstore("n0", "ckpt", "list", "run", "--json")
        assert r.returncode == 0, r.stderr
        rows = {row["step"]: row["tiers"] for row in json.loads(r.stdout)}
        assert sorted(rows) == [10, 20]
        # Per step and tier, the parts there: the node's own on its NVMe, every node's
        # (from the destination's part records) on the shared tiers.
        own = rows[20]["nvme"]["part"]
        assert own == {
            "index": 1,
            "of": 2,
            "node": "n0",
            "nodes": ["n0", "n1"],
            "bytes": own["bytes"],
        }
        assert (
            0
            < own["bytes"]
            < sum(  # this node's blobs, not the whole checkpoint
                p.stat().st_size for p in step_dir(c.lustre, 20).glob("*/*.bin")
            )
        )
        for tier in ("lustre", "s3"):
            assert rows[20][tier]["state"] == "present"
            assert rows[20][tier]["parts"] == {
                "present": ["n0", "n1"],
                "of": 2,
                "committed": True,
                "waiting": [],
            }
        assert "s3" not in rows[10]  # every_steps = 20 there

        # n1 is replaced: its NVMe and catalog are gone.  Every rank restores step 20
        # together, from the fastest tier every rank can read: Lustre.
        c.replace("n1")
        assert c.run(WORKER, ["restore", str(c.out)], NODES) == [0, 0], c.logs("job", NODES)
        for rank in (0, 1):
            got = json.loads((c.out / f"restore-{rank}.json").read_text())
            assert got == {"step": 20, "tier": "lustre", "exact": True}, got
