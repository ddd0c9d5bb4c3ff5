"""Run under ``torchrun --nproc_per_node=2`` by tests/test_dcp.py (gloo, CPU).

``python -m torch.distributed.run --nproc_per_node=2 tests/dcp_worker.py SCENARIO OUT ROOT...``

SCENARIO is one scenario or several, ``main,kill``, run in turn by the same launch (a start
of the job costs more than its work); after each, every rank writes ``OUT/NAME-done-RANK``
once every rank finished it.  Scenarios:

* ``main``: for every ROOT (a directory or an ``s3://`` URI): a model sharded with FSDP2
  plus its Adam state, saved on 2 ranks and loaded on 2 ranks into a fresh model; saved on
  1 rank (full tensors, ``no_dist``) and loaded on 2; ``async_save`` (thread and process
  checkpointers) while training goes on; a rank raising mid-save leaves nothing committed;
  with DCP's save-plan caching (``plan_cache``): a steady-state save, a changed structure,
  two structures saved in turn, a value whose dtype changed, ``async_save``, and a rank
  that skips an item of its cached plan (nothing committed).
  Rank 0 writes the reference values (``OUT/ref-*.pt``) for the checks made in pytest.
* ``kill``: saves ROOT/kill/k (the first ROOT), trains, saves it again with
  ``overwrite=True`` and rank 1 SIGKILLs itself in the middle of its writes (the last
  scenario of a launch: it ends the launch).

S3 store options (endpoint, credentials) come as JSON in ``FMSTORE_TEST_S3_OPTIONS``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import sys
import warnings
import zlib
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

import fmstore.checkpoint.dcp as fdcp  # noqa: E402
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


class CachingPlanner(DefaultSavePlanner):
    """DCP's planner with plan caching, recording whether this rank's plan was sent (False:
    the cached one was reused)."""

    sent: list[bool] = []

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        CachingPlanner.sent.append(plan.usable)
        return plan


class SkippingWriter(Writer):
    """Rank 1 writes all but the last item of the plan it is handed."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        if dist.get_rank() == 1:
            plan = dataclasses.replace(plan, items=plan.items[:-1])
        return super().write_data(plan, planner)


def loader_state(epoch: int) -> dict[str, Any]:
    """A second structure (a data loader's position): one value per rank, one shared."""
    r = dist.get_rank()
    return {"loader": {"epoch": torch.tensor(epoch), f"pos{r}": torch.arange(5) + 100 * r + epoch}}


def load_into(template: dict[str, Any], uri: str) -> dict[str, Any]:
    fdcp.load(template, uri, store_options=store_options(uri))
    return template


def plan_cache_checks(root: str, model: Any, opt: Any) -> dict[str, Any]:
    """Saves with plan caching, each loaded back and compared bit-exact."""
    so = store_options(root)

    def save(sd: dict[str, Any], name: str) -> bool:
        """Save ``sd`` as ``name``; whether this rank sent its plan (not the cached one)."""
        fdcp.save(sd, f"{root}/{name}", planner=CachingPlanner(), store_options=so)
        return CachingPlanner.sent[-1]

    def check_model(name: str, ref: dict[str, Any]) -> None:
        m, o = load_fresh(f"{root}/{name}", 11)
        same(full_state(m, o), ref, f"plan cache {name}")

    sent = {}
    train(model, opt, 1, 20)
    ref1 = full_state(model, opt)
    sent["first"] = save(state(model, opt), "pc1")
    train(model, opt, 1, 21)
    ref2 = full_state(model, opt)
    sent["steady"] = save(state(model, opt), "pc2")  # the cached plan
    check_model("pc1", ref1)
    check_model("pc2", ref2)
    # async_save of the same structure: the cached plan again.
    ref = full_state(model, opt)
    fut = async_save(
        state(model, opt), f"{root}/pc-async", planner=CachingPlanner(), store_options=so
    )
    fut.result()
    sent["async"] = CachingPlanner.sent[-1]
    check_model("pc-async", ref)
    # A rank that skips an item of its (cached) plan: the coordinator refuses to commit.
    sent["skip"] = None
    skip_err = None
    try:
        fdcp.save(
            state(model, opt),
            SkippingWriter(f"{root}/pc-skip", store_options=so),
            planner=CachingPlanner(),
        )
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        skip_err = str(e)
    sent["skip"] = CachingPlanner.sent[-1]
    # A new value in the state: the plan changes, and the new value is saved.
    extra = torch.arange(7, dtype=torch.float64) / 3
    sent["changed"] = save({**state(model, opt), "extra": extra.clone()}, "pc3")
    m, o = make_model(12)
    got = load_into({**state(m, o), "extra": torch.zeros(7, dtype=torch.float64)}, f"{root}/pc3")
    if not torch.equal(got["extra"], extra):
        raise AssertionError("plan cache pc3: the added value differs")
    set_state_dict(m, o, model_state_dict=got["model"], optim_state_dict=got["optim"])
    same(full_state(m, o), ref2, "plan cache pc3")
    # Two structures in turn through the same planner class (a model, a loader's state).
    sent["alternating"] = []
    for i in range(2):
        train(model, opt, 1, 30 + i)
        ref = full_state(model, opt)
        sent["alternating"].append(save(state(model, opt), f"pc-m{i}"))
        sent["alternating"].append(save(loader_state(i), f"pc-l{i}"))
        check_model(f"pc-m{i}", ref)
        want = loader_state(i)
        got = load_into(loader_state(-99), f"{root}/pc-l{i}")
        same(got, want, f"plan cache pc-l{i}")
    # The loader's state again with a value of another dtype, same name and shape (DCP's
    # plan comparison leaves dtypes out): planned again, saved with its dtype.
    f64 = loader_state(5)
    f64["loader"]["epoch"] = torch.tensor(5.5, dtype=torch.float64)
    sent["dtype"] = save(f64, "pc-dtype")
    tmpl = loader_state(-99)
    tmpl["loader"]["epoch"] = torch.tensor(0.0, dtype=torch.float64)
    same(load_into(tmpl, f"{root}/pc-dtype"), f64, "plan cache pc-dtype")

    # A save failing on the coordinator after its planner cached the new plans (here: the
    # checkpoint exists) leaves the coordinator's cache and the ranks' out of step; the
    # next save of the older structure is refused, not written with the failed save's plan.
    # A cache of its own for each root (DCP keys its cache by class name): this one stays
    # out of step (the refusal is the same at every later save of that structure).
    step_planner = type(f"StepPlanner{zlib.crc32(root.encode())}", (CachingPlanner,), {})

    def step_save(sd: dict[str, Any], name: str) -> str | None:
        try:
            fdcp.save(sd, f"{root}/{name}", planner=step_planner(), store_options=so)
        except BaseException as e:
            return str(e)
        return None

    out_of_step = [
        step_save(state(model, opt), "pc-s1"),
        step_save(loader_state(0), "pc-s1"),  # refused: pc-s1 is committed
        step_save(state(model, opt), "pc-s2"),
    ]
    return {"sent": sent, "skip_error": skip_err, "out_of_step": out_of_step}


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
        pc = plan_cache_checks(root, model, opt)
        report[root] = {"changed": changed, "reused": reused, "fail_error": err, "plan_cache": pc}
    return report


def scenario_kill(out: str, roots: list[str]) -> dict[str, Any]:
    rank = dist.get_rank()
    root = f"{roots[0]}/kill"  # a root of its own: the test's gc runs over all of it
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
        for name in scenario.split(","):
            fn = {"main": scenario_main, "kill": scenario_kill}[name]
            report = fn(out, roots)
            if dist.get_rank() == 0:
                with open(os.path.join(out, f"{name}.json"), "w") as f:
                    json.dump(report, f)
            dist.barrier()
            with open(os.path.join(out, f"{name}-done-{dist.get_rank()}"), "w") as f:
                f.write("1")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
