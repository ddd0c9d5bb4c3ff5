"""Run under ``torchrun --nproc-per-node=2`` by tests/test_stack_hf.py (gloo, CPU): a
tiny GPT-2 trained by transformers' own ``Trainer`` with FSDP2 (``fsdp="full_shard
auto_wrap"``, ``FSDP_VERSION=2`` in the environment as ``accelerate launch`` sets it),
saving through fmstore.

The training script is stock ``Trainer`` usage plus the one documented line (the
``FmstoreCallback``), and :func:`_fsdp_on_cpu`, which only a CPU needs: Accelerate turns
FSDP on for accelerator devices only.  ``_Probe`` is the test's instrument: each rank's loss
of every step, the state a rank trains the next step from (its own shards, and the full
state gathered), and in ``kill`` mode a stop before the step after ``AT`` once that step's
save is committed (``waiting-R`` then says so).

``MODE OUT AT``: ``ref`` | ``kill`` | ``resume``; OUT: where the instrument writes.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import hf_rank_worker
import torch
import transformers
from hf_rank_worker import Tokens, _rng
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from fmstore.integrations.hf import FmstoreCallback

MAX_STEPS = 9


def _fsdp_on_cpu(trainer: transformers.Trainer) -> None:
    """What Accelerate sets on an accelerator device, set on CPU: there its state is
    ``MULTI_CPU`` and the FSDP plugin built from the arguments' ``FSDP_*`` variables is
    dropped (``accelerate/state.py`` attaches it only for the GPU-like types).  The rest of
    the Trainer's FSDP2 path runs as it does on a GPU: Accelerate's ``fsdp2_prepare_model``
    shards the model, and the Trainer's callbacks see what they see there."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def _local(v: Any) -> Any:
    if isinstance(v, DTensor):
        return v.to_local().clone()
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _local(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_local(x) for x in v]
    return v


class _Probe(hf_rank_worker._Probe):
    """The DDP worker's instrument (losses, per-rank seeds), dumping shards and full state."""

    def on_step_begin(
        self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw
    ):  # type: ignore[no-untyped-def]
        self.step = state.global_step + 1
        first, self.first = self.first, False
        if self.mode == "kill" and state.global_step == self.at:
            self.fm.manager.wait()  # step AT committed and recorded for the daemon
            open(os.path.join(self.out, f"waiting-{self.rank}"), "w").close()
            threading.Event().wait()  # until the test kills the launch
        if (self.mode == "ref" and state.global_step == self.at) or (
            self.mode == "resume" and first
        ):
            opt = optimizer.optimizer  # the torch optimizer inside Accelerate's wrapper
            full = StateDictOptions(full_state_dict=True)
            rng = _rng()  # before anything below could draw
            torch.save(
                {
                    "step": state.global_step,
                    "epoch": state.epoch,
                    "shards": _local(get_model_state_dict(model)),
                    "optimizer": _local(get_optimizer_state_dict(model, opt)),
                    "full_model": get_model_state_dict(model, options=full),
                    "full_optimizer": _local(get_optimizer_state_dict(model, opt, options=full)),
                    "scheduler": lr_scheduler.state_dict(),
                    "rng": rng,
                    "tier": self.fm.manager.restored_tier,
                    "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
                },
                os.path.join(self.out, f"{self.mode}-state-{self.rank}.pt"),
            )


def main() -> None:
    mode, out, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)  # the same initial weights on every rank (no sync_module_states)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)  # dropout on: every rank's RNG matters
    args = transformers.TrainingArguments(
        output_dir="hf-out",
        max_steps=MAX_STEPS,
        save_strategy="steps",
        save_steps=2,
        per_device_train_batch_size=2,
        use_cpu=True,
        ddp_backend="gloo",
        fsdp="full_shard auto_wrap",
        # sync_module_states broadcasts from a device: none on CPU
        fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"], "sync_module_states": False},
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
    )
    fm = FmstoreCallback("runs/hf", replace_trainer_save=True, resume=True)  # the one line
    probe = _Probe(mode, out, at, fm)
    model.register_forward_hook(probe.hook)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[fm, probe]
    )
    _fsdp_on_cpu(trainer)
    trainer.train()


if __name__ == "__main__":
    main()
