"""A Hugging Face ``transformers`` callback that saves training state through a
:class:`~fmstore.CheckpointManager`, and the helper that restores it.

``Trainer(..., callbacks=[FmstoreCallback("runs/gpt")])``: whenever the Trainer saves
(``save_steps``, ``save_strategy``), the model's, optimizer's and scheduler's state dicts,
the step, the Trainer's state and every rank's RNG states and data position are saved as
the manager's checkpoint of that step, on its write tier; the manager's policies carry
copies to the slower tiers.  Under DDP only world process zero saves (and only its manager
exists); every rank restores.  Under FSDP2 every rank saves its shards through a
:class:`~fmstore.ShardedCheckpointManager` (:mod:`.hf_sharded`) and restores them.  See
docs/integrations.md.  Importing this module imports
``transformers``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..errors import CorruptData, FmstoreError
from ..tiering.managers.manager import CheckpointManager
from ..tiering.managers.sharded import ShardedCheckpointManager
from . import hf_sharded, rank_state
from .rank_zero import TierReader, restore_on_every_rank
from .rank_zero import dist_group as _dist_group
from .rank_zero import rank as _rank

__all__ = ["FmstoreCallback", "restore", "training_state"]

log = logging.getLogger("fmstore.integrations.hf")

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
    ranks: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What :class:`FmstoreCallback` saves: plain data only (tensors, numbers, strings),
    so it loads with ``weights_only=True``.  ``ranks``: every rank's RNG states and data
    position by rank number (the callback gathers them); default this process's RNG
    states as rank 0's (when ``include_rng``)."""
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
    if ranks is None and include_rng:
        ranks = {"0": {"rng": rank_state.rng_state()}}
    if ranks is not None:
        out["ranks"] = ranks
        out["world_size"] = len(ranks)
    return out


def _load_into(
    ckpt: Any,
    model: Any,
    optimizer: Any | None,
    lr_scheduler: Any | None,
    state: TrainerState | None,
) -> None:
    """Weights, optimizer, scheduler and the Trainer's progress (not the RNGs)."""
    model.load_state_dict(ckpt["model"])
    if optimizer is not None and "optimizer" in ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
    _load_progress(ckpt, lr_scheduler, state)


def _progress(state: TrainerState, lr_scheduler: Any | None, world: int) -> dict[str, Any]:
    """The Trainer's part of a sharded save: what ``training_state`` holds besides the
    model, optimizer and RNGs."""
    out: dict[str, Any] = {
        "step": int(state.global_step),
        "epoch": float(state.epoch or 0.0),
        "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
        "world_size": world,
    }
    if lr_scheduler is not None:
        out["scheduler"] = lr_scheduler.state_dict()
    return out


def _load_progress(ckpt: Any, lr_scheduler: Any | None, state: TrainerState | None) -> None:
    if lr_scheduler is not None and "scheduler" in ckpt:
        lr_scheduler.load_state_dict(ckpt["scheduler"])
    if state is not None:
        saved = json.loads(ckpt["trainer_state"])
        for k in _PROGRESS:  # not max_steps, save_steps, ...: those are the new run's
            if k in saved and hasattr(state, k):
                setattr(state, k, saved[k])


def _rank_record(ckpt: Any, rank: int) -> Any:
    """Rank ``rank``'s saved record (``{"rng": …, "data": …}``), or None; a checkpoint of
    the older layout holds one ``rng`` (rank 0's)."""
    ranks = ckpt.get("ranks")
    if ranks is not None:
        if not isinstance(ranks, dict):
            raise CorruptData("ranks: not a mapping")
        return ranks.get(str(rank))
    old = ckpt.get("rng")
    return {"rng": old} if old is not None and rank == 0 else None


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
    Trainer has none yet), ``trainer.state`` and rank 0's RNG states.  Returns the step.
    One process; under DDP use ``FmstoreCallback(..., resume=True)``.

    ``trainer.train()`` starts a fresh ``TrainerState`` (step 0); to continue counting from
    the restored step, pass ``FmstoreCallback(..., resume=True)`` instead, which restores at
    the start of training.
    """
    ckpt = manager.restore(step, map_location="cpu", weights_only=weights_only)
    if trainer.optimizer is None or trainer.lr_scheduler is None:
        trainer.create_optimizer_and_scheduler(num_training_steps=max(trainer.args.max_steps, 1))
    _load_into(ckpt, trainer.model, trainer.optimizer, trainer.lr_scheduler, trainer.state)
    rec = _rank_record(ckpt, 0)
    if rec is not None and rec.get("rng") is not None:
        rank_state.apply_rng(rec["rng"], "ranks.0.rng")
    return int(ckpt["step"])


def _is_sharded(model: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if type(model).__name__ == "FullyShardedDataParallel":
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def _ga(args: Any) -> int:
    return int(getattr(args, "gradient_accumulation_steps", 1) or 1)


def _steps_per_epoch(dl: Any, ga: int) -> int | None:
    try:
        n = len(dl)
    except TypeError:
        return None
    return max(n // ga + int(n % ga > 0), 1)


class FmstoreCallback(TrainerCallback):  # type: ignore[misc]
    """Saves the training state through a :class:`~fmstore.CheckpointManager` whenever the
    Trainer saves.

    ``manager``: a ``CheckpointManager``, or its root (then ``manager_options`` go to
    ``CheckpointManager(root, **manager_options)``, made on world process zero only, and
    the callback closes it at the end of training).  Saves are asynchronous as the
    manager's are (``save`` returns once the state is snapshotted); the end of training
    waits for them.  Under DDP, world process zero saves for every rank (the others' RNG
    states and data positions are gathered to it); give the root, so that no other rank
    opens a manager (a manager given on another rank is only read through).  Under FSDP2
    (the model's parameters are DTensors) every rank saves its own shards, RNG states and
    data position through a :class:`~fmstore.ShardedCheckpointManager` (made from the
    root on every rank at the start of training, or given), and every rank restores them;
    FSDP1 is refused.

    ``replace_trainer_save=True``: save only through fmstore; the Trainer's own checkpoint
    directories under ``output_dir`` are not written (the callback takes the save the
    Trainer decided on and cancels it).  Default False: both are written.
    ``resume=True``: at the start of training, restore the newest checkpoint the manager
    holds on every rank (weights, optimizer, scheduler, ``TrainerState`` with its step,
    each rank's RNG states and data position), so training continues from its step, with
    the next batch, up to ``max_steps``.  ``include_rng``: also save the Python, NumPy,
    torch (and CUDA) RNG states of every rank.
    """

    def __init__(
        self,
        manager: CheckpointManager | ShardedCheckpointManager | str,
        *,
        replace_trainer_save: bool = False,
        resume: bool = False,
        include_rng: bool = True,
        weights_only: bool = True,
        **manager_options: Any,
    ) -> None:
        # torchrun and accelerate set RANK before the Trainer exists; on_train_begin checks
        # it against the Trainer's own world process zero.
        self._zero = os.environ.get("RANK", "0") == "0"
        self._root: str = manager if isinstance(manager, str) else manager.root
        self._options = dict(manager_options)
        self.manager: CheckpointManager | ShardedCheckpointManager | None
        # TrainingArguments(fsdp=...) and accelerate's FSDP config set this: the manager
        # then waits for on_train_begin, where the model says which one it needs.
        fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if not isinstance(manager, str):
            if manager_options:
                raise TypeError(f"manager options given with a {type(manager).__name__}")
            self.manager, self._owned = manager, False
        elif self._zero and not fsdp:
            self.manager, self._owned = CheckpointManager(self._root, **manager_options), True
        else:
            self.manager, self._owned = None, False
        self.replace_trainer_save = replace_trainer_save
        self.resume = resume
        self.include_rng = include_rng
        self.weights_only = weights_only
        self.restored_step: int | None = None
        self._saved: set[int] = set()
        self._pg: Any = None
        self._reader: TierReader | None = None
        #: The manager's :meth:`~fmstore.CheckpointManager.prepare`, started after the
        #: first step (when the optimizer's state exists), on world process zero.
        self.prepared: Any = None
        # Where the data is: the epoch being read and the batches taken from it.
        self._epoch = 0
        self._batches = 0
        self._loop_epochs = 0  # on_epoch_begin calls of this train()
        self._resume_at: tuple[int, int] | None = None  # (epoch, batch) to continue from
        self._rng: Any = None  # this rank's RNG states to set before the next batch

    # ---- saving ------------------------------------------------------------------------

    def _save(self, args: TrainingArguments, state: TrainerState, kwargs: dict[str, Any]) -> None:
        step = int(state.global_step)
        if step in self._saved:
            return  # saved already (the Trainer may save a step twice: on a step and at the end)
        self._saved.add(step)
        record: dict[str, Any] = {"data": {"epoch": self._epoch, "batch": self._batches}}
        if self.include_rng:
            record["rng"] = rank_state.rng_state()
        if isinstance(self.manager, ShardedCheckpointManager):  # every rank, its shards
            if self.restored_step is not None and step <= self.restored_step:
                return  # a step an earlier run saved
            part = _progress(state, kwargs.get("lr_scheduler"), int(getattr(args, "world_size", 1)))
            st = hf_sharded.state(kwargs["model"], kwargs.get("optimizer"), part, record)
            self.manager.save(step, st)
            return
        ranks = rank_state.gather(self._pg, record)  # every rank, at the same point
        if ranks is None:
            return  # not world process zero: rank 0 saves for it
        assert self.manager is not None
        if step in self.manager.steps():
            return  # a step an earlier run saved
        ckpt = training_state(
            kwargs["model"], kwargs.get("optimizer"), kwargs.get("lr_scheduler"), state,
            ranks=ranks,
        )  # fmt: skip
        self.manager.save(step, ckpt)

    def _take_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        kwargs: dict[str, Any],
    ) -> None:
        if self.replace_trainer_save and control.should_save:
            self._save(args, state, kwargs)
            control.should_save = False

    # ---- restoring ---------------------------------------------------------------------

    def _restore(
        self, args: TrainingArguments, state: TrainerState, kwargs: dict[str, Any]
    ) -> None:
        def reader() -> TierReader:
            if self._reader is None:
                full = self.manager if isinstance(self.manager, CheckpointManager) else None
                self._reader = TierReader.of(full, self._root, self._options)
            return self._reader

        rank = _rank()
        dl = kwargs.get("train_dataloader")
        if isinstance(self.manager, ShardedCheckpointManager):
            got = hf_sharded.restore(
                self.manager, kwargs["model"], kwargs.get("optimizer"), rank, self.weights_only
            )
            if got is None:
                return
            step, part, rec = got
            _load_progress(part, kwargs.get("lr_scheduler"), state)
            self.restored_step = step
            world = part["world_size"]
            self._position(args, state, world, rec, range(world), dl)
            return
        zero = self.manager if isinstance(self.manager, CheckpointManager) and self._zero else None
        ckpt = restore_on_every_rank(zero, self._pg, reader, self.weights_only)
        if ckpt is None:
            return
        _load_into(
            ckpt, kwargs["model"], kwargs.get("optimizer"), kwargs.get("lr_scheduler"), state
        )
        self.restored_step = int(ckpt["step"])
        saved = ckpt.get("world_size")
        saved = int(saved) if isinstance(saved, int) else (1 if "rng" in ckpt else None)
        have = [int(k) for k in ckpt.get("ranks", {"0": None}) if str(k).isdigit()]
        self._position(args, state, saved, _rank_record(ckpt, rank), have, dl)

    def _position(
        self,
        args: TrainingArguments,
        state: TrainerState,
        saved: int | None,
        rec: Any,
        have: Any,
        dl: Any,
    ) -> None:
        """This rank's data position and RNG states (``rec``, its saved record) to continue
        from; ``saved``: the saved world size, ``have``: the ranks with a saved record.  On
        another world size what could not be restored is said (world process zero warns,
        naming the ranks)."""
        rank = _rank()
        world = int(getattr(args, "world_size", 1))
        same = saved == world
        if same and isinstance(rec, dict) and isinstance(rec.get("data"), dict):
            data = rec["data"]
            e, b = data.get("epoch"), data.get("batch")
            if not (isinstance(e, int) and isinstance(b, int) and e >= 0 and b >= 0):
                raise CorruptData(f"ranks.{rank}.data: not an epoch and a batch")
        else:  # the Trainer's own reckoning from the step
            per = _steps_per_epoch(dl, _ga(args)) or 1
            g = int(state.global_step)
            e, b = g // per, (g % per) * _ga(args)
        self._resume_at = (e, b)
        if same and isinstance(rec, dict) and rec.get("rng") is not None:
            self._rng = (rec["rng"], f"ranks.{rank}.rng")
        if self._zero and saved != world:
            n = "an unknown number of" if saved is None else str(saved)
            msg = (
                f"step {self.restored_step} was saved on {n} rank(s) and resumes on {world}: "
                f"the RNG states of rank(s) {_ranges(range(world))} are not restored (they "
                f"keep their seeded states; the saved ones of rank(s) {_ranges(have) or 'none'} "
                f"are not used); each rank's data continues from epoch {e}, batch {b}, "
                "reckoned from the step, but the sampler shards the data differently, so "
                "the batches are not those the saved run would have read next"
            )
            log.warning("%s", msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _use_sharded(self, model: Any) -> None:
        """FSDP2: a ShardedCheckpointManager on every rank (the one given, or made here)."""
        if isinstance(self.manager, CheckpointManager) and self._owned:
            self.manager.close()  # made before the Trainer said FSDP: it saved nothing
            self.manager, self._owned = None, False
        hf_sharded.refuse_fsdp1(model)
        if isinstance(self.manager, ShardedCheckpointManager):
            return
        if isinstance(self.manager, CheckpointManager):
            raise FmstoreError(
                "the model is sharded (FSDP2) and FmstoreCallback was given a "
                "CheckpointManager, which saves a full state dict from one process: give the "
                "root (every rank then saves its shards through a ShardedCheckpointManager) "
                "or a ShardedCheckpointManager made on every rank"
            )
        # SIGTERM stays the Trainer's: nothing here asks the manager's flag.
        opts = {"handle_sigterm": False, **self._options}
        self.manager, self._owned = ShardedCheckpointManager(self._root, **opts), True

    def _use_full(self) -> None:
        """DDP or one process: world process zero's CheckpointManager."""
        if isinstance(self.manager, ShardedCheckpointManager):
            raise FmstoreError(
                "FmstoreCallback was given a ShardedCheckpointManager, but the model is not "
                "sharded (DDP or one process): give the root or a CheckpointManager"
            )
        if self.manager is None and self._zero:  # FSDP was configured, but not applied
            self.manager, self._owned = CheckpointManager(self._root, **self._options), True

    # ---- the Trainer's events ----------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if bool(state.is_world_process_zero) != self._zero:
            raise FmstoreError(
                f"RANK={os.environ.get('RANK')!r} when the callback was made, but the Trainer "
                f"says world process zero is {state.is_world_process_zero}: make the callback "
                "in the process that trains, after the launcher set RANK"
            )
        self._pg = _dist_group()  # a collective on first use: every rank is here
        if _is_sharded(kwargs["model"]):
            self._use_sharded(kwargs["model"])
        else:
            self._use_full()
        self._loop_epochs = 0
        self._epoch, self._batches = 0, 0
        if self.resume:
            self._restore(args, state, kwargs)

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The Trainer counts this run's epochs from 0: a resume shifts them to the saved
        # epoch and skips the batches already taken from it (the Trainer's own resume does
        # the same from its checkpoint directory).
        first = self._loop_epochs == 0
        shift, skip = self._resume_at or (0, 0)
        self._epoch = shift + self._loop_epochs
        self._batches = skip if first else 0
        self._loop_epochs += 1
        dl = kwargs.get("train_dataloader")
        if shift or skip:
            if dl is not None and hasattr(dl, "set_epoch") and hasattr(dl, "skip_batches"):
                dl.set_epoch(self._epoch)
                dl.skip_batches = self._batches
            elif first:
                warnings.warn(
                    "the Trainer's DataLoader cannot skip batches: the data order starts "
                    "again from the first batch",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if first and skip == 0 and self._rng is not None:
            # At an epoch's start the RNGs are set before its DataLoader starts (it draws
            # its base seed), as in the saved run.
            rank_state.apply_rng(*self._rng)
            self._rng = None

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._rng is not None:  # mid-epoch: after the DataLoader started, before the step
            rank_state.apply_rng(*self._rng)
            self._rng = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._batches += _ga(args)
        shift, skip = self._resume_at or (0, 0)
        if shift or skip:
            # The Trainer's epoch counts from this run's first epoch and batch.
            dl = kwargs.get("train_dataloader")
            n = len(dl) if dl is not None and hasattr(dl, "__len__") else 0
            first = skip / n if self._loop_epochs == 1 and n else 0.0
            state.epoch = (state.epoch or 0.0) + shift + first
        full = isinstance(self.manager, CheckpointManager)
        if self._zero and self.prepared is None and full and "model" in kwargs:
            assert isinstance(self.manager, CheckpointManager)
            # Staging memory and discovery off the stall of the first save.
            ckpt = training_state(
                kwargs["model"],
                kwargs.get("optimizer"),
                kwargs.get("lr_scheduler"),
                state,
                include_rng=self.include_rng,
            )
            self.prepared = self.manager.prepare(ckpt)
        self._take_save(args, state, control, kwargs)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._take_save(args, state, control, kwargs)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self.replace_trainer_save:
            self._save(args, state, kwargs)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        try:
            sharded = isinstance(self.manager, ShardedCheckpointManager)
            if self.manager is not None and (self._zero or sharded):
                self.manager.wait()
        finally:
            if self._owned and self.manager is not None:
                self.manager.close()
            if self._reader is not None:
                self._reader.close()
                self._reader = None


def _ranges(ranks: Any) -> str:
    """``0-3, 6`` for ranks 0, 1, 2, 3, 6."""
    out: list[str] = []
    rs = sorted(ranks)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)
