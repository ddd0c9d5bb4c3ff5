"""Loading onto (and saving from) the GPU: fmstore against the tools users already have, with
the hardware's floors measured in the same run.

    python -m benchmarks.gpu                      # 4 GiB with CUDA; 1 GiB CPU targets without
    python -m benchmarks.gpu --size 1GiB --dir /local/nvme/tmp
    python -m benchmarks.gpu --quick              # 256 MiB, to check the script

One process, one prepared run (at most ~8 minutes at 4 GiB on an H100/H200):

* floors: host memcpy, pinned host<->device copies, parallel O_DIRECT write and read of the
  same bytes (8 files, 8 threads);
* loads of a mixed bf16/fp32 state onto the target, page cache warm and cold (dropped before
  each when allowed): ``torch.load`` with and without ``mmap``, safetensors ``load_file``,
  ``fmstore.load`` (onto the target and onto the CPU), DCP's ``FileSystemReader`` and
  fmstore's DCP ``Reader`` into tensors on the target (and into CPU tensors), ``fmstore.load``
  of the DCP checkpoint; with CUDA, the GPU memory peak of each load above its result;
* saves: ``fmstore.save``, ``torch.save``, safetensors, DCP's ``FileSystemWriter`` (8
  threads); the stall of ``fmstore.async_save``, of ``dcp.async_save`` and of fmstore's
  DCP ``Stager`` (first call and later ones);
* the training loop: 3 square fp32 layers + AdamW, a save every ``--save-every`` steps,
  the stall per save (end of the step to the save call's return, device work included) and
  the step time for every
  peer: ``torch.save``, ``dcp.async_save``, ``fmstore.async_save`` (prepared), the fmstore
  DCP ``Stager`` (prepared), ``CheckpointManager`` (prepared) with exports to a second
  directory running in its helper.

Without CUDA every "device" is the CPU (the same pipelines, with plain host buffers) and the
tables say so: figures for GPU targets come from a machine with one.  Prints markdown tables
and writes benchmarks/out/gpu.json.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import have, print_table, save_json, settle  # noqa: E402
from fmstore.units import parse_size  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda") if CUDA else torch.device("cpu")
GIB = 1 << 30


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def touch(obj: Any) -> None:
    """Read one element per 4 KiB page of every tensor in ``obj`` (CPU targets): a
    memory-mapped load has read nothing yet when it returns, a copy onto a GPU has."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu" and obj.numel():
            step = max(1, 4096 // obj.element_size())
            obj.reshape(-1)[::step].float().sum()
    elif isinstance(obj, dict):
        for v in obj.values():
            touch(v)


def make_state(total: int, device: torch.device) -> dict[str, Any]:
    """bf16 weights (1/3 of the bytes) and fp32 Adam moments (2/3), 64 MiB tensors."""
    g = torch.Generator().manual_seed(0)
    n = 16 << 20  # fp32 elements of a 64 MiB tensor
    out: dict[str, Any] = {"model": {}, "optim": {}, "step": 100}
    made = i = 0
    while made < total:
        w = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        out["model"][f"layer{i}.weight"] = w.to(device)
        out["optim"][f"layer{i}.exp_avg"] = torch.randn(n // 4, generator=g).to(device)
        out["optim"][f"layer{i}.exp_avg_sq"] = torch.rand(n // 4, generator=g).to(device)
        made += w.nbytes + 2 * (n // 4) * 4
        i += 1
    return out


def flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"{a}.{k}": v for a in ("model", "optim") for k, v in state[a].items()}


def state_bytes(state: dict[str, Any]) -> int:
    return sum(v.nbytes for v in flat(state).values())


# ---- floors ---------------------------------------------------------------------------------


def _direct_io(paths: list[str], nbytes: int, write: bool) -> float:
    """Parallel O_DIRECT write (with fsync) or read of ``nbytes`` per file, one thread each."""
    block = 16 << 20
    bufs = [mmap.mmap(-1, block) for _ in paths]
    for b in bufs:
        b.write(os.urandom(4096) * (block // 4096))
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY

    def one(path: str, buf: mmap.mmap) -> None:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
        try:
            for off in range(0, nbytes, block):
                if write:
                    os.pwritev(fd, [buf], off)
                else:
                    os.preadv(fd, [buf], off)
            if write:
                os.fsync(fd)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=one, args=(p, b)) for p, b in zip(paths, bufs)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def floors(size: int, work: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    best = _memcpy(size)
    rows.append({"floor": "host memcpy", "s": best, "GB/s": size / best / 1e9})
    if CUDA:
        rows += _pinned_copies(size)
    paths = [os.path.join(work, f"floor-{i}") for i in range(8)]
    per = -(-size // 8 // (16 << 20)) * (16 << 20)
    try:
        tw = _direct_io(paths, per, write=True)
        settle()
        tr = _direct_io(paths, per, write=False)
        rows.append({"floor": "O_DIRECT write, 8 files", "s": tw, "GB/s": 8 * per / tw / 1e9})
        rows.append({"floor": "O_DIRECT read, 8 files", "s": tr, "GB/s": 8 * per / tr / 1e9})
    except OSError as e:
        print(f"note: no O_DIRECT floor here ({e})")
    for p in paths:
        if os.path.exists(p):
            os.remove(p)
    return rows


def _memcpy(size: int) -> float:
    src = torch.empty(size, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.fill_(0)
    return min(_timed(lambda: dst.copy_(src)) for _ in range(3))


def _pinned_copies(size: int) -> list[dict[str, Any]]:
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    dev = torch.empty(size, dtype=torch.uint8, device=DEV)

    def h2d() -> None:
        dev.copy_(pinned, non_blocking=True)
        sync()

    def d2h() -> None:
        pinned.copy_(dev, non_blocking=True)
        sync()

    h2d()
    rows = []
    for name, fn in (("pinned host->device", h2d), ("pinned device->host", d2h)):
        t = min(_timed(fn) for _ in range(3))
        rows.append({"floor": name, "s": t, "GB/s": size / t / 1e9})
    return rows


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


# ---- loads ----------------------------------------------------------------------------------


def write_all(state: dict[str, Any], work: str) -> dict[str, str]:
    """The state in every format, on disk (written once, before the loads are timed)."""
    import torch.distributed.checkpoint as dcp

    import fmstore
    from fmstore.checkpoint.dcp import Writer

    cpu = {a: {k: v.cpu() for k, v in state[a].items()} for a in ("model", "optim")}
    cpu["step"] = state["step"]
    p = {
        "pt": os.path.join(work, "state.pt"),
        "st": os.path.join(work, "state.safetensors"),
        "fm": os.path.join(work, "fm"),
        "tdcp": os.path.join(work, "tdcp"),
        "fdcp": os.path.join(work, "fdcp"),
    }
    torch.save(cpu, p["pt"])
    if have("safetensors"):
        from safetensors.torch import save_file

        save_file(flat(cpu), p["st"])
    fmstore.save(cpu, p["fm"], compression="raw")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(flat(cpu), storage_writer=dcp.FileSystemWriter(p["tdcp"], thread_count=8),
                 no_dist=True)  # fmt: skip
        dcp.save(flat(cpu), storage_writer=Writer(p["fdcp"]), no_dist=True)
    return p


def load_cases(state: dict[str, Any], p: dict[str, str]) -> dict[str, Callable[[], Any]]:
    import torch.distributed.checkpoint as dcp

    import fmstore
    from fmstore.checkpoint.dcp import Reader

    shapes = {k: (v.shape, v.dtype) for k, v in flat(state).items()}

    def into(device: torch.device) -> dict[str, torch.Tensor]:
        return {k: torch.empty(s, dtype=d, device=device) for k, (s, d) in shapes.items()}

    def dcp_load(reader: Any, device: torch.device) -> Any:
        out = into(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(out, storage_reader=reader, no_dist=True)
        return out

    tgt = str(DEV)
    cases: dict[str, Callable[[], Any]] = {
        f"torch.load(mmap=True, map_location={tgt!r})": lambda: torch.load(
            p["pt"], mmap=True, map_location=tgt, weights_only=True
        ),
        f"torch.load(map_location={tgt!r})": lambda: torch.load(
            p["pt"], map_location=tgt, weights_only=True
        ),
    }
    if have("safetensors"):
        from safetensors.torch import load_file

        cases[f"safetensors load_file(device={tgt!r})"] = lambda: load_file(p["st"], device=tgt)
    cases[f"fmstore.load(map_location={tgt!r})"] = lambda: fmstore.load(p["fm"], map_location=tgt)
    if CUDA:
        cases["fmstore.load(map_location='cpu')"] = lambda: fmstore.load(
            p["fm"], map_location="cpu"
        )
    cases[f"torch DCP FileSystemReader into {tgt} tensors"] = lambda: dcp_load(
        dcp.FileSystemReader(p["tdcp"]), DEV
    )
    cases[f"fmstore DCP Reader into {tgt} tensors"] = lambda: dcp_load(Reader(p["fdcp"]), DEV)
    if CUDA:
        cases["fmstore DCP Reader into cpu tensors"] = lambda: dcp_load(
            Reader(p["fdcp"]), torch.device("cpu")
        )
    cases[f"fmstore.load(DCP dir, map_location={tgt!r})"] = lambda: fmstore.load(
        p["fdcp"], map_location=tgt
    )
    return cases


def run_loads(cases: dict[str, Callable[[], Any]], nbytes: int, repeat: int) -> list[dict]:
    rows = []
    for name, fn in cases.items():
        row: dict[str, Any] = {"load": name}
        out = fn()  # warms the page cache (and imports, pools, rings)
        del out
        warm = []
        peak = 0.0
        for _ in range(repeat):
            if CUDA:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            out = fn()
            sync()
            touch(out)
            warm.append(time.perf_counter() - t0)
            if CUDA:
                peak = (torch.cuda.max_memory_allocated() - base) / GIB
            del out
        dropped = settle()
        t0 = time.perf_counter()
        out = fn()
        sync()
        touch(out)
        cold = time.perf_counter() - t0
        del out
        row.update({"warm s": min(warm), "warm GB/s": nbytes / min(warm) / 1e9})
        row["cold s" if dropped else "cold s (cache not dropped)"] = cold
        if CUDA:
            row["GPU peak GiB"] = peak
        rows.append(row)
        print(f"  {name}: warm {min(warm):.3f} s, cold {cold:.3f} s", flush=True)
    return rows


# ---- saves ----------------------------------------------------------------------------------


def remove(path: str) -> None:
    """Delete one save's output once it is timed: at 4 GiB a run's saves and loop would
    otherwise hold ~90 GiB at once (a 64 GiB disk filled on an H200 run)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def run_saves(state: dict[str, Any], work: str) -> list[dict]:
    import torch.distributed.checkpoint as dcp

    import fmstore
    from fmstore.checkpoint.dcp import Stager, Writer
    from fmstore.checkpoint.dcp import async_save as fm_dcp_async
    from fmstore.checkpoint.snapshot import STAGING

    rows: list[dict[str, Any]] = []
    n = [0]

    def where(tag: str) -> str:
        n[0] += 1
        return os.path.join(work, f"save-{tag}-{n[0]}")

    def timed_save(name: str, fn: Callable[[str], Any], tag: str) -> None:
        settle()
        path = where(tag)
        t = _timed(lambda: fn(path))
        remove(path)
        rows.append({"save": name, "s": t, "GB/s": state_bytes(state) / t / 1e9})
        print(f"  {name}: {t:.3f} s", flush=True)

    def quiet(fn: Callable[[], Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()

    timed_save("fmstore.save", lambda u: fmstore.save(state, u), "fm")
    timed_save("torch.save", lambda u: torch.save(state, u), "pt")
    if have("safetensors"):
        from safetensors.torch import save_file

        timed_save("safetensors save_file", lambda u: save_file(flat(state), u), "st")
    timed_save(
        "DCP FileSystemWriter (8 threads)",
        lambda u: quiet(
            lambda: dcp.save(
                flat(state), storage_writer=dcp.FileSystemWriter(u, thread_count=8), no_dist=True
            )
        ),  # fmt: skip
        "tdcp",
    )
    timed_save(
        "fmstore DCP Writer",
        lambda u: quiet(lambda: dcp.save(flat(state), storage_writer=Writer(u), no_dist=True)),
        "fdcp",
    )

    def stalls(name: str, call: Callable[[str], Any], wait: Callable[[Any], Any]) -> None:
        got = []
        for _ in range(3):
            settle()
            path = where("async")
            t0 = time.perf_counter()
            h = call(path)
            got.append(time.perf_counter() - t0)
            wait(h)
            remove(path)
        rows.append({"save": f"{name}: stall, first call", "s": got[0]})
        rows.append({"save": f"{name}: stall, later calls", "s": statistics.median(got[1:])})
        print(f"  {name}: stalls {' '.join(f'{g:.3f}' for g in got)}", flush=True)

    STAGING.release()
    stalls("fmstore.async_save", lambda u: fmstore.async_save(state, u), lambda h: h.result())
    STAGING.release()
    fmstore.prepare_async_save(state).result()
    stalls(
        "fmstore.async_save after prepare_async_save",
        lambda u: fmstore.async_save(state, u),
        lambda h: h.result(),
    )
    stalls(
        "dcp.async_save (FileSystemWriter)",
        lambda u: quiet(
            lambda: dcp.async_save(
                flat(state), storage_writer=dcp.FileSystemWriter(u, thread_count=8)
            )
        ),  # fmt: skip
        lambda f: f.result(),
    )
    stager = Stager()
    stager.prepare(flat(state)).result()
    stalls(
        "fmstore DCP Stager after prepare",
        lambda u: quiet(lambda: fm_dcp_async(flat(state), Writer(u), stager=stager)),
        lambda f: f.result(),
    )
    return rows


# ---- the training loop ------------------------------------------------------------------------


def training_loop(work: str, width: int, steps: int, every: int) -> list[dict]:
    """Stall per save and step time of every peer in a small training loop."""
    import torch.distributed.checkpoint as dcp

    import fmstore
    from fmstore.checkpoint.api import wait_for_saves
    from fmstore.checkpoint.dcp import Stager, Writer
    from fmstore.checkpoint.dcp import async_save as fm_dcp_async
    from fmstore.checkpoint.snapshot import STAGING
    from fmstore.config import from_dict
    from fmstore.tiering.managers.manager import CheckpointManager

    rows = []

    def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(3)))
        m = m.to(DEV)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4)

    def state_of(m: torch.nn.Module, o: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": m.state_dict(), "optim": o.state_dict()}

    def run(name: str, setup: Callable[[Any, Any], Any], save: Callable[[Any, Any, int], Any]) -> None:  # fmt: skip
        for entry in os.listdir(work):  # the last peer's saves, all waited for by now
            remove(os.path.join(work, entry))
        m, o = model_and_opt()
        x = torch.randn(width // 4, width, device=DEV)
        ctx = None
        times, stall = [], []
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            loss = m(x).square().mean()
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
            loss.item()  # the step's end, as a training loop sees it
            times.append(time.perf_counter() - t0)
            if step == 1:
                ctx = setup(m, o)  # prepare (where the peer has one) once the state exists
            elif step % every == 0:
                # The stall: from the end of the step's work to the save call's return
                # with anything it queued on the device done.
                t1 = time.perf_counter()
                save(ctx, state_of(m, o), step)
                sync()
                stall.append(time.perf_counter() - t1)
        step_s = statistics.median(times[1:])
        rows.append(
            {
                "peer": name,
                "step s": step_s,
                "stall first s": stall[0],
                "stall max s": max(stall),
                "stall median s": statistics.median(stall),
            }
        )
        print(f"  {name}: step {step_s:.4f} s, stalls {' '.join(f'{s:.3f}' for s in stall)}", flush=True)  # fmt: skip
        if hasattr(ctx, "close"):
            ctx.close()

    def quiet(fn: Callable[[], Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()

    nothing = lambda m, o: None  # noqa: E731
    run("torch.save", nothing, lambda c, s, i: torch.save(s, os.path.join(work, f"loop-{i}.pt")))
    pending: list[Any] = []

    def dcp_async(c: Any, s: Any, i: int) -> None:
        if pending:
            pending.pop().result()  # DCP asks to wait for the previous save
        w = dcp.FileSystemWriter(os.path.join(work, f"loop-tdcp-{i}"), thread_count=8)
        pending.append(quiet(lambda: dcp.async_save(s, storage_writer=w)))

    run("dcp.async_save", nothing, dcp_async)
    if pending:
        pending.pop().result()
    STAGING.release()
    run(
        "fmstore.async_save (prepared)",
        lambda m, o: fmstore.prepare_async_save(state_of(m, o)).result(),
        lambda c, s, i: fmstore.async_save(s, os.path.join(work, f"loop-fm-{i}")),
    )
    wait_for_saves()

    def stager_setup(m: Any, o: Any) -> Stager:
        st = Stager()
        st.prepare(state_of(m, o)).result()
        return st

    run(
        "fmstore DCP Stager (prepared)",
        stager_setup,
        lambda c, s, i: quiet(
            lambda: fm_dcp_async(s, Writer(os.path.join(work, f"loop-fdcp-{i}")), stager=c)
        ),  # fmt: skip
    )
    cfg = from_dict(
        {
            "tiers": {t: {"url": os.path.join(work, "tiers", t)} for t in ("nvme", "lustre")},
            "state_dir": os.path.join(work, "tiers", "state"),
            "policies": {
                "ladder": ["nvme", "lustre"],
                "export": [{"to": "lustre", "every_saves": 1}],
            },  # fmt: skip
        }
    )

    def mgr_setup(m: Any, o: Any) -> CheckpointManager:
        mgr = CheckpointManager(
            "runs/loop", config=cfg, run_policies="process", policy_interval=0.2
        )
        mgr.prepare(state_of(m, o)).result()
        return mgr

    run(
        "CheckpointManager, exports running (prepared)",
        mgr_setup,
        lambda c, s, i: c.save(i, s),
    )
    return rows


# ---- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="4GiB" if CUDA else "1GiB")
    ap.add_argument("--dir", default=None, help="work directory on the disk to measure")
    ap.add_argument("--quick", action="store_true", help="256 MiB, a short loop")
    ap.add_argument("--sections", default="floors,load,save,loop")
    ap.add_argument("--repeat", type=int, default=2, help="warm loads per case (best)")
    ap.add_argument("--width", type=int, default=8192 if CUDA else 1024, help="loop layer width")
    ap.add_argument("--steps", type=int, default=301 if CUDA else 31)
    ap.add_argument("--save-every", type=int, default=100 if CUDA else 10)
    args = ap.parse_args(argv)
    size = parse_size("256MiB" if args.quick else args.size, "--size")
    if args.quick:
        args.width, args.steps, args.save_every = 512, 16, 5
    # DCP warns on every single-process call (and from its async thread).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sections = set(args.sections.split(","))
    work = tempfile.mkdtemp(prefix="fmstore-gpu-", dir=args.dir)
    name = torch.cuda.get_device_name() if CUDA else "none (CPU targets)"
    target = f"onto {DEV.type}" + ("" if CUDA else ", CPU targets: no CUDA on this machine")
    print(f"note: device: {name}; torch {torch.__version__}; work dir {work}")
    if not CUDA:
        print("note: no CUDA here: every load and save targets the CPU through the same code; "
              "the GPU figures are still to come from a machine with one")  # fmt: skip
    out: dict[str, Any] = {"device": name, "size": size, "cuda": CUDA}
    t_start = time.perf_counter()
    try:
        if "floors" in sections:
            rows = floors(size, work)
            out["floors"] = rows
            print_table(f"gpu: floors, {size / GIB:g} GiB ({name})", rows, ["floor", "s", "GB/s"])
        if "load" in sections or "save" in sections:
            state = make_state(size, DEV)
            nbytes = state_bytes(state)
        if "load" in sections:
            paths = write_all(state, work)
            rows = run_loads(load_cases(state, paths), nbytes, args.repeat)
            out["loads"] = rows
            cols = ["load", "warm s", "warm GB/s", "cold s", "cold s (cache not dropped)"]
            cols = [c for c in cols if any(c in r for r in rows)] + (["GPU peak GiB"] if CUDA else [])  # fmt: skip
            print_table(f"gpu: loads of {nbytes / GIB:.2f} GiB {target}", rows, cols)
            for p in paths.values():
                remove(p)
        if "save" in sections:
            rows = run_saves(state, work)
            out["saves"] = rows
            print_table(f"gpu: saves of {nbytes / GIB:.2f} GiB from {DEV.type}", rows, ["save", "s", "GB/s"])  # fmt: skip
        if "load" in sections or "save" in sections:
            del state
        if "loop" in sections:
            rows = training_loop(work, args.width, args.steps, args.save_every)
            out["loop"] = rows
            mib = 3 * args.width * args.width * 4 * 3 / (1 << 20)
            print_table(
                f"gpu: training loop on {DEV.type}, 3 x {args.width}^2 fp32 + AdamW "
                f"({mib:.0f} MiB of state), a save every {args.save_every} steps",
                rows,
                ["peer", "step s", "stall first s", "stall median s", "stall max s"],
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t_start
    print(f"note: whole run {out['seconds']:.0f} s")
    save_json("gpu", out)


if __name__ == "__main__":
    main()
