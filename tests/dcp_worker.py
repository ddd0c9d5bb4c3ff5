"""Run under ``torchrun --nproc_per_node=2`` by tests/test_dcp.py (gloo, CPU).

``python -m torch.distributed.run --nproc_per_node=2 tests/dcp_worker.py SCENARIO OUT ROOT...``

Scenarios:

* ``main``: for every ROOT (a directory or an ``s3://`` URI): a model sharded with FSDP2
  plus its Adam state, saved on 2 ranks and loaded on 2 ranks into a fresh model; saved on
  1 rank (full tensors, ``no_dist``) and loaded on 2; ``async_save`` (thread and process
  checkpointers) while training goes on; a rank raising mid-save leaves nothing committed.
  Rank 0 writes the reference values (``OUT/ref-*.pt``) for the checks made in pytest.
* ``kill``: saves ROOT/k, trains, saves ROOT/k again with ``overwrite=True`` and rank 1
  SIGKILLs itself in the middle of its writes.

S3 store options (endpoint, credentials) come as JSON in ``FMSTORE_TEST_S3_OPTIONS``.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fmstore.checkpoint.dcp import Reader, Stager, Writer, async_save  # noqa: E402

warnings.filterwarnings("ignore")


def store_options(uri: str) -> dict[str, Any]:
    if uri.startswith("s3://"):
        return json.loads(os.environ["FMSTORE_TEST_S3_OPTIONS"])
    return {}


def make_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 96),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 33),  # odd sizes: uneven shards
    )
    model[0].to(torch.bfloat16)  # a second dtype
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(8, 64, generator=g)
        h = model[0](x.to(torch.bfloat16)).float()
        loss = model[2](model[1](h)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Unsharded values on every rank (a collective), copied: get_state_dict hands out
    some live tensors (Adam's ``step``) that training keeps changing."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return copy.deepcopy({"model": msd, "optim": osd})


def flat(sd: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(flat(v, f"{prefix}{k}."))
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            out.update(flat(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = sd
    return out


def same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    fa, fb = flat(a), flat(b)
    if fa.keys() != fb.keys():
        raise AssertionError(f"{what}: keys differ: {sorted(fa.keys() ^ fb.keys())}")
    for k, va in fa.items():
        vb = fb[k]
        if isinstance(va, torch.Tensor):
            va = va.full_tensor() if hasattr(va, "full_tensor") else va
            vb = vb.full_tensor() if hasattr(vb, "full_tensor") else vb
            ok = va.dtype == vb.dtype and va.shape == vb.shape and torch.equal(va, vb)
            if not ok:
                raise AssertionError(f"{what}: {k} differs")
        elif va != vb:
            raise AssertionError(f"{what}: {k}: {va!r} != {vb!r}")


def load_fresh(uri: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt = make_model(seed)
    sd = state(model, opt)
    dcp.load(sd, storage_reader=Reader(uri, store_options=store_options(uri)))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return model, opt


class FailingPlanner(DefaultSavePlanner):
    """Rank ``rank`` fails (``kill``: SIGKILL; else raises) after resolving ``after`` items."""

    def __init__(self, rank: int, after: int, kill: bool) -> None:
        super().__init__()
        self.fail_rank, self.after, self.kill, self.n = rank, after, kill, 0

    def resolve_data(self, write_item: Any) -> Any:
        if dist.get_rank() == self.fail_rank:
            self.n += 1
            if self.n > self.after:
                if self.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected write failure")
        return super().resolve_data(write_item)


def scenario_main(out: str, roots: list[str]) -> dict[str, Any]:
    rank = dist.get_rank()
    report: dict[str, Any] = {}
    for ri, root in enumerate(roots):
        so = store_options(root)
        model, opt = make_model(0)
        train(model, opt, 2, 0)
        ref = full_state(model, opt)
        if rank == 0:
            torch.save(ref, os.path.join(out, f"ref-{ri}.pt"))

        # 2 ranks -> 2 ranks; small direct_min: the larger tensors get blobs of their own.
        w = Writer(f"{root}/a", store_options=so, direct_min=4096)
        dcp.save(state(model, opt), storage_writer=w)
        m2, o2 = load_fresh(f"{root}/a", 1)
        same(full_state(m2, o2), ref, "2->2")

        # 1 rank -> 2 ranks: rank 0 saves the unsharded state alone.
        if rank == 0:
            dcp.save(ref, storage_writer=Writer(f"{root}/c", store_options=so), no_dist=True)
        dist.barrier()
        m3, o3 = load_fresh(f"{root}/c", 2)
        same(full_state(m3, o3), ref, "1->2")

        # async_save, thread checkpointer: training goes on during the save.  The save's
        # collectives use their own group so they never interleave with training's.
        ckpt_pg = dist.new_group(backend="gloo")
        stager = Stager()
        fut = async_save(
            state(model, opt),
            Writer(f"{root}/async-t", store_options=so),
            stager=stager,
            process_group=ckpt_pg,
        )
        train(model, opt, 1, 7)
        fut.result()
        after = full_state(model, opt)
        m4, o4 = load_fresh(f"{root}/async-t", 3)
        same(full_state(m4, o4), ref, "async thread")
        # The weights did change meanwhile (else the check above proves nothing).
        changed = not torch.equal(after["model"]["0.weight"], ref["model"]["0.weight"])
        # A second save through the same stager reuses its buffers.
        nbuf = stager.staged_bytes
        fut = async_save(
            state(model, opt),
            Writer(f"{root}/async-t2", store_options=so),
            stager=stager,
            process_group=ckpt_pg,
        )
        train(model, opt, 1, 8)
        fut.result()
        m5, o5 = load_fresh(f"{root}/async-t2", 4)
        same(full_state(m5, o5), after, "async thread, reused buffers")
        reused = stager.staged_bytes == nbuf

        # async_save, process checkpointer.
        snap = full_state(model, opt)
        pstager = Stager(share_memory=True)
        fut = async_save(
            state(model, opt),
            Writer(f"{root}/async-p", store_options=so),
            stager=pstager,
            process=True,
            process_group=ckpt_pg,
        )
        train(model, opt, 1, 9)
        fut.result()
        m6, o6 = load_fresh(f"{root}/async-p", 5)
        same(full_state(m6, o6), snap, "async process")

        # A rank that fails mid-save: every rank sees the error, nothing is committed.
        err = None
        try:
            dcp.save(
                state(model, opt),
                storage_writer=Writer(f"{root}/fail", store_options=so),
                planner=FailingPlanner(1, 2, kill=False),
            )
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            err = f"{type(e).__name__}: {e}".splitlines()[0] + " " + str(e).splitlines()[-1]
        report[root] = {"changed": changed, "reused": reused, "fail_error": err}
    return report


def scenario_kill(out: str, roots: list[str]) -> dict[str, Any]:
    rank = dist.get_rank()
    root = roots[0]
    so = store_options(root)
    model, opt = make_model(0)
    train(model, opt, 1, 0)
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, os.path.join(out, "ref-kill.pt"))
    dcp.save(state(model, opt), storage_writer=Writer(f"{root}/k", store_options=so))
    train(model, opt, 1, 1)
    if rank == 0:
        with open(os.path.join(out, "kill-started"), "w") as f:
            f.write("1")
    dcp.save(
        state(model, opt),
        storage_writer=Writer(f"{root}/k", store_options=so, overwrite=True, chunk_size=4096),
        planner=FailingPlanner(1, 3, kill=True),
    )
    return {"unreachable": True}


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(
        float(os.environ.get("DCP_WORKER_HANG_DUMP", "600")), exit=True
    )
    scenario, out, *roots = sys.argv[1:]
    dist.init_process_group("gloo")
    try:
        fn = {"main": scenario_main, "kill": scenario_kill}[scenario]
        report = fn(out, roots)
        if dist.get_rank() == 0:
            with open(os.path.join(out, f"{scenario}.json"), "w") as f:
                json.dump(report, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
