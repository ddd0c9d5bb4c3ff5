"""Helpers shared by the tiering tests: configs over temporary directories, small states,
a direct look at what each tier holds."""

from __future__ import annotations

import os
from typing import Any

import torch

from fmstore import runtime
from fmstore.checkpoint.verify import verify_checkpoint
from fmstore.config import Config, TierConfig, from_dict
from fmstore.tiering.tiers import Tiers


def posix_config(base: str, policies: dict[str, Any], tiers=("nvme", "lustre", "s3")) -> Config:
    """Every tier a directory under ``base`` (``s3`` too, where S3 itself is not the point)."""
    return from_dict(
        {
            "tiers": {t: {"url": os.path.join(base, t)} for t in tiers},
            "state_dir": os.path.join(base, "state"),
            "policies": policies,
        }
    )


def with_tier(config: Config, name: str, url: str, **options: Any) -> Config:
    tiers = dict(config.tiers)
    tiers[name] = TierConfig(name=name, url=url, options=options)
    return Config(tiers=tiers, state_dir=config.state_dir, sections=config.sections)


def state(step: int, n: int = 1000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(n, generator=g), "b": torch.full((7,), float(step))},
        "step": step,
    }


def on_tier(config: Config, tier: str, root: str) -> dict[int, bool]:
    """step -> whether the copy on ``tier`` is committed and passes every checksum (looked
    at on the tier itself, not through the catalog)."""
    tiers = Tiers(config)

    async def scan() -> dict[int, bool]:
        out = {}
        for step in await tiers.steps_on(tier, root):
            res = await verify_checkpoint(tiers.checkpoint(tier, root, step))
            out[step] = res.ok
        await tiers.close()
        return out

    return runtime.run(scan())
