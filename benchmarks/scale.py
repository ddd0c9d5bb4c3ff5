"""Checkpointing at scale: measure one node's figures, predict Llama-70B on 1,024 GPUs and
Llama-405B on 16,384, and check the model against 1-3 node runs on this machine.

    python -m benchmarks.scale [--quick] [--inputs FILE.json] [--no-check] [--nodes 1,2,3]

Measures (unless ``--inputs`` gives them): fmstore's DCP Writer and Reader on this disk (the
node's NVMe), the mover's export to a Lustre directory and to S3 (SeaweedFS on loopback), a
restore from each, PUTs and GETs per second on one S3 prefix, and a gloo transfer between two
ranks (the replica link).  The device-to-host copy is measured where CUDA is present; else
the model's default (a published figure, see ``docs/scale.md``) stays.  Then prints the
predictions (:mod:`benchmarks.scale_model`), the S3 request budget of each layout, and the
model beside ``torchrun`` runs of 1-3 nodes here (``benchmarks/scale_worker.py``; with two
or more, a save with ``replicas = 1`` and a replaced node's restore from its replica); the
inputs, predictions and runs go to ``benchmarks/out/scale.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import fmstore.checkpoint.dcp as fdcp
from fmstore import runtime
from fmstore.checkpoint.dcp.manifest import MANIFEST_KEY
from fmstore.stores import open_store
from fmstore.testing import torchrun as launcher
from fmstore.testing.seaweed import SeaweedServer, free_ports
from fmstore.tiering.exports.mover import CHECKPOINT_COPY, copy_checkpoint

from .common import print_table, save_json, settle
from .scale_model import (
    LLAMA_70B,
    LLAMA_405B,
    MANIFEST_WAYS,
    Inputs,
    Job,
    MiB,
    local_check,
    manifest_bytes,
    manifest_entries,
    manifest_phase,
    predict,
    prefixes_needed,
    replica_spread,
    shared_fraction,
    targets,
)

HERE = Path(__file__).parent
#: where each default of :class:`Inputs` comes from (the measured ones are filled in by a run)
PUBLISHED = {
    "d2h_gpu": "published: PCIe Gen4 x16 host link of a p5 node (AMD Milan), ~80% of 32 GB/s; "
    "an H200 run of benchmarks/gpu.py measured 55 GB/s pinned (a Gen5 host)",
    "nic": "published: p5.48xlarge, 3,200 Gb/s of EFA per node",
    "fsx_per_tib": "published: FSx for Lustre PERSISTENT_2, highest tier, 1,000 MB/s per TiB",
    "fsx_copies": "assumed: the file system holds 10 checkpoints",
    "s3_put_per_prefix": "published: S3, 3,500 PUT/COPY/POST/DELETE per s per partitioned prefix",
    "s3_get_per_prefix": "published: S3, 5,500 GET/HEAD per s per partitioned prefix",
    "prefixes": "fmstore's layout: one save's keys share one prefix",
}


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    n = max(1, nbytes // 4 // 16)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.rand(n, generator=g) for i in range(16)}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _copy(src: str, dst: str, **so: Any) -> float:
    async def go() -> float:
        s, d = open_store(src), open_store(dst, **so)
        try:
            t0 = time.perf_counter()
            await copy_checkpoint(s, d, options=CHECKPOINT_COPY)
            if d.local_root is not None:
                os.sync()
            return time.perf_counter() - t0
        finally:
            await s.close()
            await d.close()

    return runtime.run(go())


def _requests(url: str, so: dict[str, Any], n: int, conc: int = 32) -> tuple[float, float]:
    """PUTs and GETs per second of 1 KiB objects under one prefix, ``conc`` in flight."""

    async def go() -> tuple[float, float]:
        store = open_store(url, concurrency=conc, **so)
        sem = asyncio.Semaphore(conc)
        body = os.urandom(1024)

        async def put(i: int) -> None:
            async with sem:
                await store.put(f"req/{i:06d}", body)

        async def get(i: int) -> None:
            async with sem:
                await store.get(f"req/{i:06d}")

        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(put(i) for i in range(n)))
            t1 = time.perf_counter()
            await asyncio.gather(*(get(i) for i in range(n)))
            t2 = time.perf_counter()
        finally:
            await store.close()
        return n / (t1 - t0), n / (t2 - t1)

    return runtime.run(go())


def disk_all(nbytes: int, base: str, streams: int = 8) -> tuple[float, float]:
    """What this disk serves ``streams`` writers (buffered, fsynced) and then readers (page
    cache dropped) at once, each with its own file: bytes per second, write and read."""
    from concurrent.futures import ThreadPoolExecutor

    d = os.path.join(base, "disk")
    os.makedirs(d, exist_ok=True)
    block = os.urandom(16 * MiB)
    per = max(1, nbytes // streams // len(block))

    def write(i: int) -> None:
        with open(os.path.join(d, f"f{i}"), "wb") as f:
            for _ in range(per):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    def read(i: int) -> None:
        with open(os.path.join(d, f"f{i}"), "rb", buffering=0) as f:
            while f.read(16 * MiB):
                pass

    total = per * len(block) * streams
    with ThreadPoolExecutor(streams) as pool:
        settle()
        w = _timed(lambda: list(pool.map(write, range(streams))))
        settle()
        r = _timed(lambda: list(pool.map(read, range(streams))))
    shutil.rmtree(d, ignore_errors=True)
    return total / w, total / r


def s3_all(url: str, so: dict[str, Any], nbytes: int, streams: int = 16) -> float:
    """Bytes per second the S3 server takes from ``streams`` uploads at once."""

    async def go() -> float:
        store = open_store(url, concurrency=streams, **so)
        body = os.urandom(max(1, nbytes // streams))
        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(store.put(f"all/{i:03d}", body) for i in range(streams)))
            return len(body) * streams / (time.perf_counter() - t0)
        finally:
            await store.close()

    return runtime.run(go())


def _gloo_rank(rank: int, port: int, nbytes: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    buf = torch.empty(64 * MiB, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(max(1, nbytes // buf.numel())):
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
    dist.barrier()
    if rank == 1:
        Path(out).write_text(str(nbytes / (time.perf_counter() - t0)))
    dist.destroy_process_group()


def replica_rate(nbytes: int, base: str) -> float:
    """Bytes per second one rank sends another over gloo (TCP on loopback)."""
    import torch.multiprocessing as mp

    out = os.path.join(base, "gloo.txt")
    mp.spawn(_gloo_rank, args=(free_ports(1)[0], nbytes, out), nprocs=2, join=True)
    return float(Path(out).read_text())


def manifest_rate(base: str, items: int = 2000) -> tuple[float, float]:
    """Bytes of one item's entry in ``manifest.json`` (names shaped like a Llama state
    dict's, one chunk each) and items per second ``DcpManifest.loads`` parses."""
    names = ("self_attn.q_proj", "mlp.down_proj")
    state = {
        f"{pre}model.layers.{i}.{k}.weight{post}": torch.zeros(8)
        for i in range(items // 4)
        for k in names
        for pre, post in (("", ""), ("optim.state.", ".exp_avg"))
    }
    path = os.path.join(base, "manifest")
    fdcp.save(state, path)
    data = Path(path, MANIFEST_KEY).read_bytes()
    t = _timed(lambda: fdcp.DcpManifest.loads(data))
    return len(data) / len(state), len(state) / t


def d2h_rate(nbytes: int) -> float | None:
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0)


def measure(size: int, rounds: int, base: str, s3: SeaweedServer) -> tuple[Inputs, dict[str, str]]:
    """This node's figures over ``size`` bytes of fp32 state: medians of ``rounds`` runs,
    after a warm-up save of almost nothing (threads, pools and connections started)."""
    bucket = s3.create_bucket("bench-scale")
    so = s3.store_options()
    state = _state(size)
    nbytes = sum(t.numel() * 4 for t in state.values())
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    tiny = _state(64 << 10)
    tiny_back = {k: torch.zeros_like(v) for k, v in tiny.items()}
    fdcp.save(tiny, os.path.join(base, "nvme", "warm"))
    fdcp.save(tiny, f"s3://{bucket}/save/warm", store_options=so)
    runs: dict[str, list[float]] = {}

    def one(name: str, fn: Any, cold: bool = True, own_time: bool = False) -> None:
        """Time ``fn`` (``own_time``: it returns its own seconds), cold: page cache dropped."""
        if cold:
            settle()
        runs.setdefault(name, []).append(fn() if own_time else _timed(fn))

    for i in range(rounds):
        nvme, lustre = os.path.join(base, "nvme", f"r{i}"), os.path.join(base, "lustre", f"r{i}")
        s3url, s3save = f"s3://{bucket}/export/r{i}", f"s3://{bucket}/save/r{i}"
        one("w", lambda n=nvme: fdcp.save(state, n))
        one("r", lambda n=nvme: fdcp.load(back, n))
        one("le", lambda n=nvme, d=lustre: _copy(n, d), own_time=True)
        one("lr", lambda n=lustre: fdcp.load(back, n))
        one("se", lambda n=nvme, u=s3url: _copy(n, u, **so), own_time=True)
        one("sr", lambda u=s3url: fdcp.load(back, u, store_options=so), cold=False)
        one("ss", lambda u=s3save: fdcp.save(state, u, store_options=so), cold=False)
        t = os.path.join(base, "nvme", f"tiny{i}")
        one("fixed", lambda t=t: fdcp.save(tiny, t), cold=False)
        one("fixed_load", lambda t=t: fdcp.load(tiny_back, t), cold=False)
        u = f"s3://{bucket}/save/tiny{i}"
        one("s3_fixed", lambda u=u: fdcp.save(tiny, u, store_options=so), cold=False)
    med = {k: statistics.median(v) for k, v in runs.items()}
    w, r, le, lr, se, sr, ss = (med[k] for k in ("w", "r", "le", "lr", "se", "sr", "ss"))
    fixed, fixed_load, s3_fixed = med["fixed"], med["fixed_load"], med["s3_fixed"]
    puts, gets = _requests(f"s3://{bucket}/reqs", so, 400 if size <= 256 * MiB else 2000)
    alls = [disk_all(size, base) for _ in range(rounds)]
    dw, dr = statistics.median(a[0] for a in alls), statistics.median(a[1] for a in alls)
    sa = statistics.median(s3_all(f"s3://{bucket}/all{i}", so, size) for i in range(rounds))
    rep = replica_rate(min(size, 512 * MiB), base)
    entry, parse = manifest_rate(base)
    d2h = d2h_rate(min(size, 1 << 30))
    fig = {
        "nvme_write": nbytes / w,
        "nvme_read": nbytes / r,
        "lustre_export": nbytes / le,
        "lustre_read": nbytes / lr,
        "s3_export": nbytes / se,
        "s3_read": nbytes / sr,
        "s3_save": nbytes / ss,
        "replica_pair": rep,
        "disk_write_all": dw,
        "disk_read_all": dr,
        "s3_server_all": sa,
        "save_fixed_s": fixed,
        "s3_save_fixed_s": s3_fixed,
        "load_fixed_s": fixed_load,
        "manifest_entry_bytes": entry,
        "manifest_parse": parse,
    }
    how = {
        "nvme_write": "fmstore DCP Writer, one process, this disk, synced",
        "nvme_read": "fmstore DCP Reader, page cache dropped",
        "lustre_export": "mover NVMe -> Lustre directory (same disk here), synced",
        "lustre_read": "fmstore DCP Reader from the Lustre copy, page cache dropped",
        "s3_export": "mover NVMe -> SeaweedFS on loopback (shares the 2 cores)",
        "s3_read": "fmstore DCP Reader from SeaweedFS",
        "s3_save": "fmstore DCP Writer straight to SeaweedFS",
        "replica_pair": "gloo send/recv of 64 MiB tensors between two processes, loopback",
        "disk_write_all": "8 writers at once, one file each, buffered + fsync (the shared disk)",
        "disk_read_all": "8 readers at once, page cache dropped (the shared disk)",
        "s3_server_all": "16 uploads at once to SeaweedFS (the shared server)",
        "save_fixed_s": "fmstore DCP save of 64 KiB to this disk, one process",
        "s3_save_fixed_s": "fmstore DCP save of 64 KiB to SeaweedFS, one process",
        "load_fixed_s": "fmstore DCP load of 64 KiB from this disk, one process",
        "manifest_entry_bytes": "manifest.json of 2,000 one-chunk items, Llama-like names",
        "manifest_parse": "items per second of DcpManifest.loads of that manifest",
    }
    sources = {k: f"measured here (median of {rounds}): {v}" for k, v in how.items()}
    sources["s3_requests"] = f"SeaweedFS here: {puts:.0f} PUT/s, {gets:.0f} GET/s (1 KiB objects)"
    if d2h is not None:
        fig["d2h_gpu"] = d2h
        sources["d2h_gpu"] = f"measured here: pinned copy from {torch.cuda.get_device_name()}"
    inp = Inputs(**fig, sources={**PUBLISHED, **sources})  # type: ignore[arg-type]
    return inp, {"s3_put_per_s_here": f"{puts:.0f}", "s3_get_per_s_here": f"{gets:.0f}"}


def run_nodes(
    nodes: int, node_bytes: int, rounds: int, base: str, s3: SeaweedServer
) -> dict[str, Any]:
    """``nodes`` torchrun agents on loopback, one rank each, running scale_worker.py."""
    root = Path(base) / f"nodes{nodes}"
    root.mkdir(parents=True)
    bucket = s3.create_bucket(f"bench-scale-{nodes}")
    port = free_ports(1)[0]
    procs = []
    for i in range(nodes):
        d = root / f"n{i}"
        d.mkdir()
        cfg = d / "fmstore.toml"
        cfg.write_text(
            f'state_dir = "{d / "state"}"\n'
            f'[tiers.nvme]\nurl = "{d / "nvme"}"\nscope = "node"\n'
            f'[tiers.peer]\nurl = "{d / "peer"}"\nscope = "node"\nreplicas = 1\n'
            f'[tiers.lustre]\nurl = "{root / "lustre"}"\n'
            f'[tiers.s3]\nurl = "s3://{bucket}/fm"\nendpoint_url = "{s3.endpoint_url}"\n'
            f'region = "{s3.region}"\naddressing_style = "path"\n'
        )
        env = {
            **os.environ,
            **s3.env(),
            "FMSTORE_CONFIG": str(cfg),
            "FMSTORE_NODE_ID": f"n{i}",
            "SCALE_PEER_DIR": str(d / "peer"),
            "PYTHONPATH": str(HERE.parent),
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nodes}",
            "--nproc-per-node=1",
            f"--node-rank={i}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--max-restarts=0",
            str(HERE / "scale_worker.py"),
            str(node_bytes),
            str(rounds),
            str(root),
        ]
        log = open(root / f"n{i}.log", "w")  # noqa: SIM115
        procs.append(launcher.start(cmd, env=env, stdout=log))
        log.close()
    try:
        rcs = [p.wait(timeout=900) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:  # every agent and its ranks, not the agents alone
            launcher.stop(p)
        raise
    if rcs != [0] * nodes:
        logs = "\n".join((root / f"n{i}.log").read_text()[-3000:] for i in range(nodes))
        raise RuntimeError(f"{nodes}-node run failed: {rcs}\n{logs}")
    got: dict[str, Any] = json.loads((root / "times.json").read_text())
    return got


def _fmt_s(s: float) -> str:
    return f"{s:.3f}" if s < 1 else f"{s:.1f}"


def report(inp: Inputs, jobs: list[Job]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows = []
    for job in jobs:
        p = predict(job, inp)
        out[job.name] = {
            "phases": {k: {"s": v.seconds, "binds": v.binding.name} for k, v in p.phases.items()},
            "save_requests": p.save_requests,
            "restore_gets": p.restore_gets,
            "fsx_bytes_per_s": p.fsx,
            "prefixes_needed": prefixes_needed(job, inp),
        }
        for r in p.rows():
            above = r["shared binds above"]
            rows.append(
                {
                    **r,
                    "s": _fmt_s(r["s"]),
                    "shared binds above": "" if above is None else f"{above / 1e6:,.0f} MB/s",
                }
            )
    print_table(
        f"scale: predictions ({LLAMA_70B.name} on {LLAMA_70B.gpus:,} GPUs, "
        f"{LLAMA_405B.name} on {LLAMA_405B.gpus:,})",
        rows,
        ["job", "what", "s", "binds", "scope", "shared binds above"],
    )
    layout = []
    for job in jobs:
        need = prefixes_needed(job, inp)["put"]
        for part in (8 * MiB, 64 * MiB, 128 * MiB):
            for prefixes in sorted({1, need}):
                i2 = inp.but(part_size=part, prefixes=prefixes)
                p = predict(job, i2)
                s3 = p.phases["on S3"]
                node_s = job.node_bytes / i2.s3_export
                layout.append(
                    {
                        "job": job.name,
                        "part MiB": part // MiB,
                        "prefixes": prefixes,
                        "PUTs per save": f"{p.save_requests:,}",
                        "S3 s": _fmt_s(s3.own),
                        "binds": s3.binding.name,
                        "PUT/s at the nodes' rate": f"{p.save_requests / node_s:,.0f}",
                        "limit": f"{inp.s3_put_per_prefix * prefixes:,.0f}",
                    }
                )
    print_table(
        "scale: S3 requests of one save by part size and prefixes",
        layout,
        [
            "job",
            "part MiB",
            "prefixes",
            "PUTs per save",
            "PUT/s at the nodes' rate",
            "limit",
            "S3 s",
            "binds",
        ],
    )
    out["layout"] = layout
    mrows, trows = [], []
    for job in jobs:
        for way in MANIFEST_WAYS:
            ph = manifest_phase(job, inp, way)
            mrows.append(
                {
                    "job": job.name,
                    "entries": f"{manifest_entries(job, inp):,}",
                    "GB": f"{manifest_bytes(job, inp) / 1e9:.2f}",
                    "way": way,
                    "at restore s": _fmt_s(ph.seconds),
                    "binds": ph.binding.name,
                    "on every node s": _fmt_s(manifest_phase(job, inp, way, at_restore=False).own),
                }
            )
        got = targets(job, inp)
        trows.append(
            {"job": job.name, "replica spread": replica_spread(job)}
            | {k: f"{v:.2f}" for k, v in got.items()}
        )
    print_table(
        "scale: the manifest (items x chunks x bytes per entry) and its trip to the ranks",
        mrows,
        ["job", "entries", "GB", "way", "at restore s", "binds", "on every node s"],
    )
    print_table(
        "scale: the targets of issue 49 (goals: 1.2, 2.05, 1.5)",
        trows,
        ["job", "replica spread", *targets(jobs[0], inp)],
    )
    out["manifest"], out["targets"] = mrows, trows
    return out


def check(inp: Inputs, runs: dict[int, dict[str, Any]], node_bytes: int) -> list[dict[str, Any]]:
    rows = []
    for nodes, times in sorted(runs.items()):
        model = local_check(inp, nodes, node_bytes)
        for name, ph in model.items():
            key = name.replace("NVMe", "nvme").replace("Lustre", "lustre").replace("S3", "s3")
            key = key.replace("restore from the replica", "restore from replica")
            got = times["times"].get(key)
            if got is None:
                continue
            rows.append(
                {
                    "nodes": nodes,
                    "what": name,
                    "model s": _fmt_s(ph.seconds),
                    "measured s": _fmt_s(got),
                    "measured / model": f"{got / ph.seconds:.2f}",
                    "binds": ph.binding.name,
                }
            )
    print_table(
        f"scale: the model beside torchrun runs here, {node_bytes // MiB} MiB per node, "
        "one rank per node",
        rows,
        ["nodes", "what", "model s", "measured s", "measured / model", "binds"],
    )
    return rows


def bracket(runs: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The 2-3 node runs against the 1-node run of the same batch: between "nothing shared"
    (each node as fast as one alone) and "all shared" (one node's time times the node
    count); ``shared``: where between the two, 0 to 1 (:func:`shared_fraction`)."""
    if 1 not in runs:
        return []
    one = runs[1]["times"]
    rows = []
    for nodes, got in sorted(runs.items()):
        if nodes == 1:
            continue
        for what, t in got["times"].items():
            t1 = one.get(what)
            if t1 is None:
                continue
            rows.append(
                {
                    "nodes": nodes,
                    "what": what,
                    "nothing shared s": _fmt_s(t1),
                    "all shared s": _fmt_s(nodes * t1),
                    "measured s": _fmt_s(t),
                    "shared": f"{shared_fraction(t1, t, nodes):.2f}",
                }
            )
    print_table(
        "scale: 2-3 nodes here against one node of the same batch",
        rows,
        ["nodes", "what", "nothing shared s", "all shared s", "measured s", "shared"],
    )
    return rows


#: the phases of a save with replicas (benchmarks/scale_worker.py), each ending at a mark
PHASES = [
    ("plan", "opened"),
    ("own write (replica sent beside it)", "own_write"),
    ("replica sends left after the own write", "sent"),
    ("commit + manifest to every node", "committed"),
    ("replicas held made durable (waited)", "received"),
    ("replicas counted (records, manifest)", "counted"),
    ("rest of save()", "returned"),
]


def phase_table(runs: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's phases of each save with replicas (a sync ``save``: no staging phase); the
    replica is streamed inside "own write", nothing is read back."""
    rows = []
    for nodes, got in sorted(runs.items()):
        for i, ph in enumerate(got.get("phases", [])):
            prev = 0.0
            for what, mark in PHASES:
                if mark not in ph:
                    continue
                rows.append(
                    {"nodes": nodes, "round": i, "phase": what, "s": _fmt_s(ph[mark] - prev)}
                )
                prev = ph[mark]
    print_table(
        "scale: phases of a save with replicas (rank 0)", rows, ["nodes", "round", "phase", "s"]
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="256 MiB figures, 64 MiB per node, one round"
    )
    ap.add_argument("--size", type=int, default=512, help="MiB for this node's figures")
    ap.add_argument("--node-mib", type=int, default=256, help="MiB per node in the check")
    ap.add_argument("--nodes", default="1,2,3", help="node counts of the check")
    ap.add_argument(
        "--rounds", type=int, default=None, help="runs of each measure, medians (3; --quick: 1)"
    )
    ap.add_argument("--inputs", help="a JSON of Inputs fields (skips measuring them)")
    ap.add_argument("--from-json", help="a scale.json of an earlier run: report it again")
    ap.add_argument("--no-check", action="store_true", help="predictions only")
    ap.add_argument("--dir", default=None, help="where the tiers' directories go")
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    size = (256 if args.quick else args.size) * MiB
    node_bytes = (64 if args.quick else args.node_mib) * MiB
    if args.from_json:
        old = json.loads(Path(args.from_json).read_text())
        inp = Inputs.from_json(old["inputs"])
        report(inp, [LLAMA_70B, LLAMA_405B])
        runs = {int(k): v for k, v in old.get("runs", {}).items()}
        check(inp, runs, old.get("node_bytes", node_bytes))
        bracket(runs)
        return
    base = tempfile.mkdtemp(prefix="fmstore-bench-scale-", dir=args.dir)
    payload: dict[str, Any] = {"node_bytes": node_bytes}
    try:
        with SeaweedServer() as s3:
            if args.inputs:
                inp = Inputs.from_json(json.loads(Path(args.inputs).read_text()))
                extra: dict[str, str] = {}
            else:
                inp, extra = measure(size, args.rounds, base, s3)
            irows = [
                {"input": k, "value": _fmt_rate(k, getattr(inp, k)), "source": inp.sources.get(k)}
                for k in inp.__dataclass_fields__
                if k != "sources"
            ]
            irows += [{"input": k, "value": v, "source": "SeaweedFS"} for k, v in extra.items()]
            print_table("scale: inputs", irows, ["input", "value", "source"])
            payload["inputs"] = {**inp.to_json(), **extra}
            payload["predictions"] = report(inp, [LLAMA_70B, LLAMA_405B])
            if not args.no_check:
                runs = {
                    n: run_nodes(n, node_bytes, args.rounds, base, s3)
                    for n in map(int, args.nodes.split(","))
                }
                payload["runs"] = runs
                payload["check"] = check(inp, runs, node_bytes)
                payload["bracket"] = bracket(runs)
                phase_table(runs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    save_json("scale", payload)


def _fmt_rate(name: str, v: Any) -> str:
    if isinstance(v, float) and v > 1e5 and "per_prefix" not in name:
        return f"{v / 1e9:.3f} GB/s" if name != "fsx_per_tib" else f"{v / 1e6:.0f} MB/s per TiB"
    if isinstance(v, int) and v >= MiB:
        return f"{v // MiB} MiB"
    return f"{v:g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
