"""The demo's training process: ``python -m fmstore.demo.train --config fmstore.toml …``.

Streams token sequences from S3 through the nvme cache, trains the tiny GPT, and hands every
K-th step's full state (model, optimizer, LR scheduler, RNG states, data position) to
``CheckpointManager``.  On start it resumes from the newest complete checkpoint on any tier.
``--kill-at STEP`` sends itself SIGKILL right after that step, as a crash would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import CheckpointManager
from ..config import load_config
from ..loaders import StreamingDataLoader, StreamingDataset
from .corpus import VOCAB
from .model import GPT


def lr_lambda(total: int, warmup: int = 20):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return f


def state_hash(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 over every parameter and optimizer-moment byte (the bit-identical check)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            if torch.is_tensor(v):
                h.update(f"{pid}.{k}".encode())
                h.update(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fmstore.demo.train", description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--data", default="s3:datasets/corpus")
    ap.add_argument("--root", default="runs/demo", help="checkpoint root on every tier")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--log", required=True, help="JSON-lines file for step metrics (appended)")
    ap.add_argument("--policies", action="store_true", help="run policies in-process (no daemon)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)  # deterministic kernels, and a core left for the daemon
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    cfg = load_config(args.config)
    cache = os.path.join(cfg.tier("nvme").url, "cache")
    ds = StreamingDataset(
        args.data, cache, seq_len=args.ctx, shuffle=True, seed=args.seed, batch_size=args.batch
    )
    # The loader draws its workers' base seed from its own generator, not from the global
    # RNG that dropout uses: otherwise re-creating the iterator on resume would shift it.
    loader = StreamingDataLoader(
        ds,
        batch_size=args.batch,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(args.seed),
    )
    model = GPT(VOCAB, args.ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.steps))
    log = Path(args.log).open("a")

    def emit(**rec: Any) -> None:
        log.write(json.dumps({"t": time.time(), "pid": os.getpid(), **rec}) + "\n")
        log.flush()

    start, epoch = 0, 0
    with CheckpointManager(args.root, config=cfg, run_policies=args.policies) as mgr:
        if mgr.latest_step() is not None:
            t0 = time.perf_counter()
            state = mgr.restore()
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            sched.load_state_dict(state["sched"])
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])
            np.random.set_state(state["rng"]["numpy"])
            epoch = state["epoch"]
            ds.set_epoch(epoch)
            loader.load_state_dict(state["data"])
            start = state["step"] + 1
            emit(
                event="restore",
                step=state["step"],
                tier=[mgr.restored_tier],
                seconds=time.perf_counter() - t0,
            )
        else:
            ds.set_epoch(epoch)
        it = iter(loader)
        model.train()
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                epoch += 1
                ds.set_epoch(epoch)
                it = iter(loader)
                batch = next(it)
            x = (
                torch.as_tensor(np.asarray(batch)).long()
                if not torch.is_tensor(batch)
                else batch.long()
            )
            _, loss = model(x[:, :-1], x[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step_time = time.perf_counter() - t0
            rec: dict[str, Any] = {
                "event": "step",
                "step": step,
                "loss": loss.item(),
                "step_time": step_time,
            }
            if (step + 1) % args.ckpt_every == 0 or step == args.steps - 1:
                state = {
                    "model": model.state_dict(),
                    "optim": opt.state_dict(),
                    "sched": sched.state_dict(),
                    "rng": {
                        "torch": torch.get_rng_state(),
                        "python": random.getstate(),
                        "numpy": np.random.get_state(),
                    },
                    "data": loader.state_dict(),
                    "epoch": epoch,
                    "step": step,
                }
                t1 = time.perf_counter()
                mgr.save(step, state)
                rec["ckpt_stall"] = time.perf_counter() - t1
            emit(**rec)
            if step == args.kill_at:  # a crash: saves in flight are lost with the process
                os.kill(os.getpid(), signal.SIGKILL)
        mgr.wait()
    emit(event="done", step=args.steps - 1, hash=state_hash(model, opt))


if __name__ == "__main__":
    main()
