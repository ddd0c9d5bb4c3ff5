"""The check after a saving process was SIGKILLed (tests/test_checkpoint_kill.py and its
stress run, tests/stress/ckpt_kill_stress.py): every committed checkpoint loads bit-exact,
and gc leaves only committed data."""

from __future__ import annotations

import os

import torch

import fmstore
from fmstore.checkpoint import find_checkpoints, gc
from fmstore.format.manifest import Manifest
from fmstore.testing.ckpt_kill import make_state, tie


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def assert_same_state(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    for k, v in want["model"].items():
        assert torch.equal(_bits(got["model"][k]), _bits(v)), k
    assert (
        got["model"]["head"].untyped_storage().data_ptr()
        == got["model"]["emb"].untyped_storage().data_ptr()
    )
    assert torch.equal(got["optim"]["state"][0]["step"], want["optim"]["state"][0]["step"])


def check_after_kill(root: str, scale: int = 1) -> int:
    """Verify every committed checkpoint, run gc, check only committed data is left."""
    committed = find_checkpoints(root)
    steps = sorted(int(p.split("-")[1]) for p in committed if p.startswith("step-"))
    if steps:
        newest = steps[-1]
        assert steps == list(range(newest + 1)), "a save committed out of order"
        assert_same_state(
            fmstore.load(os.path.join(root, f"step-{newest:06d}")), tie(make_state(newest, scale))
        )
    if "latest" in committed:
        got = fmstore.load(os.path.join(root, "latest"))
        assert_same_state(got, tie(make_state(got["step"], scale)))
        assert steps and got["step"] in (steps[-1] - 1, steps[-1])
    gc(root, older_than=0)
    assert find_checkpoints(root) == committed
    referenced = set()
    for p in committed:
        m = Manifest.loads(open(os.path.join(root, p, "manifest.json"), "rb").read())
        referenced.add(os.path.join(p, "manifest.json"))
        referenced.update(os.path.join(p, m.generation, b.name) for b in m.blobs)
    left = {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}
    left = {f for f in left if not f.endswith(".fmstore-lock")}
    assert left == referenced, f"gc left garbage: {sorted(left - referenced)[:5]}"
    return len(steps)
