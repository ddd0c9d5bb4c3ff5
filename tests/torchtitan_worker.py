"""torchtitan's checkpoint manager driven the way torchtitan's ``Trainer.train`` drives it
(``load(step=...)``, then per step ``maybe_wait_for_staging()`` before the optimizer step and
``save(step, last_step=...)`` after it, ``close()`` at the end), on 2 gloo ranks with an FSDP2
model and torchtitan's own optimizer, LR scheduler and dataloader containers.  The one line
that differs from stock torchtitan is the checkpoint config (``FmstoreCheckpointManager.Config``
in place of ``CheckpointManager.Config``).  torchtitan's ``Trainer`` itself needs CUDA.

``MODE RUN OUT ASYNC``: ``ref`` trains 7 steps uninterrupted; ``kill`` trains, and once step
4 is saved and committed says so (``OUT/waiting_RANK``) and waits for its SIGKILL; ``resume``
loads the newest committed step and trains to step 7.  Each writes the state it saved (or
restored) at step 4 and every step's loss.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    default_adamw,
)

from fmstore.integrations.torchtitan import FmstoreCheckpointManager

MODE, RUN, OUT, ASYNC = sys.argv[1:5]
STEPS, AT = 7, 4


class Data(IterableDataset):  # type: ignore[type-arg]
    """An endless stream per data-parallel rank, whose position is its state."""

    def __init__(self, rank: int) -> None:
        self.rank, self.i = rank, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.i)
            self.i += 1
            x = torch.randn(8, generator=g)
            yield x, x.sum(0, keepdim=True)

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, s: dict) -> None:
        self.i = s["i"]


class TrainState(Stateful):
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, s: dict) -> None:
        self.step, self.ntokens_seen = s["step"], s["ntokens_seen"]


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(model, optimizers, lr, loader, ts) -> dict:  # type: ignore[no-untyped-def]
    opt = optimizers.optimizers[0]
    return {
        "step": ts.step,
        "ntokens_seen": ts.ntokens_seen,
        "model": {k: local(v) for k, v in model.state_dict().items()},
        "optim": {
            n: {k: local(v) for k, v in opt.state[p].items()} for n, p in model.named_parameters()
        },
        "lr": lr.state_dict(),
        "lrs": [g["lr"] for g in opt.param_groups],
        "data": loader.dataset.state_dict(),
    }


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=default_adamw(lr=0.05).param_groups, implementation="for-loop"
    ).build(model_parts=[model])
    lr = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=STEPS
    )
    loader = ParallelAwareDataloader(Data(rank), dp_rank=rank, dp_world_size=2, batch_size=4)
    ts = TrainState()
    checkpointer = FmstoreCheckpointManager.Config(
        enable=True, folder=RUN, interval=2, async_mode=ASYNC
    ).build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr,
        states={"train_state": ts},
        sd_adapter=None,
        base_folder=f"{OUT}/dump",
    )

    checkpointer.load(step=-1)
    batches = iter(loader)  # where the restored dataloader state takes effect
    if MODE == "resume":
        torch.save(snapshot(model, optimizers, lr, loader, ts), f"{OUT}/restored_{rank}.pt")
        with open(f"{OUT}/restored_from_{rank}", "w") as f:
            f.write(f"{checkpointer.manager.restored_tier}")
    losses: dict[int, float] = {}
    while ts.step < STEPS:
        ts.step += 1
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses[ts.step] = loss.item()
        ts.ntokens_seen += x.numel()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr.step()
        optimizers.zero_grad()
        checkpointer.save(ts.step, last_step=ts.step == STEPS)
        if ts.step == AT and MODE != "resume":
            torch.save(snapshot(model, optimizers, lr, loader, ts), f"{OUT}/{MODE}_{rank}.pt")
        if ts.step == AT and MODE == "kill":
            checkpointer.maybe_wait_for_saving()  # committed and recorded
            with open(f"{OUT}/waiting_{rank}", "w") as f:
                f.write(str(os.getpid()))
            threading.Event().wait()
    checkpointer.close()
    with open(f"{OUT}/losses_{MODE}_{rank}.json", "w") as f:
        json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
