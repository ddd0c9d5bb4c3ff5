"""``make demo-cluster``, shortened: two nodes x two ranks with replicas on the peer's NVMe,
node n1 killed and replaced mid-run, the job resumed from n0's NVMe (n1's part from its
replica there) with no checkpointed step redone, bit-identical to an uninterrupted run; the
daemons export to the shared tiers meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_cluster_replaced_node_resumes_bit_identical(tmp_path):
    work = tmp_path / "demo"
    r = subprocess.run(
        [
            *(sys.executable, "-m", "fmstore.demo.cluster", "--workdir", str(work)),
            *("--steps", "12", "--ckpt-every", "3", "--kill-at", "6", "--sentences", "300"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    result = json.loads((work / "result.json").read_text())
    assert result["bit_identical"] is True
    rest = result["restore"]
    # n1's NVMe was wiped: its part came from the replica on n0's NVMe, and the relaunch
    # restored the newest step any tier held at the kill.
    assert rest is not None and rest["tier"] == "nvme", rest
    assert rest["step"] <= result["kill"]["step"]
    assert result["replicas"] == 1 and result["steps_redone"] == 0, result["kill"]
    # the plot's data: per tier the newest step restorable from it
    assert any(row["restorable"]["nvme"] == rest["step"] for row in result["tiers"])
    # The daemons exported both nodes' parts: a copy committed on Lustre.
    assert result["tiers"][-1]["lustre committed"] >= 1, result["tiers"][-1]
    assert (work / "cluster.png").stat().st_size > 10_000
