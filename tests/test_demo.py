"""The main job, shortened: train on the embedded default, kill -9 a second run, lose its nvme
and lustre copies and resume from S3 (a prefixed tier, endpoint in ``[s3]``) to bit-identical
weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_kill_resume_from_s3_alone_is_bit_identical(tmp_path):
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
            "--lose-lustre",
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
    assert restore["tier"] and restore["tier"][0] == "s3", restore  # nvme and lustre were lost
    assert restore["step"] < result["kill_at"]
    assert (work / "demo.png").stat().st_size > 10_000
