"""torchtitan's checkpoint manager, through fmstore.

One line of torchtitan's configuration (its config registry, or ``Trainer.Config``)::

    checkpoint=FmstoreCheckpointManager.Config(enable=True, folder="nvme:runs/llama3", interval=500)

The trainer builds whatever ``Trainer.Config.checkpoint`` holds and drives it with
``load(step=...)``, ``save(step, last_step=...)``, ``maybe_wait_for_staging()`` and
``close()``.  Every step is one fmstore DCP checkpoint ``step_NNNNNNNNNNNN`` of a
:class:`~fmstore.tiering.managers.sharded.ShardedCheckpointManager`: the model and optimizer shards
*and* the rest of torchtitan's state (``train_state``, ``lr_scheduler``, ``dataloader``)
under one commit, recorded for the daemon, which exports, retains and releases it by
``[policies]`` (torchtitan's own ``rmtree`` purge is not used).  ``load`` restores the
newest step committed on any tier of the ladder, from the fastest that holds it for every
rank.  See docs/integrations.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import logging
import pickle
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)

from ..config import Config as FmConfig
from ..config import get_config, load_config
from ..errors import ConfigError, CorruptData, NotSupported
from ..stores.location import split_tier

__all__ = ["FmstoreCheckpointManager"]

log = logging.getLogger("fmstore.integrations")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
#: torchtitan fields whose files would be written or read outside fmstore: refused.
_REFUSED = {
    "initial_load_path": "an initial checkpoint outside fmstore (a native DCP directory)",
    "initial_load_in_hf": "Hugging Face safetensors written and read outside fmstore",
    "initial_load_in_hf_quantized": "Hugging Face safetensors read outside fmstore",
    "last_save_in_hf": "Hugging Face safetensors written outside fmstore",
}


class FmstoreCheckpointManager(BaseCheckpointManager):
    """A torchtitan checkpoint manager whose steps are fmstore checkpoints (see the module).

    ``folder`` is ``TIER:ROOT`` (a tier of ``fmstore.toml`` to write to) or ``ROOT`` (the
    write tier of ``[policies]``); the trainer's ``dump_folder`` is not prefixed: a tier
    URL never becomes a local directory name.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        keep_latest_k: int = 0
        """Refused unless 0: retention is fmstore's ``[policies.retention.TIER]``."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``disabled``: ``save`` returns once committed; ``async``: once staged into
        fmstore's stager (buffers reused by every save), written in the background;
        ``async_with_pinned_mem``: the same, the stager's buffers pinned (where CUDA is)."""

        fmstore_config: str | None = None
        """``fmstore.toml`` to use (default: the usual lookup)."""

        write_options: dict[str, Any] = field(default_factory=dict)
        """:class:`fmstore.checkpoint.dcp.WriteOptions` fields (``compression``, ...)."""

        allow_pickle: bool = False
        """Hand the dataloader a state pickle that holds objects other than plain values
        (only for checkpoints you trust: unpickling runs code)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ConfigError(f"checkpoint.async_mode {self.async_mode!r} is not one")
            for name, what in _REFUSED.items():
                if getattr(self, name):
                    raise NotSupported(
                        f"checkpoint.{name} is not supported by FmstoreCheckpointManager: "
                        f"{what}; every checkpoint it reads and writes is an fmstore one"
                    )
            if self.keep_latest_k:
                raise NotSupported(
                    f"checkpoint.keep_latest_k={self.keep_latest_k} is not supported by "
                    "FmstoreCheckpointManager: retention is fmstore's (set "
                    "[policies.retention.TIER] keep_latest in fmstore.toml; keep_latest_k=0)"
                )
            _check_folder(self.folder)

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: cf.Future[Any] | None = None
        if not self.enable:
            return
        from ..checkpoint.dcp import Stager
        from ..tiering.managers.sharded import ShardedCheckpointManager
        from ..tiering.policy.rules import from_config

        self.config = config
        cfg = _fmstore_config(config.fmstore_config)
        tier, root = split_tier(config.folder, cfg)
        ladder = list(from_config(cfg).ladder)
        if tier is not None and tier not in ladder:
            ladder = [tier, *ladder]
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers})
        if lr_schedulers is not None:
            self.states[LR_SCHEDULER] = lr_schedulers
        if dataloader is not None:
            self.states[DATALOADER] = _CheckedLoader(dataloader, config.allow_pickle)
        self.export_dtype = _DTYPES[config.export_dtype]
        self.pinned = config.async_mode == "async_with_pinned_mem"
        self.manager = ShardedCheckpointManager(
            root,
            config=cfg,
            write_tier=tier,
            ladder=ladder,
            # pinned where CUDA is (a CPU job has nothing to pin)
            stager=Stager(pin_memory=None if self.pinned else False),
            write_options=config.write_options,
            handle_sigterm=False,  # torchtitan decides when to save; SIGTERM ends it
        )
        self.staging_future: cf.Future[Any] | None = None
        log.info("checkpoints of %s saved to %s", root, self.manager.write_tier)

    # ---- names -----------------------------------------------------------------------

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """The fmstore location of ``step``: ``TIER:ROOT/step_NNNNNNNNNNNN``."""
        return self.manager.uri(self.manager.write_tier, step)

    def _find_load_step(self, folder: str = "") -> int:
        """Every rank: the newest step committed on any tier of the ladder, or -1."""
        step = self.manager.latest_step()
        return -1 if step is None else step

    # ---- saving ----------------------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        c = self.config
        if c.load_only:
            return False
        if curr_step == 1 and c.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _flattened(self, states: dict[str, Any]) -> dict[str, Any]:
        """The model's tensors at the top level (as torchtitan saves them), the rest as is."""
        sd = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            sd.update(states[MODEL].state_dict())
        return sd

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step and self.config.last_save_model_only:
            # the final model, in export_dtype, as torchtitan's last step saves it
            dt = self.export_dtype
            states = {
                k: v.to(dt) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in self.states[MODEL].state_dict().items()
            }
        else:
            states = self._flattened(self.states)
        fut = self.manager.save(curr_step, states)  # returns once staged
        if last_step or self.config.async_mode == "disabled":
            self.manager.wait()  # committed (and recorded) when save returns
            return True
        self.save_future = fut
        if self.pinned:
            # fmstore's stager copies before save returns: the staging is done
            self.staging_future = cf.Future()
            self.staging_future.set_result(None)
        return True

    def _maybe_wait_for_staging(self) -> None:
        if self.staging_future is not None:
            self.staging_future.result()
            self.staging_future = None

    def _wait_for_saving(self) -> None:
        self.save_future = None
        self.manager.wait()  # fmstore's own error, on every rank alike

    # ---- loading ---------------------------------------------------------------------

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return dict(self.states[MODEL].state_dict())
        for k in self.config.exclude_from_loading:
            if k not in self.states:
                raise ValueError(f"checkpoint.exclude_from_loading: {k} not found in state_dict")
        keep = {k: v for k, v in self.states.items() if k not in self.config.exclude_from_loading}
        return self._flattened(keep)

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Every rank: restore ``step`` (-1: the newest committed on any tier) from the
        fastest tier that holds it for every rank; False on a fresh start."""
        newest = self._find_load_step() if step == -1 else step
        if newest == -1:
            log.info("no checkpoint of %s on any tier: a fresh start", self.manager.root)
            return False
        states = self._states_to_load(model_only=newest == 0)  # step 0: a seed checkpoint
        got = self.manager.restore(states, step=None if step == -1 else step)
        if got is None:
            return False
        self.states[MODEL].load_state_dict(states)
        log.info("restored step %d from %s", got, self.manager.restored_tier)
        return True

    def _close(self) -> None:
        self.manager.close()


class _CheckedLoader(Stateful):
    """torchtitan's dataloader, whose state is a pickle per data-parallel rank: a restored
    pickle reaches it only when it holds plain values (no class, no callable), unless
    ``allow_pickle``; the checkpoint is outside input."""

    def __init__(self, loader: Any, allow_pickle: bool) -> None:
        self.loader = loader
        self.allow_pickle = allow_pickle

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.allow_pickle:
            for k, v in state_dict.items():
                if isinstance(v, bytes):
                    _plain_pickle(v, f"{DATALOADER}.{k}")
        self.loader.load_state_dict(state_dict)


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}")


def _plain_pickle(data: bytes, what: str) -> None:
    """Raise :class:`CorruptData` unless ``data`` unpickles to plain values only (dicts,
    lists, tuples, sets, strings, numbers, bytes, None: nothing is looked up or called)."""
    try:
        _NoGlobals(io.BytesIO(data)).load()
    except Exception as e:
        raise CorruptData(
            f"{what} is a pickle that holds more than plain values ({type(e).__name__}: "
            f"{str(e)[:200]}); refusing to hand it to the dataloader (allow_pickle=True in "
            "the checkpoint config for a checkpoint you trust)"
        ) from None


def _check_folder(folder: str) -> None:
    """``TIER:ROOT`` or ``ROOT``, judged from the text (the tier is checked against
    ``fmstore.toml`` when the manager is built): never a local path or another URL."""
    f = folder.strip()
    if f.startswith(("/", ".", "~")) or "://" in f or "\\" in f:
        raise ConfigError(
            f"checkpoint.folder {folder!r} is not an fmstore run: give TIER:ROOT (a tier of "
            "fmstore.toml, like 'nvme:runs/llama3') or ROOT (written to the [policies] write tier)"
        )


def _fmstore_config(path: str | None) -> FmConfig:
    return get_config() if path is None else load_config(path)
