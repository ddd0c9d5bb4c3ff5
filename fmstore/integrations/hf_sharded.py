"""The HF callback's path for a model the Trainer shards with FSDP2: every rank saves its
own shards through a :class:`~fmstore.tiering.managers.sharded.ShardedCheckpointManager` and every
rank restores them, never gathering the state to one rank.

One DCP checkpoint of the step holds ``model`` and ``optimizer`` (each rank's shards, from
``torch.distributed.checkpoint.state_dict.get_state_dict``), ``trainer`` (the scheduler,
``TrainerState``, step and world size: one checksummed blob, the same on every rank, so DCP
stores it once) and ``ranks.R`` (rank R's RNG states and data position, written and read by
that rank only: what a rank pays does not grow with the job).  The blobs are ``torch.save``
bytes of plain data, read back with ``weights_only``.  Imports no trainer library.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from ..errors import CorruptData, FmstoreError
from ..tiering.managers.sharded import ShardedCheckpointManager

__all__ = ["refuse_fsdp1", "restore", "state"]

#: The most ranks a saved world size may claim (a checkpoint is outside input).
_MAX_WORLD = 1 << 20


def refuse_fsdp1(model: Any) -> None:
    """FSDP1 (``FullyShardedDataParallel``) is refused: only FSDP2 is covered."""
    if type(model).__name__ == "FullyShardedDataParallel":
        raise FmstoreError(
            "FmstoreCallback saves sharded models of FSDP2 (fsdp_version 2: FSDP_VERSION=2, "
            "or fsdp_version: 2 in the accelerate config); this model is FSDP1's "
            "FullyShardedDataParallel, whose state the callback does not save (its path "
            "is built and tested for FSDP2's DTensor shards only)"
        )


def _optimizer(opt: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (what the Trainer
    hands its callbacks), so that ``get_optimizer_state_dict`` steps no wrapper."""
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else opt


def _blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unblob(data: Any, where: str, weights_only: bool) -> Any:
    if not isinstance(data, bytes) or not data:
        raise CorruptData(f"{where}: not in this checkpoint (not one FmstoreCallback saved)")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except Exception as e:
        raise CorruptData(f"{where}: cannot be read ({e})"[:400]) from None


def state(model: Any, optimizer: Any | None, trainer: dict[str, Any], record: Any) -> Any:
    """This rank's DCP state of a save: its shards, the Trainer's part and its record."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    rank = dist.get_rank() if dist.is_initialized() else 0
    out: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        out["optimizer"] = get_optimizer_state_dict(model, _optimizer(optimizer))
    out["trainer"] = _blob(trainer)
    out["ranks"] = {str(rank): _blob(record)}
    return out


def _planner() -> Any:
    """torch's load planner, but a rank whose record the saved run had no rank for (a
    larger world now) reads none rather than failing; every other key is required."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _RanksOptional(DefaultLoadPlanner):  # type: ignore[misc]
        def set_up_planner(
            self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
        ) -> None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            have = metadata.state_dict_metadata if metadata is not None else {}
            for k in [k for k in self.state_dict if k.startswith("ranks.") and k not in have]:
                del self.state_dict[k]

    return _RanksOptional()


def restore(
    manager: ShardedCheckpointManager,
    model: Any,
    optimizer: Any | None,
    rank: int,
    weights_only: bool,
) -> tuple[int, dict[str, Any], Any] | None:
    """Every rank: the newest good step (any tier, the manager's fallbacks) loaded into
    ``model`` and ``optimizer`` in place; returns ``(step, the Trainer's part, this rank's
    record or None)``, or None when there is no checkpoint.  A collective."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opt = _optimizer(optimizer) if optimizer is not None else None
    st: dict[str, Any] = {"model": get_model_state_dict(model)}
    if opt is not None:
        st["optimizer"] = get_optimizer_state_dict(model, opt)
    st["trainer"] = b""
    st["ranks"] = {str(rank): b""}
    step = manager.restore(st, planner=_planner())
    if step is None:
        return None
    set_model_state_dict(model, st["model"])
    if opt is not None:
        set_optimizer_state_dict(model, opt, st["optimizer"])
    part = _unblob(st["trainer"], "trainer", weights_only)
    if not isinstance(part, dict) or part.get("step") != step:
        raise CorruptData(f"trainer: not the Trainer's state of step {step}")
    world = part.get("world_size")
    if not (type(world) is int and 1 <= world <= _MAX_WORLD):
        raise CorruptData("trainer.world_size: not a number of ranks")
    mine = st["ranks"][str(rank)]
    rec = _unblob(mine, f"ranks.{rank}", weights_only) if mine else None
    if rec is not None and not isinstance(rec, dict):
        raise CorruptData(f"ranks.{rank}: not a mapping")
    return step, part, rec
