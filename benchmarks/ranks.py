"""What each rank pays as the job grows: bytes and collectives of a save and a restore, as
counts (not times), for W = 2, 4, 8, 16 ranks on one node.

One fixed model for every W (8 layers x 6 weights of 256 x 256 float32, each with Adam's two
moments, and a step counter: 145 items), every tensor a DTensor ``Shard(0)`` over the W
ranks as FSDP leaves it, saved twice (the first save, then a steady-state one of the same
structure) and restored on the same world through ``fmstore.checkpoint.dcp.save`` /
``load`` on a POSIX directory.  Per rank it counts, at the ``torch.distributed`` API:

- the bytes it receives in collectives and point-to-point calls (a tensor by its size; an
  object collective by the pickled size of what arrived from the other ranks; DCP's own
  gathers and broadcasts included, as they are called through that API);
- the number of collectives it enters;

and at restore the bytes it reads from the store beyond its own shard (fmstore's metered
store: every ``get``, range or stream).  The restore is checked bit-exact.  A column that
grows with W for the same model is a cost that grows with the job (docs/scale.md models it
at 16,384 ranks).

    python -m benchmarks.ranks [--ranks 2,4,8,16] [--plan-cache] [--json PATH]

``--plan-cache``: both saves use DCP's save-plan caching
(``DefaultSavePlanner(enable_plan_caching=True)``, opt-in in fmstore, docs/dcp.md): the
steady-state save reuses the first save's plan.

Each W runs under ``torchrun`` (gloo, CPU); ``benchmarks/RESULTS.md`` has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from typing import Any

if __name__ == "__main__":  # run by torchrun as a script: the repository root is not on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS, WEIGHTS, DIM = 8, 6, 256

# ---- counting at the torch.distributed API ------------------------------------------------


class Counts:
    """Bytes received and collectives entered by this rank, since the last :meth:`take`."""

    def __init__(self) -> None:
        self.received = 0
        self.calls = 0
        self.by_op: dict[str, int] = {}
        self.bytes_by_op: dict[str, int] = {}

    def add(self, op: str, n: int) -> None:
        self.received += n
        self.calls += 1
        self.by_op[op] = self.by_op.get(op, 0) + 1
        self.bytes_by_op[op] = self.bytes_by_op.get(op, 0) + n

    def take(self) -> dict[str, Any]:
        out = {
            "received": self.received,
            "collectives": self.calls,
            "by_op": self.by_op,
            "bytes_by_op": self.bytes_by_op,
        }
        self.__init__()  # type: ignore[misc]
        return out


def _pickled(obj: Any) -> int:
    return len(pickle.dumps(obj))


def install(counts: Counts) -> None:
    """Wrap the public collectives of ``torch.distributed`` so each call adds what this
    rank received to ``counts``.  Calls made inside torch's own collectives (an object
    collective's tensor steps) go through ``distributed_c10d``'s names, not these, so
    nothing is counted twice."""
    import torch.distributed as dist

    def me(kw: dict[str, Any]) -> int:
        g = kw.get("group")
        return int(dist.get_rank(g)) if g is not None else int(dist.get_rank())

    def is_root(kw: dict[str, Any], name: str, pos: Any) -> bool:
        """Whether this rank is the call's source or destination (``src``/``dst`` global,
        ``group_src``/``group_dst`` within the group)."""
        if kw.get(f"group_{name}") is not None:
            return me(kw) == kw[f"group_{name}"]
        root = kw.get(name, pos)
        return int(dist.get_rank()) == (0 if root is None else int(root))

    def world(kw: dict[str, Any]) -> int:
        g = kw.get("group")
        return int(dist.get_world_size(g)) if g is not None else int(dist.get_world_size())

    def nb(t: Any) -> int:
        return int(t.numel() * t.element_size())

    def wrap(name: str, received: Callable[[tuple[Any, ...], dict[str, Any]], int]) -> None:
        fn = getattr(dist, name)

        def counted(*args: Any, **kw: Any) -> Any:
            out = fn(*args, **kw)
            counts.add(name, received(args, kw))
            return out

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(dist, name, counted)

    def arg(args: tuple[Any, ...], kw: dict[str, Any], i: int, key: str) -> Any:
        return args[i] if len(args) > i else kw.get(key)

    r = me
    # fmt: off
    wrap("all_gather", lambda a, k: sum(nb(t) for t in arg(a, k, 0, "tensor_list")) - nb(arg(a, k, 1, "tensor")))
    wrap("all_gather_into_tensor", lambda a, k: nb(arg(a, k, 0, "output_tensor")) - nb(arg(a, k, 1, "input_tensor")))
    wrap("all_gather_object", lambda a, k: sum(_pickled(o) for i, o in enumerate(arg(a, k, 0, "object_list")) if i != r(k)))
    wrap("broadcast", lambda a, k: 0 if is_root(k, "src", arg(a, k, 1, "src")) else nb(arg(a, k, 0, "tensor")))
    wrap("broadcast_object_list", lambda a, k: 0 if is_root(k, "src", arg(a, k, 1, "src")) else sum(_pickled(o) for o in arg(a, k, 0, "object_list")))
    wrap("gather", lambda a, k: (world(k) - 1) * nb(arg(a, k, 0, "tensor")) if is_root(k, "dst", arg(a, k, 2, "dst")) else 0)
    wrap("gather_object", lambda a, k: sum(_pickled(o) for i, o in enumerate(arg(a, k, 1, "object_gather_list") or []) if i != r(k)) if is_root(k, "dst", arg(a, k, 2, "dst")) else 0)
    wrap("scatter", lambda a, k: 0 if is_root(k, "src", arg(a, k, 2, "src")) else nb(arg(a, k, 0, "tensor")))
    wrap("scatter_object_list", lambda a, k: 0 if is_root(k, "src", arg(a, k, 2, "src")) else _pickled(arg(a, k, 0, "scatter_object_output_list")[0]))
    wrap("all_reduce", lambda a, k: nb(arg(a, k, 0, "tensor")))
    wrap("reduce_scatter_tensor", lambda a, k: nb(arg(a, k, 0, "output")))
    wrap("send", lambda a, k: 0)
    wrap("recv", lambda a, k: nb(arg(a, k, 0, "tensor")))
    wrap("barrier", lambda a, k: 0)
    # fmt: on


# ---- one rank -----------------------------------------------------------------------------


def _state(rank: int, world: int, mesh: Any, *, zeros: bool) -> tuple[dict[str, Any], int]:
    """The model's state as this rank holds it (its ``Shard(0)`` rows of every tensor, the
    same values on every W), and the bytes of those rows."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    g = torch.Generator().manual_seed(0)
    own = 0

    def shard() -> Any:
        nonlocal own
        full = torch.randn(DIM, DIM, generator=g)
        local = full.tensor_split(world, dim=0)[rank].clone()
        if zeros:
            local.zero_()
        own += local.numel() * local.element_size()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    model, optim = {}, {}
    for layer in range(LAYERS):
        for w in range(WEIGHTS):
            name = f"layers.{layer}.w{w}"
            model[name] = shard()
            optim[f"{name}.exp_avg"] = shard()
            optim[f"{name}.exp_avg_sq"] = shard()
    return {"model": model, "optim": optim, "step": 0 if zeros else 7}, own


def _read_bytes() -> int:
    from fmstore.metrics import STORE_BYTES

    return int(
        sum(
            s.value
            for m in STORE_BYTES.collect()
            for s in m.samples
            if s.name.endswith("_total") and s.labels.get("op") == "get"
        )
    )


def _rank(out: str, base: str, plan_cache: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh

    import fmstore.checkpoint.dcp as fdcp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state, own = _state(rank, world, mesh, zeros=False)
    counts = Counts()
    install(counts)
    report: dict[str, Any] = {"rank": rank, "world": world, "own_bytes": own}

    def planner() -> Any:
        return DefaultSavePlanner(enable_plan_caching=True) if plan_cache else None

    fdcp.save(state, os.path.join(base, "step_000000000001"), planner=planner())
    report["save"] = counts.take()
    fdcp.save(state, os.path.join(base, "step_000000000002"), planner=planner())
    report["save_steady"] = counts.take()
    restored, _ = _state(rank, world, mesh, zeros=True)
    before = _read_bytes()
    fdcp.load(restored, os.path.join(base, "step_000000000002"))
    report["restore"] = counts.take()
    report["restore"]["read"] = _read_bytes() - before
    exact = restored["step"] == state["step"] and all(
        torch.equal(restored[g][k].to_local(), state[g][k].to_local())
        for g in ("model", "optim")
        for k in state[g]
    )
    report["bit_exact"] = bool(exact)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


# ---- the driver ---------------------------------------------------------------------------


def run(world: int, timeout: float = 900, plan_cache: bool = False) -> dict[str, Any]:
    """One launch on ``world`` ranks: the per-rank reports summed up as one row."""
    from fmstore.testing.torchrun import torchrun

    with tempfile.TemporaryDirectory(prefix="fmstore-ranks-") as tmp:
        out, base = os.path.join(tmp, "out"), os.path.join(tmp, "ckpt")
        os.mkdir(out)
        args = [out, base, *(["plan-cache"] if plan_cache else [])]
        rc, log = torchrun(os.path.abspath(__file__), args, nproc=world, timeout=timeout)
        if rc != 0:
            raise RuntimeError(f"W={world}: torchrun exited {rc}:\n{log[-4000:]}")
        reps = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
        manifest = os.path.getsize(os.path.join(base, "step_000000000002", "manifest.json"))

    def busiest(phase: str, key: str = "received") -> int:
        return max(r[phase][key] for r in reps)

    return {
        "W": world,
        "manifest_bytes": manifest,
        "save_received": busiest("save"),
        "save_steady_received": busiest("save_steady"),
        "save_coordinator_received": reps[0]["save_steady"]["received"],
        "restore_received": busiest("restore"),
        "restore_read_beyond_own": max(r["restore"]["read"] - r["own_bytes"] for r in reps),
        "save_collectives": busiest("save", "collectives"),
        "save_steady_collectives": busiest("save_steady", "collectives"),
        "restore_collectives": busiest("restore", "collectives"),
        "restore_ops": reps[0]["restore"]["by_op"],
        "save_ops": reps[0]["save"]["by_op"],
        "bit_exact": all(r["bit_exact"] for r in reps),
    }


COLUMNS = [
    ("W", "W"),
    ("manifest_bytes", "manifest bytes"),
    ("save_received", "save: received, busiest rank"),
    ("save_steady_received", "steady save: received, busiest rank"),
    ("save_coordinator_received", "steady save: coordinator received"),
    ("restore_received", "restore: received, busiest rank"),
    ("restore_read_beyond_own", "restore: read beyond own shard, busiest rank"),
    ("save_collectives", "collectives: save / steady save / restore"),
]


def table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(t for _k, t in COLUMNS) + " | bit-exact |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for row in rows:
        cells = [f"{row[k]:,}" for k, _t in COLUMNS[:-1]]
        cells.append(
            f"{row['save_collectives']} / {row['save_steady_collectives']} / "
            f"{row['restore_collectives']}"
        )
        cells.append("yes" if row["bit_exact"] else "**no**")
        lines.append("| " + " | ".join(cells) + " |")
    first, last = rows[0], rows[-1]
    grow = [f"{t.split(',')[0]} x{last[k] / first[k]:.2f}" for k, t in COLUMNS[1:-1] if first[k]]
    lines.append("")
    lines.append(f"From W={first['W']} to W={last['W']}: " + "; ".join(grow))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.ranks",
        description="Per-rank bytes and collectives of a save and a restore, W = 2..16.",
    )
    ap.add_argument("--ranks", default="2,4,8,16", help="comma-separated world sizes")
    ap.add_argument("--quick", action="store_true", help="W = 2 and 4 only (checks the script)")
    ap.add_argument("--plan-cache", action="store_true", help="save with DCP's save-plan caching")
    ap.add_argument("--json", help="write the rows to this file as JSON")
    a = ap.parse_args()
    rows = []
    for w in (2, 4) if a.quick else (int(x) for x in a.ranks.split(",")):
        rows.append(run(w, plan_cache=a.plan_cache))
        print(
            f"W={w}: {json.dumps({k: v for k, v in rows[-1].items() if not k.endswith('_ops')})}",
            flush=True,
        )
    print()
    print(
        f"## ranks: per-rank bytes and collectives, {LAYERS * WEIGHTS * 3 + 1} items, "
        f"every tensor Shard(0) over W ranks, POSIX, one node"
        + (", save-plan caching" if a.plan_cache else "")
    )
    print()
    print(table(rows))
    print()
    print("collectives per call, rank 0, first save:", rows[-1]["save_ops"])
    print("collectives per call, rank 0, restore:", rows[-1]["restore_ops"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and "LOCAL_RANK" in os.environ:
        _rank(sys.argv[1], sys.argv[2], plan_cache=sys.argv[3:] == ["plan-cache"])
    else:
        main()
