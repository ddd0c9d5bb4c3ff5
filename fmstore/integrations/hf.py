"""A Hugging Face ``transformers`` callback that saves training state through a
:class:`~fmstore.CheckpointManager`, and the helper that restores it.

``Trainer(..., callbacks=[FmstoreCallback("runs/gpt")])``: whenever the Trainer saves
(``save_steps``, ``save_strategy``), the model's, optimizer's and scheduler's state dicts,
the step, the Trainer's state and the RNG states are saved as the manager's checkpoint of
that step, on its write tier; the manager's policies carry copies to the slower tiers.
See docs/integrations.md.  Importing this module imports ``transformers``.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..tiering.manager import CheckpointManager

__all__ = ["FmstoreCallback", "restore", "training_state"]

#: The fields of ``TrainerState`` that say how far training got, restored from a checkpoint
#: (the others, ``max_steps``, ``save_steps`` and the like, come from the run's arguments).
_PROGRESS = (
    "global_step",
    "epoch",
    "total_flos",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
    "num_input_tokens_seen",
)


def training_state(
    model: Any,
    optimizer: Any | None,
    lr_scheduler: Any | None,
    state: TrainerState,
    *,
    include_rng: bool = True,
) -> dict[str, Any]:
    """What :class:`FmstoreCallback` saves: plain data only (tensors, numbers, strings),
    so it loads with ``weights_only=True``."""
    out: dict[str, Any] = {
        "model": model.state_dict(),
        "step": int(state.global_step),
        "epoch": float(state.epoch or 0.0),
        "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
    }
    if optimizer is not None:
        out["optimizer"] = optimizer.state_dict()
    if lr_scheduler is not None:
        out["scheduler"] = lr_scheduler.state_dict()
    if include_rng:
        out["rng"] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
    return out


def _load_into(
    ckpt: dict[str, Any],
    model: Any,
    optimizer: Any | None,
    lr_scheduler: Any | None,
    state: TrainerState | None,
) -> None:
    model.load_state_dict(ckpt["model"])
    if optimizer is not None and "optimizer" in ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
    if lr_scheduler is not None and "scheduler" in ckpt:
        lr_scheduler.load_state_dict(ckpt["scheduler"])
    if state is not None:
        saved = json.loads(ckpt["trainer_state"])
        for k in _PROGRESS:  # not max_steps, save_steps, ...: those are the new run's
            if k in saved and hasattr(state, k):
                setattr(state, k, saved[k])
    rng = ckpt.get("rng")
    if rng is not None:
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])


def restore(
    trainer: Any,
    manager: CheckpointManager,
    step: int | None = None,
    *,
    weights_only: bool = True,
) -> int:
    """Load the checkpoint of ``step`` (default: the newest complete one, any tier, see
    :meth:`CheckpointManager.restore`) into ``trainer``: the model's weights, the optimizer
    and scheduler (created first with ``trainer.create_optimizer_and_scheduler`` when the
    Trainer has none yet), ``trainer.state`` and the RNG states.  Returns the step.

    ``trainer.train()`` starts a fresh ``TrainerState`` (step 0); to continue counting from
    the restored step, pass ``FmstoreCallback(..., resume=True)`` instead, which restores at
    the start of training.
    """
    ckpt = manager.restore(step, map_location="cpu", weights_only=weights_only)
    if trainer.optimizer is None or trainer.lr_scheduler is None:
        trainer.create_optimizer_and_scheduler(num_training_steps=max(trainer.args.max_steps, 1))
    _load_into(ckpt, trainer.model, trainer.optimizer, trainer.lr_scheduler, trainer.state)
    return int(ckpt["step"])


class FmstoreCallback(TrainerCallback):  # type: ignore[misc]
    """Saves the training state through a :class:`~fmstore.CheckpointManager` whenever the
    Trainer saves.

    ``manager``: a ``CheckpointManager``, or its root (then ``manager_options`` go to
    ``CheckpointManager(root, **manager_options)``, and the callback closes it at the end of
    training).  Saves are asynchronous as the manager's are (``save`` returns once the
    state is snapshotted); the end of training waits for them.

    ``replace_trainer_save=True``: save only through fmstore; the Trainer's own checkpoint
    directories under ``output_dir`` are not written (the callback takes the save the
    Trainer decided on and cancels it).  Default False: both are written.
    ``resume=True``: at the start of training, restore the newest checkpoint the manager
    holds (weights, optimizer, scheduler, ``TrainerState`` with its step, RNG states), so
    training continues from its step up to ``max_steps``.  The data order starts again
    from the first batch.  ``include_rng``: also save the Python, NumPy and torch RNG
    states.
    """

    def __init__(
        self,
        manager: CheckpointManager | str,
        *,
        replace_trainer_save: bool = False,
        resume: bool = False,
        include_rng: bool = True,
        weights_only: bool = True,
        **manager_options: Any,
    ) -> None:
        if isinstance(manager, CheckpointManager):
            if manager_options:
                raise TypeError("manager options given with a CheckpointManager")
            self.manager, self._owned = manager, False
        else:
            self.manager, self._owned = CheckpointManager(manager, **manager_options), True
        self.replace_trainer_save = replace_trainer_save
        self.resume = resume
        self.include_rng = include_rng
        self.weights_only = weights_only
        self.restored_step: int | None = None
        self._saved: set[int] = set()
        #: The manager's :meth:`~fmstore.CheckpointManager.prepare`, started after the
        #: first step (when the optimizer's state exists).
        self.prepared: Any = None

    def _save(self, state: TrainerState, kwargs: dict[str, Any]) -> None:
        step = int(state.global_step)
        if step in self._saved or step in self.manager.steps():
            return  # saved already (the Trainer may save a step twice: on a step and at the end)
        self._saved.add(step)
        ckpt = training_state(
            kwargs["model"],
            kwargs.get("optimizer"),
            kwargs.get("lr_scheduler"),
            state,
            include_rng=self.include_rng,
        )
        self.manager.save(step, ckpt)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self.resume or self.manager.latest_step() is None:
            return
        ckpt = self.manager.restore(map_location="cpu", weights_only=self.weights_only)
        _load_into(
            ckpt, kwargs["model"], kwargs.get("optimizer"), kwargs.get("lr_scheduler"), state
        )
        self.restored_step = int(ckpt["step"])

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.prepared is None and "model" in kwargs:
            # Staging memory and discovery off the stall of the first save.
            ckpt = training_state(
                kwargs["model"],
                kwargs.get("optimizer"),
                kwargs.get("lr_scheduler"),
                state,
                include_rng=self.include_rng,
            )
            self.prepared = self.manager.prepare(ckpt)
        if self.replace_trainer_save and control.should_save:
            self._save(state, kwargs)
            control.should_save = False

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.on_step_end(args, state, control, **kwargs)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self.replace_trainer_save:
            self._save(state, kwargs)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.manager.wait()
        if self._owned:
            self.manager.close()
