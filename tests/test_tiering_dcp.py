"""Tiering carries checkpoints written by the DCP ``Writer`` like single-process ones.

A multi-rank job (two ranks under ``torchrun``, one node) saves three DCP checkpoints to
``nvme``; ``fmstore daemon --once`` exports them to ``lustre``, verifies every chunk there,
and retention trims ``nvme``; the copies on ``lustre`` load back bit-exact.  A manifest
written by a newer fmstore is reported as unreadable, never as a corrupt copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_tier_worker import expected
from tiering_helpers import on_tier

from fmstore.checkpoint.dcp import Reader, Writer
from fmstore.testing import torchrun as launcher

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = (10, 20, 30)


def _config(tmp: Path) -> Path:
    cfg = tmp / "fmstore.toml"
    cfg.write_text(
        f"""
state_dir = "{tmp}/state"
[tiers.nvme]
url = "{tmp}/nvme"
[tiers.lustre]
url = "{tmp}/lustre"
[policies]
[[policies.export]]
to = "lustre"
every_steps = 10
[policies.retention.nvme]
keep_latest = 1
"""
    )
    return cfg


def _fm(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fmstore", *args],
        env={**os.environ, "FMSTORE_CONFIG": str(cfg)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _events(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def _listing(cfg: Path) -> dict[int, dict[str, str]]:
    r = _fm(cfg, "ckpt", "list", "--json")
    assert r.returncode == 0, r.stderr
    return {c["step"]: {t: v["state"] for t, v in c["tiers"].items()} for c in json.loads(r.stdout)}


def test_two_rank_dcp_checkpoints_are_exported_verified_and_retained(tmp_path):
    cfg = _config(tmp_path)
    cmd = launcher.command(
        os.path.join(HERE, "dcp_tier_worker.py"), ["nvme:runs/d", *map(str, STEPS)], nproc=2
    )
    log = tmp_path / "launch.log"
    rc = launcher.run(cmd, timeout=300, log=log, env={**os.environ, "FMSTORE_CONFIG": str(cfg)})
    assert rc == 0, log.read_text(errors="replace")[-6000:]
    # Both ranks wrote blobs of their own.
    manifest = json.loads((tmp_path / "nvme/runs/d/step_000000000030/manifest.json").read_text())
    assert {b["rank"] for b in manifest["blobs"]} == {0, 1}

    for _ in range(2):  # exports, then retention (deletes wait for verified exports)
        r = _fm(cfg, "daemon", "--once", "--no-http")
        assert r.returncode == 0, r.stderr
        kinds = {e.get("event") for e in _events(r.stderr)}
        assert "export_corrupt" not in kinds and "step_error" not in kinds, r.stderr

    from fmstore.config import load_config

    conf = load_config(str(cfg))
    assert on_tier(conf, "lustre", "runs/d") == {s: True for s in STEPS}
    assert on_tier(conf, "nvme", "runs/d") == {30: True}
    listing = _listing(cfg)
    assert {s: t["lustre"] for s, t in listing.items()} == {s: "present" for s in STEPS}
    assert listing[30]["nvme"] == "present"
    assert listing[10]["nvme"] == listing[20]["nvme"] == "deleted"

    # The exported copies load back bit-exact (resharded onto one process).
    for step in STEPS:
        want = expected(step)
        got = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in want.items()
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(
                got,
                storage_reader=Reader(str(tmp_path / f"lustre/runs/d/step_{step:012d}")),
                no_dist=True,
            )
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(got[k], v), (step, k)
            else:
                assert got[k] == v


def test_manifest_of_a_newer_fmstore_is_unreadable_not_corrupt(tmp_path):
    cfg = _config(tmp_path)
    sd = {"w": torch.randn(100, 50), "meta": {"step": 10}}
    prefix = tmp_path / "nvme/runs/d/step_000000000010"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=Writer(str(prefix)), no_dist=True)
    mpath = prefix / "manifest.json"
    doc = json.loads(mpath.read_text())
    doc["version"] = 99
    mpath.write_text(json.dumps(doc))

    r = _fm(cfg, "daemon", "--once", "--no-http")
    events = _events(r.stderr)
    # Not counted as a commit (this fmstore cannot check it, so no retention window moves
    # for it), and said so, as newer; never reported as damage, never exported.
    found = [e for e in events if e.get("event") == "rediscovered"]
    assert found and "newer" in str(found[0]["not_counted"]), r.stderr
    assert not [e for e in events if e.get("event") == "export_corrupt"], r.stderr
    assert os.path.exists(mpath)  # the source is left as it is
    assert not (tmp_path / "lustre/runs/d/step_000000000010/manifest.json").exists()
