"""One rank of the cluster demo's job, run by ``torchrun`` on every node:
``python -m torch.distributed.run --nnodes=N ... -m fmstore.demo.cluster_train --out DIR ...``.

Trains the demo's tiny GPT sharded with FSDP2 over every rank (gloo, CPU; no dropout, and
each step's batch drawn from the step number alone, so a run's weights are a function of
the step it resumed from: an interrupted run ends bit-identical to an uninterrupted one),
and saves every ``--ckpt-every`` steps to the node-local ``nvme`` tier through
:class:`~fmstore.tiering.managers.sharded.ShardedCheckpointManager`.  On start it restores the newest
step every rank can read (from every tier of the ladder).

The shared tiers get their copies from each node's ``fmstore daemon`` exporting its own
part (the demo and the kill schedule run one per node).  ``--shared-every K`` (and
``--s3-every``) instead saves every K-th step straight to ``lustre`` (``s3``) with a
second manager, for runs without daemons.

What it reports, for the demo and the tests (``--out``):

* ``events.jsonl`` (rank 0): ``restore`` (step, tier, seconds, the newer steps it moved
  aside to redo them; step None on a fresh start), ``save`` (step, stall:
  the seconds ``save()`` held training), ``committed`` (step, tier, seconds until the
  commit), ``step`` (loss), ``done`` (the final step);
* ``hash/STEP-RANK``: SHA-256 of the rank's shards of model and optimizer at every saved
  step.  A rank that saves a step again (after a resume) or restores one checks its
  state against the hash recorded first; on a difference it writes ``MISMATCH-STEP-RANK``
  and exits non-zero;
* ``final-RANK.json``: the rank's hash after the last step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..testing.cluster import pg_timeout
from ..tiering.managers.sharded import ShardedCheckpointManager
from .corpus import VOCAB, make_text, tokenize
from .model import GPT


def read_events(out: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events a job wrote to ``OUT/events.jsonl`` so far (a line cut short by a kill is
    left out)."""
    try:
        text = (Path(out) / "events.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def make_model(ctx: int, d: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1234)
    model = GPT(VOCAB, ctx, d=d, layers=2, heads=4, dropout=0.0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"step": step}}


def local_hash(sd: dict[str, Any]) -> str:
    """SHA-256 over this rank's shard of every tensor (and every other value) of ``sd``."""
    h = hashlib.sha256()

    def walk(x: Any, name: str) -> None:
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{name}.{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{name}.{i}")
        elif isinstance(x, torch.Tensor):
            t = x.to_local() if hasattr(x, "to_local") else x
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{name}={x!r}".encode())

    walk(sd, "")
    return h.hexdigest()


def check_hash(out: Path, step: int, rank: int, digest: str, what: str) -> None:
    """Record the hash of ``step`` on ``rank`` the first time; after that, it must match."""
    path = out / "hash" / f"{step}-{rank}"
    if path.exists():
        first = path.read_text()
        if first != digest:
            msg = f"rank {rank}: {what} step {step} differs from its first save"
            (out / f"MISMATCH-{step}-{rank}").write_text(msg)
            raise SystemExit(msg)
        return
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(digest)
    os.replace(tmp, path)


def batch(tokens: torch.Tensor, step: int, rank: int, size: int, ctx: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    starts = torch.randint(0, len(tokens) - ctx - 1, (size,), generator=g)
    return torch.stack([tokens[s : s + ctx + 1] for s in starts.tolist()])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fmstore.demo.cluster_train", description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--root", default="runs/cluster")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--shared-every", type=int, default=0, help="also save to lustre (0: never)")
    ap.add_argument("--s3-every", type=int, default=0, help="also save to s3 (0: never)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--sentences", type=int, default=2000)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = Path(args.out)
    (out / "hash").mkdir(parents=True, exist_ok=True)

    dist.init_process_group("gloo", timeout=pg_timeout())
    try:
        ckpt = dist.new_group(backend="gloo", timeout=pg_timeout())
        rank = dist.get_rank()
        launch = os.environ.get("TORCHELASTIC_RUN_ID", "")
        log = (out / "events.jsonl").open("a") if rank == 0 else None

        def emit(**rec: Any) -> None:
            if log is not None:
                log.write(json.dumps({"t": time.time(), "launch": launch, **rec}) + "\n")
                log.flush()

        tokens = torch.from_numpy(tokenize(make_text(args.sentences)).astype("int64"))
        model, opt = make_model(args.ctx, args.dim)
        mgr = ShardedCheckpointManager(args.root, process_group=ckpt, write_tier="nvme")
        shared = {
            tier: (every, ShardedCheckpointManager(args.root, process_group=ckpt, write_tier=tier))
            for tier, every in (("lustre", args.shared_every), ("s3", args.s3_every))
            if every
        }
        t0 = time.perf_counter()
        sd = state_of(model, opt, 0)
        start = mgr.restore(sd)
        if start is not None:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            check_hash(out, start, rank, local_hash(state_of(model, opt, start)), "restored")
        emit(
            ev="restore",
            step=start,
            tier=mgr.restored_tier if start is not None else None,
            seconds=time.perf_counter() - t0,
            moved_aside=mgr.moved_aside,
            nodes=dist.get_world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        )

        model.train()
        inflight: list[tuple[int, str, float, Any]] = []
        for step in range((start or 0) + 1, args.steps + 1):
            x = batch(tokens, step, rank, args.batch, args.ctx)
            _, loss = model(x[:, :-1], x[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            emit(ev="step", step=step, loss=loss.item())
            if step % args.ckpt_every:
                continue
            sd = state_of(model, opt, step)
            check_hash(out, step, rank, local_hash(sd), "saved")
            for tier, (every, m) in [("nvme", (1, mgr)), *shared.items()]:
                if (step // args.ckpt_every) % every:
                    continue
                t1 = time.perf_counter()
                fut = m.save(step, sd)
                stall = time.perf_counter() - t1
                emit(ev="save", step=step, tier=tier, stall=stall)
                inflight.append((step, tier, t1, fut))
            still = []
            for s, tier, t1, fut in inflight:
                if fut.done():
                    fut.result()
                    emit(ev="committed", step=s, tier=tier, seconds=time.perf_counter() - t1)
                else:
                    still.append((s, tier, t1, fut))
            inflight = still
        for s, tier, t1, fut in inflight:
            fut.result()
            emit(ev="committed", step=s, tier=tier, seconds=time.perf_counter() - t1)
        final = local_hash(state_of(model, opt, args.steps))
        (out / f"final-{rank}.json").write_text(json.dumps({"hash": final, "step": args.steps}))
        emit(ev="done", step=args.steps)
        dist.barrier(group=ckpt)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
