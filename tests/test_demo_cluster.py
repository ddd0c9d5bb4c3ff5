"""``make demo-cluster``, shortened: two nodes x two ranks, node n1 killed and replaced
mid-run, the job resumed from a copy the daemons exported to a shared tier, bit-identical
to an uninterrupted run."""

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
    # n1's NVMe was wiped: the restore read a shared tier, never newer than the kill.
    assert rest is not None and rest["tier"] in ("lustre", "s3"), rest
    assert rest["step"] <= result["kill"]["step"]
    # The daemons exported both nodes' parts: a copy committed on Lustre.
    assert result["tiers"][-1]["lustre committed"] >= 1, result["tiers"][-1]
    assert (work / "cluster.png").stat().st_size > 10_000
