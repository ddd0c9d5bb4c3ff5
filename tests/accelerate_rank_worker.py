"""Run under ``torchrun --nproc-per-node=2`` by tests/test_stack_accelerate.py (gloo, CPU):
a tiny model trained by Accelerate's own loop (``Accelerator.prepare``,
``accelerator.backward``, a DataLoader with a seedable sampler, an LR scheduler, an object
registered for checkpointing), saving with ``accelerator.save_state`` every 2 steps.

The training script is stock Accelerate usage plus the one documented line
(``fmstore.integrations.accelerate.attach(accelerator)``) and tier URLs where Accelerate
takes a directory.  The rest is the test's instrument: per-rank RNG seeds (another one on
resume, so only the checkpoint can make the steps match), each rank's loss of every step,
the state a rank trains the next step from (``ref``: right after step AT; ``resume``: right
after ``load_state``), and in ``kill`` mode a stop before the step after AT so the test can
SIGKILL the launch once AT is committed and exported.

``MODE OUT AT``: ``ref`` | ``kill`` | ``resume``; OUT: where the instrument writes.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading

import numpy as np
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed

import fmstore.integrations.accelerate as fmstore_accelerate

MAX_STEPS = 11
RUN = "nvme:runs/acc"


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )  # dropout: every rank's RNG matters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Seen:
    """An object registered for checkpointing: how many batches this run trained on."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, sd: dict) -> None:
        self.batches = int(sd["batches"])


def _rng() -> dict:
    v, words, gauss = random.getstate()
    kind, key, pos, hg, cached = np.random.get_state()
    return {
        "python": torch.tensor(words, dtype=torch.int64),
        "numpy": torch.from_numpy(key.astype(np.int64)),
        "numpy_pos": pos,
        "torch": torch.get_rng_state(),
    }


def _dump(path, accelerator, model, opt, sched, dl, seen, step) -> None:  # type: ignore[no-untyped-def]
    sampler = dl.get_sampler()
    torch.save(
        {
            "step": step,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "rng": _rng(),
            "seen": seen.batches,
            "accelerator_step": accelerator.step,
            "iteration": dl.iteration,
            "sampler": (sampler.initial_seed, sampler.epoch),
        },
        path,
    )


def main() -> None:
    mode, out, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    fmstore_accelerate.attach(accelerator)  # the one line
    set_seed(1000 * (mode == "resume"))
    g = torch.Generator().manual_seed(0)  # the data: the same in every launch
    data = torch.utils.data.TensorDataset(
        torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g)
    )
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    dl = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)  # 6 batches a rank
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    seen = Seen()
    accelerator.register_for_checkpointing(seen)

    rank = accelerator.process_index  # the instrument: distinct RNGs on each rank
    seed = 1000 * (mode == "resume") + rank + 1
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    step, start_epoch, skip = 0, 0, 0
    if mode == "resume":
        step = accelerator.load_state(RUN)  # the newest good step, from any tier
        start_epoch, skip = divmod(step, len(dl))
        _dump(
            os.path.join(out, f"resume-state-{rank}.pt"),
            accelerator,
            model,
            opt,
            sched,
            dl,
            seen,
            step,
        )

    losses: dict[str, float] = {}
    for _epoch in range(start_epoch, 3):
        active = accelerator.skip_first_batches(dl, skip) if skip else dl
        skip = 0
        for x, y in active:
            if step >= MAX_STEPS:
                break
            if mode == "kill" and step == at:
                threading.Event().wait()  # until the test kills the launch
            model.train()
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            seen.batches += 1
            losses[str(step)] = float(loss.detach())
            if step % 2 == 0:
                accelerator.save_state(f"{RUN}/step_{step}")
            if mode == "ref" and step == at:
                _dump(
                    os.path.join(out, f"ref-state-{rank}.pt"),
                    accelerator,
                    model,
                    opt,
                    sched,
                    dl,
                    seen,
                    step,
                )
    with open(os.path.join(out, f"{mode}-losses-{rank}.json"), "w") as f:
        json.dump(losses, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
