"""One rank saves for all, every rank restores: what the integrations that save a full
state dict from world process zero (the HF callback, Accelerate) share.

World process zero holds the only :class:`~fmstore.CheckpointManager`: it restores the
newest good step (any tier, with the manager's fallbacks) and tells the others which step
and tier over the checkpoint group; each other rank reads that step itself through a
:class:`TierReader` (no catalog, no policies).  If world process zero cannot restore, every
rank raises.  Imports no trainer library.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from .. import runtime
from ..config import get_config, load_config
from ..errors import CorruptData, FmstoreError, NotFound, StoreUnavailable
from ..tiering.managers.manager import CheckpointManager
from ..tiering.policy.policies import from_config
from ..tiering.tiers import Tiers

__all__ = ["TierReader", "dist_group", "rank", "restore_on_every_rank"]


class TierReader:
    """How a rank other than world process zero reads the step rank 0 restored: straight
    from the tiers (no catalog, no policies), the tier rank 0 read first, then the rest of
    the ladder fastest first (a rank on another node does not see rank 0's NVMe)."""

    def __init__(self, root: str, config: Any, ladder: list[str], tiers: Tiers | None) -> None:
        self.root = root.strip("/")
        self.config = config
        self.ladder = ladder
        self.tiers = tiers if tiers is not None else Tiers(config)
        self._owned = tiers is None

    @classmethod
    def of(
        cls, manager: CheckpointManager | None, root: str, options: dict[str, Any]
    ) -> TierReader:
        if manager is not None:
            return cls(manager.root, manager.config, list(manager.policies.ladder), manager.tiers)
        cfg = options.get("config")
        config = (
            get_config()
            if cfg is None
            else cfg
            if not isinstance(cfg, str | os.PathLike)
            else load_config(cfg)
        )
        pol = options.get("policies")
        ladder = list((pol.validate(config.tiers) if pol else from_config(config)).ladder)
        return cls(root, config, ladder, None)

    def load(self, step: int, first: str | None, weights_only: bool) -> Any:
        from ..checkpoint import api

        order = [first] if first in self.ladder else []
        order += [t for t in self.ladder if t not in order]
        failures = []
        for tier in order:
            try:
                return api.load(
                    self.tiers.checkpoint(tier, self.root, step),
                    map_location="cpu",
                    weights_only=weights_only,
                )
            except (NotFound, CorruptData, StoreUnavailable) as e:
                failures.append(f"{tier}: {e}")
        raise NotFound(
            f"step {step} of {self.root!r}, which rank 0 restored, is on no tier this rank "
            "can read (a node-local tier of rank 0's node is not visible from here until a "
            "policy exports the step): " + "; ".join(failures)
        )

    def close(self) -> None:
        if self._owned:
            runtime.run(self.tiers.close(), timeout=30)


def dist_group() -> Any:
    """fmstore's own gloo group for checkpoint traffic, None in one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    from ..checkpoint.dcp.collective import checkpoint_group

    return checkpoint_group()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def restore_on_every_rank(
    manager: CheckpointManager | None,
    pg: Any,
    reader: Callable[[], TierReader],
    weights_only: bool,
    step: int | None = None,
) -> Any:
    """The checkpoint every rank restores, or None when there is none (a fresh start).

    ``manager``: world process zero's (None on the other ranks); it restores ``step``
    (default the newest good one, any tier) and broadcasts the step and tier over ``pg``
    (None: one process); the other ranks read that step through ``reader()``.  A collective
    of ``pg``: every rank calls it at the same point."""
    from ..protocol.wire import broadcast_result

    ckpt: Any = None
    said: bytes | str | None = None
    if manager is not None:
        try:
            if step is not None or manager.latest_step() is not None:
                ckpt = manager.restore(step, map_location="cpu", weights_only=weights_only)
            said = json.dumps(
                {
                    "step": None if ckpt is None else manager.restored_step,
                    "tier": manager.restored_tier,
                }  # fmt: skip
            ).encode()
        except Exception as e:
            if pg is not None:
                broadcast_result(pg, 0, f"{type(e).__name__}: {e}", limit=4096)
            raise
    if pg is None:
        return ckpt
    got = broadcast_result(pg, 0, said if manager is not None else None, limit=4096)
    if isinstance(got, str):
        raise FmstoreError(f"world process zero could not restore, so no rank does: {got}")
    if manager is None:
        msg = json.loads(got)
        if msg["step"] is not None:
            ckpt = reader().load(int(msg["step"]), msg["tier"], weights_only)
    return ckpt
