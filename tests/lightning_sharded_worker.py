"""A stock Lightning FSDP2 (ModelParallelStrategy) training script on 2 gloo ranks, but for
the fmstore strategy and checkpoint callback (the documented lines).

``MODE RUN OUT``: ``kill`` first trains 7 steps uninterrupted without checkpoints (the
reference: every step's loss), then trains again from the same seed saving every 2 steps,
writes the state it saved at step 4 (each rank's shards) and waits forever after step 4's
save (the test SIGKILLs it once step 4's manifest is committed); ``resume`` fits with
``ckpt_path="last"`` to step 7, writing the state it restored and the losses after it.
RUN is the checkpoint dirpath (a tier URL).  Lightning is imported once per launch: its
import is most of a launch's time.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import pytorch_lightning as pl
import torch
from torch import nn

from fmstore.integrations.lightning import FmstoreModelCheckpoint, FmstoreModelParallelStrategy

MODE, RUN, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
PHASE = MODE  # "ref" during the kill launch's reference fit
RANK = int(os.environ["RANK"])


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(trainer: pl.Trainer, module: pl.LightningModule) -> dict:
    opt = trainer.optimizers[0]
    return {
        "step": trainer.global_step,
        "model": {k: local(v) for k, v in module.state_dict().items()},
        "optim": {
            n: {k: local(v) for k, v in opt.state[p].items()} for n, p in module.named_parameters()
        },
    }


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))
        self.losses: dict[int, float] = {}

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step + 1] = loss.item()
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class Probe(pl.Callback):
    def on_train_start(self, trainer, module):  # type: ignore[no-untyped-def]
        if PHASE == "resume":
            torch.save(snapshot(trainer, module), f"{OUT}/restored_{RANK}.pt")

    def on_train_batch_start(self, trainer, module, batch, idx):  # type: ignore[no-untyped-def]
        if PHASE == "kill" and trainer.global_step == 4:
            # step 4 is saved and step 2 removed: say so, and wait for the SIGKILL
            open(f"{OUT}/waiting_{RANK}", "w").close()
            threading.Event().wait()

    def on_train_batch_end(self, trainer, module, out, batch, idx):  # type: ignore[no-untyped-def]
        # callbacks run before ModelCheckpoint: this is the state it saves next
        if PHASE == "kill" and trainer.global_step == 4:
            torch.save(snapshot(trainer, module), f"{OUT}/saved_{RANK}.pt")


def fit(phase: str) -> None:
    global PHASE
    PHASE = phase
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)  # 4 steps an epoch: step 4 ends one
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    pl.seed_everything(3)
    ckpt = FmstoreModelCheckpoint(dirpath=RUN, every_n_train_steps=2, save_last=True)
    saving = phase != "ref"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FmstoreModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=7 if phase != "kill" else 100,
        callbacks=[Probe(), ckpt] if saving else [Probe()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=saving,
    )
    model = Tiny()
    trainer.fit(model, loader, ckpt_path="last" if phase == "resume" else None)
    if RANK == 0:
        with open(f"{OUT}/losses_{phase}.json", "w") as f:
            json.dump(model.losses, f)


def main() -> None:
    if MODE == "kill":
        fit("ref")
    fit(MODE)


if __name__ == "__main__":
    main()
