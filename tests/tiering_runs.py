"""A training run driven save by save, with the policies settled after each save (the
daemon or the background thread catching up), so the tests can lose the catalog or the node
at a chosen save and compare with a run that lost nothing."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

from tiering_helpers import on_tier, state

from fmstore import CheckpointManager
from fmstore.config import Config
from fmstore.tiering.policy.runner import PolicyRunner


def settle(runner: PolicyRunner, limit: int = 100) -> None:
    """Run policy steps until one finds nothing to do."""
    for _ in range(limit):
        rep = runner.step(blocking_lock=True)
        assert not rep.errors, rep.errors
        if not rep.did_something:
            return
    raise AssertionError("the policies did not settle")


def run_saves(cfg: Config, root: str, steps: Iterable[int], *, settle_each: bool = True) -> None:
    """Save ``steps`` in order with a fresh manager (as a restarted process would)."""
    with CheckpointManager(root, config=cfg, run_policies=False, async_save=False) as mgr:
        runner = PolicyRunner(cfg, mgr.policies, mgr.catalog, tiers=mgr.tiers)
        for s in steps:
            mgr.save(s, state(s, n=16))
            if settle_each:
                settle(runner)


def lose_catalog(base: str) -> None:
    shutil.rmtree(os.path.join(base, "state"))


def replace_node(base: str) -> None:
    """The node is gone: its NVMe and its catalog."""
    lose_catalog(base)
    shutil.rmtree(os.path.join(base, "nvme"), ignore_errors=True)


def held(cfg: Config, tier: str, root: str) -> list[int]:
    got = on_tier(cfg, tier, root)
    assert all(got.values()), got
    return sorted(got)
