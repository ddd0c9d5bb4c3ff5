"""The demo: the main job, shortened (train on the embedded default, kill -9 a second run,
lose its nvme and lustre copies and resume from S3, a prefixed tier with its endpoint in
``[s3]``, to bit-identical weights); ``--help`` explains every option; the plot's step labels
do not overlap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_the_demo_plots_step_labels_that_do_not_overlap(tmp_path, monkeypatch):
    import json
    import time

    import matplotlib.pyplot as plt
    from rich.console import Console

    from fmstore.demo.report import plot
    from fmstore.tiering.inventory import catalog as cat
    from fmstore.tiering.inventory.catalog import Catalog

    (tmp_path / "fmstore.toml").write_text(
        f'state_dir = "{tmp_path / "state"}"\n[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
    )
    t0 = time.time() - 60
    log = tmp_path / "log.jsonl"
    log.write_text(
        "".join(
            json.dumps({"event": "step", "pid": 1, "t": t0 + i, "loss": 1 / (i + 1)}) + "\n"
            for i in range(60)
        )
    )
    with Catalog.for_state_dir(str(tmp_path / "state")) as c:
        for i in range(120):  # a save every half second: as dense as the demo's
            step = 10 * i
            c.record_checkpoint("runs/demo", step, created=t0 + i / 2)
            for tier in ("nvme", "lustre", "s3"):
                c.set_copy("runs/demo", step, tier, cat.PRESENT, verified=t0 + i / 2 + 0.1)
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    plot(tmp_path, log, Console(quiet=True))
    (fig,) = figs
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[1]
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(boxes) >= 30  # a label for many steps on every tier, not none
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)


def test_the_demo_explains_itself_and_every_option():
    r = subprocess.run(
        [sys.executable, "-m", "fmstore.demo", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "a small GPT trained on CPU" in text and "docs/demo.md" in text
    assert "see the package docstring" not in text
    assert "training steps of each run (default: 300)" in text
    assert "save a checkpoint every N steps (default: 25)" in text
