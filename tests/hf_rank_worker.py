"""Run under ``torchrun --nproc-per-node=2`` by tests/test_stack_hf.py (gloo, CPU): a tiny
GPT-2 trained by transformers' own ``Trainer`` under DDP, saving through fmstore.

The training script is stock ``Trainer`` usage plus the one documented line (the
``FmstoreCallback`` in ``callbacks``); ``_Probe`` is the test's instrument only: it records
each rank's loss of every step (exact, from a forward hook), dumps the state a rank trains
the next step from (``ref``: at the step given; ``resume``: the first step), and in
``kill`` mode stops before the step after ``--at`` so the test can SIGKILL the launch once
that step is committed.

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
import transformers

from fmstore.integrations.hf import FmstoreCallback

MAX_STEPS = 9


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 16, length: int = 8, vocab: int = 50) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _rng() -> dict:
    v, words, gauss = random.getstate()
    kind, key, pos, hg, cached = np.random.get_state()
    return {
        "python": torch.tensor(words, dtype=torch.int64),
        "numpy": torch.from_numpy(key.astype(np.int64)),
        "numpy_pos": pos,
        "torch": torch.get_rng_state(),
    }


class _Probe(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, mode: str, out: str, at: int, fm: FmstoreCallback) -> None:
        self.mode, self.out, self.at, self.fm = mode, out, at, fm
        self.rank = int(os.environ["RANK"])
        self.losses: dict[int, float] = {}
        self.step = 0
        self.first = True

    def hook(self, model, inputs, output) -> None:  # type: ignore[no-untyped-def]
        if model.training:
            self.losses[self.step] = float(output.loss.detach())

    def on_train_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        # Distinct RNGs on each rank (and another seed on resume): only the checkpoint's
        # per-rank states can make the resumed steps match.
        seed = 1000 * (self.mode == "resume") + self.rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def on_step_begin(
        self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw
    ):  # type: ignore[no-untyped-def]
        self.step = state.global_step + 1
        first, self.first = self.first, False
        if self.mode == "kill" and state.global_step == self.at:
            threading.Event().wait()  # until the test kills the launch
        if (self.mode == "ref" and state.global_step == self.at) or (
            self.mode == "resume" and first
        ):
            torch.save(
                {
                    "step": state.global_step,
                    "epoch": state.epoch,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": lr_scheduler.state_dict(),
                    "rng": _rng(),
                    "tier": self.fm.manager.restored_tier if self.fm.manager else None,
                },
                os.path.join(self.out, f"{self.mode}-state-{self.rank}.pt"),
            )

    def on_train_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        with open(os.path.join(self.out, f"{self.mode}-losses-{self.rank}.json"), "w") as f:
            json.dump({str(k): v for k, v in self.losses.items()}, f)


def main() -> None:
    mode, out, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
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
    trainer.train()


if __name__ == "__main__":
    main()
