"""The saving side of the checkpoint kill test: deterministic states saved in a loop.

Used by tests/test_checkpoint_kill.py and the longer tests/stress/ckpt_kill_stress.py; a
child process runs :func:`save_forever` until it is SIGKILLed.
"""

from __future__ import annotations

import os

import torch


def make_state(step: int, scale: int = 1) -> dict:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(256 * scale, 64, generator=g)
    return {
        "model": {
            "emb": w.to(torch.bfloat16),
            "head": w.to(torch.bfloat16),
            "proj": torch.randn(128 * scale, 64, generator=g),
            "mask": torch.rand(1000, generator=g) > 0.5,
        },
        "optim": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.zeros(5000)}}},
        "step": step,
    }


def tie(state: dict) -> dict:
    state["model"]["head"] = state["model"]["emb"]
    return state


def save_forever(root: str, scale: int = 1) -> None:
    import fmstore

    step = 0
    while True:
        state = tie(make_state(step, scale))
        fmstore.save(
            state, os.path.join(root, f"step-{step:06d}"), chunk_size=1 << 16, blob_size=1 << 17
        )
        fmstore.save(
            state,
            os.path.join(root, "latest"),
            overwrite=True,
            chunk_size=1 << 16,
            blob_size=1 << 17,
        )
        step += 1
