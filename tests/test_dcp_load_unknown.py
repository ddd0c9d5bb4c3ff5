"""I3 without a process group: ``fmstore.checkpoint.dcp.load`` takes a candidate for absent
only when its ``manifest.json`` is; a candidate it could not read is looked at again, then
the error is raised, never skipped for an older step (docs/distributed.md, "How a restore
chooses")."""

from __future__ import annotations

import os

import pytest
import torch

from fmstore.checkpoint import dcp as fdcp
from fmstore.checkpoint.dcp import collective
from fmstore.errors import StoreUnavailable
from fmstore.protocol.problems import Code


def _two_steps(tmp_path) -> tuple[str, str]:
    """Steps 10 and 20 saved in one process; returns their URIs, newest first."""
    uris = []
    for step in (10, 20):
        uri = str(tmp_path / f"step_{step}")
        fdcp.save({"w": torch.full((4,), float(step))}, uri)
        uris.append(uri)
    return uris[1], uris[0]


def test_an_unreadable_manifest_is_retried_then_raised_never_an_older_step(tmp_path, monkeypatch):
    new, old = _two_steps(tmp_path)
    # A link inside the tier: the POSIX store refuses to follow it (PermissionDenied).
    os.rename(f"{new}/manifest.json", f"{new}/real.json")
    os.symlink("real.json", f"{new}/manifest.json")
    monkeypatch.setattr(collective, "UNKNOWN_PAUSE", 0.0)
    sd = {"w": torch.zeros(4)}
    with pytest.raises(StoreUnavailable, match="3 looks"):
        fdcp.load(sd, new, fallbacks=[old])
    assert sd["w"].eq(0).all()  # nothing of the older step was loaded


def test_only_a_missing_manifest_is_no_checkpoint_a_missing_blob_is_unusable(tmp_path):
    new, old = _two_steps(tmp_path)
    for name in os.listdir(new):
        if name.startswith("g"):  # the generation's blobs
            for blob in os.listdir(f"{new}/{name}"):
                os.remove(f"{new}/{name}/{blob}")
    absent = str(tmp_path / "step_30")
    passed: list = []
    sd = {"w": torch.zeros(4)}
    assert fdcp.load(sd, absent, fallbacks=[new, old], passed=passed) == old
    assert [(c, p.code) for c, p in passed] == [(absent, Code.NO_MANIFEST), (new, Code.UNUSABLE)]
    assert sd["w"].eq(10).all()
