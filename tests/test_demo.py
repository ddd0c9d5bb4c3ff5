"""The main job, shortened: train on the embedded default, kill -9 a second run, wipe its nvme
copies and resume from lustre / S3 to bit-identical weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_kill_resume_wiped_nvme_is_bit_identical(tmp_path):
    work = tmp_path / "demo"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fmstore.demo",
            "--steps",
            "30",
            "--ckpt-every",
            "5",
            "--sentences",
            "4000",
            "--crash",
            "--wipe-nvme",
            "--workdir",
            str(work),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    result = json.loads((work / "result.json").read_text())
    assert result["bit_identical"] is True
    restore = result["restore"]
    assert restore is not None, "the killed run restarted from scratch instead of a checkpoint"
    assert restore["tier"] and restore["tier"][0] in ("lustre", "s3"), restore  # nvme was wiped
    assert restore["step"] < result["kill_at"]
    assert (work / "demo.png").stat().st_size > 10_000
