"""Checkpoint engine: fmstore.save / load / async_save against torch.save, DCP and the floors.

    python -m benchmarks.checkpoint [--size 1GiB,4GiB] [--quick] [--dir PATH] [--no-s3]
                                    [--sections save,async,load,codecs,s3] [--rounds 3]

The state is a transformer's bf16 weights plus fp32 Adam moments (exp_avg, exp_avg_sq):
10 bytes per parameter.  For each size, in one run:

* sync save to a local directory: fmstore (compression raw, auto, bytegroup+zstd) vs
  torch.save + fsync vs DCP save (FileSystemWriter, sync_files=True) vs the floor (the
  same bytes written into one file with 16 MiB ``O_DIRECT`` writes + fsync); ``--rounds``
  rounds of every case in rotating order, medians (and every run);
* async stall (time the caller is blocked): fmstore.async_save vs DCP async_save vs the
  memcpy floor (copying every tensor once into preallocated, already touched memory).  Each
  first call runs in a fresh process (a process that has touched and freed memory before
  hands it out again without page faults): fmstore cold, fmstore after
  ``prepare_async_save`` (its staging buffer faulted in beforehand), DCP, and the first
  call's own floor, every tensor copied into one freshly allocated buffer (a page fault per
  page, which is what a first snapshot must pay); the steady state is the best of the next
  two calls in the same process;
* cold load (page cache dropped): fmstore.load (raw, raw+mmap, auto, bytegroup) vs
  torch.load vs DCP load vs the raw cold-read floor; a lazy load of 1% of the tensors (spread evenly; the
  share of bytes they hold is printed);
* compression ratio and MB/s per core (CPU time of one thread, best of 3) of raw / zstd /
  bytegroup+zstd on the bf16 weights and the fp32 moments;
* S3 (SeaweedFS started here) save and load: fmstore (compression raw, and auto, the
  default on S3) vs s3torchconnector's S3Checkpoint + torch.save / torch.load when it is
  installed (``make setup-bench``).  SeaweedFS grows volumes on a bucket's first writes, so
  every client first saves once, untimed; then ``--rounds`` rounds run every client in
  turn, in rotating order, each case from a settled machine and an idle server, and the
  table gives medians (and every run).  Beside the time: the client's CPU seconds per GiB
  (this process, every thread) and the server's (``/proc/<weed pid>/stat``).  On a
  machine whose cores the server shares, a save costs server CPU + client CPU: the server's
  share, the same for every client, bounds how far ahead a client can be.  Between rounds
  the bucket is emptied and vacuumed (untimed), so rounds of big states fit on the disk.

Every timed case starts from the same state (``benchmarks.common.settle``): no dirty pages
left by the case before and the page cache dropped, so a row agrees with the same case run
alone.  Peers that are not installed are skipped with a note.  Ratios: "vs floor" is floor time /
our time (1.0 = at the floor); "vs peer" (vs torch.save, vs DCP, vs s3torchconnector) is
peer time / our time (2.0 = twice as fast).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from typing import Any

import torch

import fmstore
from benchmarks.common import cpu_of, disk_of, have, print_table, save_json, settle
from fmstore.format.codecs import decode_into, encode

BLOCK = 64 << 20
ROWS: list[dict[str, Any]] = []
NOTES: list[str] = []


def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B?)\s*", s, re.I)
    if not m:
        raise SystemExit(f"bad size {s!r}: use e.g. 128MiB, 1GiB")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return int(
        float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    )


def make_state(total: int) -> dict[str, Any]:
    """bf16 weights + fp32 Adam moments, ~``total`` bytes (10 bytes per parameter)."""
    params = total // 10
    h = 1024 if params >= 24 * 1024 * 1024 else 512
    per_layer = 12 * h * h
    layers = max(1, (params - 8192 * h) // per_layer)
    g = torch.Generator().manual_seed(0)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (8192, h)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attn.qkv.weight": (3 * h, h),
            p + "attn.out.weight": (h, h),
            p + "mlp.up.weight": (4 * h, h),
            p + "mlp.down.weight": (h, 4 * h),
            p + "ln1.weight": (h,),
            p + "ln2.weight": (h,),
        }
    # What whole layers leave of the size: an output head of that many rows, so that a
    # size asked for is the size written (128 MiB, not 100).
    rest = params - 8192 * h - layers * per_layer
    if rest >= h:
        shapes["head.weight"] = (rest // h, h)
    model = {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    optim = {
        i: {
            "step": torch.tensor(100.0),
            "exp_avg": torch.randn(s, generator=g) * 1e-3,
            "exp_avg_sq": (torch.randn(s, generator=g) * 1e-3) ** 2,
        }
        for i, s in enumerate(shapes.values())
    }
    return {
        "model": model,
        "optim": {
            "state": optim,
            "param_groups": [
                {"lr": 1e-4, "betas": (0.9, 0.95), "params": list(range(len(shapes)))}
            ],
        },
        "step": 100,
    }


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def nbytes_of(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(obj))


def row(
    size: str, group: str, what: str, seconds: float, nbytes: int, **extra: Any
) -> dict[str, Any]:
    r = {
        "size": size,
        "group": group,
        "what": what,
        "s": seconds,
        "GB/s": nbytes / seconds / 1e9 if seconds else math.nan,
        **extra,
    }
    ROWS.append(r)
    return r


def clean(path: str) -> bool:
    """Remove ``path`` and :func:`settle`: the next case starts from a dropped cache."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)
    return settle()


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- floors --------------------------------------------------------------------------------


def raw_views(state: Any) -> list[memoryview]:
    out = []
    for t in tensors_of(state):
        u8 = t.detach().reshape(-1).view(torch.uint8)
        out.append(memoryview(u8.numpy()))
    return out


def floor_write(path: str, views: list[memoryview]) -> None:
    """The bytes to disk the shortest way: ``O_DIRECT`` writes of 16 MiB from one aligned
    buffer, then ``fsync``.  (Large buffered writes are no floor here: from 2 MiB per
    write the kernel takes whole 2 MiB blocks of free memory for the page cache, which
    this VM's host has taken back, and 920 MiB took 1.1-2.7 s instead of 0.7 s.)"""
    block = 16 << 20
    buf = mmap.mmap(-1, block)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        pos = 0
        for v in views:
            off = 0
            while off < len(v):
                piece = v[off : off + block - pos]
                buf[pos : pos + len(piece)] = piece
                pos += len(piece)
                off += len(piece)
                if pos == block:
                    os.write(fd, buf)
                    pos = 0
        if pos:
            # The tail, padded to a whole block of the device, then cut back to size.
            os.write(fd, memoryview(buf)[: -(-pos // 4096) * 4096])
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR) - (-pos % 4096))
        os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()


def floor_read(path: str, into: torch.Tensor) -> None:
    mv = memoryview(into.numpy())
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < len(mv):
            n = f.readinto(mv[pos : pos + BLOCK])
            if not n:
                break
            pos += n


# ---- sections ------------------------------------------------------------------------------


SAVE_LABELS = {
    "floor": "floor: O_DIRECT write+fsync, 1 file",
    "raw": "fmstore.save compression=raw",
    "auto": "fmstore.save compression=auto",
    "bytegroup+zstd": "fmstore.save compression=bytegroup+zstd",
    "torch": "torch.save + fsync",
    "dcp": "DCP save (FileSystemWriter, sync_files)",
}


def bench_save(tag: str, state: Any, root: str, n: int, rounds: int) -> dict[str, float]:
    """Every case ``rounds`` times, in rotating order, each from a settled machine (its
    file of the run before removed, every page written back and dropped); medians.  The
    last run of each case stays on disk for the load section."""
    views = raw_views(state)

    def torch_save(path: str) -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def dcp_save(path: str) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))

    cases: dict[str, Any] = {
        "floor": lambda path: floor_write(path, views),
        **{
            c: (lambda path, c=c: fmstore.save(state, path, compression=c))
            for c in ("raw", "auto", "bytegroup+zstd")
        },
        "torch": torch_save,
        "dcp": dcp_save,
    }
    paths = {"floor": "floor.bin", "torch": "torch.pt", "dcp": "dcp"}
    runs: dict[str, list[float]] = {}
    kinds = list(cases)
    for r in range(rounds):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            path = f"{root}/{paths.get(kind, f'fm-{kind}')}"
            clean(path)
            try:
                runs.setdefault(kind, []).append(timed(lambda k=kind, p=path: cases[k](p)))
            except Exception as e:  # pragma: no cover - depends on the torch build
                NOTES.append(f"{SAVE_LABELS[kind]} skipped: {e!r}")
                kinds.remove(kind)
                runs.pop(kind, None)
    t = {k: statistics.median(v) for k, v in runs.items()}
    for kind, secs in t.items():
        extra: dict[str, Any] = {"runs": " ".join(f"{x:.2f}" for x in runs[kind])}
        if kind != "floor":
            extra["vs floor"] = t["floor"] / secs
        if kind in ("raw", "auto", "bytegroup+zstd") and "torch" in t:
            extra["vs torch.save"] = t["torch"] / secs
        row(tag, "sync save", SAVE_LABELS[kind], secs, n, **extra)
    return t


STALL_KINDS = ("fmstore", "fmstore-prepared", "dcp", "fresh-memcpy")


def fresh_memcpy(state: Any) -> dict[str, float]:
    """The first call's floor: every tensor copied once into one buffer allocated for it,
    from the same start as a first save (fresh process, settled machine)."""
    srcs = [t.reshape(-1).view(torch.uint8) for t in tensors_of(state)]
    settle()
    t0 = time.perf_counter()
    buf = torch.empty(sum(s.numel() for s in srcs), dtype=torch.uint8)
    pos = 0
    for s in srcs:
        buf[pos : pos + s.numel()].copy_(s)
        pos += s.numel()
    return {"first": time.perf_counter() - t0}


def stall_child(kind: str, size: str, root: str) -> dict[str, float]:
    """In a fresh process: build the state, then time the stall of a first async save and
    of two more (steady state); ``fmstore-prepared`` calls ``prepare_async_save`` first."""
    state = make_state(parse_size(size))
    out: dict[str, float] = {}
    if kind == "fresh-memcpy":
        return fresh_memcpy(state)
    if kind == "dcp":
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        warnings.simplefilter("ignore")

        def start(path: str) -> Any:
            w = dcp.FileSystemWriter(path, sync_files=True)
            return dcp.async_save(state, storage_writer=w)
    else:
        if kind == "fmstore-prepared":
            t0 = time.perf_counter()
            fmstore.prepare_async_save(state).result()
            out["prepare s"] = time.perf_counter() - t0

        def start(path: str) -> Any:
            return fmstore.async_save(state, path, compression="raw")

    stalls = []
    for i in range(3):
        path = f"{root}/{kind}-{i}"
        clean(path)
        t0 = time.perf_counter()
        fut = start(path)
        stalls.append(time.perf_counter() - t0)
        fut.result()
        if i == 0:
            out["commit s"] = time.perf_counter() - t0
        shutil.rmtree(path, ignore_errors=True)
    out["first"], out["steady"] = stalls[0], min(stalls[1:])
    return out


def run_stall_child(kind: str, size: str, root: str) -> dict[str, float] | None:
    settle()
    cmd = [sys.executable, "-m", "benchmarks.checkpoint", "--size", size, "--dir", root]
    r = subprocess.run([*cmd, "--stall-child", kind], capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        NOTES.append(f"async stall of {kind} failed: {r.stderr.strip()[-300:]}")
        return None
    result: dict[str, float] = json.loads(lines[-1])
    return result


def bench_async(tag: str, size: str, state: Any, root: str, n: int) -> None:
    srcs = tensors_of(state)
    dsts = [torch.empty_like(t) for t in srcs]
    for d, s in zip(dsts, srcs):
        d.copy_(s)  # touch the pages once: the floor is a warm memcpy

    def memcpy() -> None:
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    floor = min(timed(memcpy) for _ in range(3))
    dsts.clear()  # give the memory back before the saves
    row(tag, "async stall", "floor: memcpy of every tensor", floor, n)
    got = {k: run_stall_child(k, size, root) for k in STALL_KINDS}
    fresh = got.pop("fresh-memcpy")
    if fresh is not None:
        row(
            tag, "async stall", "floor: memcpy into fresh memory (fresh process)", fresh["first"], n
        )
    peer = got["dcp"]
    labels = {
        "fmstore": "fmstore.async_save",
        "fmstore-prepared": "fmstore.async_save after prepare_async_save",
        "dcp": "DCP async_save",
    }
    for when, label in (("first", "first call, fresh process"), ("steady", "steady state")):
        for kind in got:
            r = got[kind]
            if r is None or (when == "steady" and kind == "fmstore-prepared"):
                continue  # steady state does not depend on how the first call went
            extra: dict[str, Any] = {"vs floor": floor / r[when]}
            if kind != "dcp" and peer is not None:
                extra["vs DCP"] = peer[when] / r[when]
            if when == "first":
                if fresh is not None:
                    extra["vs fresh floor"] = fresh["first"] / r[when]
                extra["commit s"] = r["commit s"]
                if "prepare s" in r:
                    extra["prepare s"] = r["prepare s"]
            row(tag, "async stall", f"{labels[kind]} ({label})", r[when], n, **extra)


def bench_load(tag: str, state: Any, root: str, n: int) -> None:
    bufs = [torch.empty(os.path.getsize(f"{root}/floor.bin"), dtype=torch.uint8)]
    bufs[0].fill_(0)  # the floor reads into touched memory, the others allocate their own

    def cold(what: str, fn: Any, **extra: Any) -> float:
        ok = settle()
        dt = timed(fn)
        return row(
            tag, "cold load" if ok else "load (WARM: cannot drop caches)", what, dt, n, **extra
        )["s"]

    floor = cold("floor: raw large-block read", lambda: floor_read(f"{root}/floor.bin", bufs[0]))
    size = bufs[0].numel()
    bufs.clear()
    # Every loader reads into memory it allocates, paying a page fault per page on first
    # touch; this floor pays them too (the one above does not).
    fresh = cold(
        "floor: raw large-block read into fresh memory",
        lambda: floor_read(f"{root}/floor.bin", torch.empty(size, dtype=torch.uint8)),
    )
    full = {}
    for comp, mm in (("raw", False), ("raw", True), ("auto", False), ("bytegroup+zstd", False)):
        label = f"fmstore.load compression={comp}" + (" mmap" if mm else "")
        full[(comp, mm)] = cold(label, lambda c=comp, m=mm: fmstore.load(f"{root}/fm-{c}", mmap=m))
        ROWS[-1]["vs floor"] = floor / full[(comp, mm)]
        ROWS[-1]["vs fresh floor"] = fresh / full[(comp, mm)]
    tl = cold("torch.load", lambda: torch.load(f"{root}/torch.pt", weights_only=True))
    ROWS[-1]["vs floor"] = floor / tl
    ROWS[-1]["vs fresh floor"] = fresh / tl
    for r in ROWS[-5:-1]:
        r["vs torch.load"] = tl / r["s"]
    with contextlib.suppress(Exception):
        import torch.distributed.checkpoint as dcp

        if os.path.isdir(f"{root}/dcp"):
            target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dl = cold(
                    "DCP load (weights only)",
                    lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(f"{root}/dcp")),
                )
            ROWS[-1]["note"] = "weights only"
            del dl
    manifest = fmstore.checkpoint.read_manifest_sync(f"{root}/fm-raw")
    names = [t.name for t in manifest.tensors]
    k = max(1, math.ceil(len(names) / 100))
    step = max(1, len(names) // k)
    # Evenly spread, starting mid-step: not always the first (embedding, biggest) tensor.
    pick = names[step // 2 :: step][:k]
    sizes = {t.name: manifest.storages[t.storage].nbytes for t in manifest.tensors}
    share = sum(sizes[p] for p in pick) / sum(s.nbytes for s in manifest.storages)

    def lazy() -> None:
        lz = fmstore.load(f"{root}/fm-raw", lazy=True)
        for name in pick:
            node: Any = lz
            parts = name.split(".")
            # model.<dotted key> / optim.state.<i>.<field>
            if parts[0] == "model":
                node = node["model"][".".join(parts[1:])]
            else:
                node = node["optim"]["state"][int(parts[2])][parts[3]]

    lz = cold(
        f"fmstore lazy load of 1% of tensors ({len(pick)} of {len(names)}, "
        f"{100 * share:.1f}% of bytes)",
        lazy,
    )
    ROWS[-1]["vs full load"] = lz / full[("raw", False)]


def bench_codecs(tag: str, state: Any) -> None:
    bf16 = torch.cat([t.reshape(-1) for t in state["model"].values()])[: 16 << 20]
    fp32 = torch.cat([s["exp_avg"].reshape(-1) for s in state["optim"]["state"].values()])[
        : 8 << 20
    ]
    for label, t in (("bf16 weights", bf16), ("fp32 exp_avg", fp32)):
        raw = memoryview(t.view(torch.uint8).numpy())
        for codec in ("raw", "zstd", "bytegroup+zstd"):
            # Best of 3, in CPU seconds of this thread: per-core speed, robust to a busy
            # machine (codec work here is single-threaded).
            enc = dec = math.inf
            out = bytearray(len(raw))
            for _ in range(3):
                t0 = time.thread_time()
                used, stored = encode(codec, raw, t.element_size())
                enc = min(enc, time.thread_time() - t0)
                t0 = time.thread_time()
                decode_into(used, stored, memoryview(out), t.element_size())
                dec = min(dec, time.thread_time() - t0)
            assert out == raw
            ROWS.append(
                {
                    "size": tag,
                    "group": "codec (CPU s, 1 core)",
                    "what": f"{codec} on {label}",
                    "ratio": len(raw) / len(stored),
                    "enc MB/s": len(raw) / enc / 1e6 if enc else math.inf,
                    "dec MB/s": len(raw) / dec / 1e6 if dec else math.inf,
                }
            )


S3_SAVES = {
    "fmstore": "fmstore.save to S3 compression=raw",
    "fmstore-auto": "fmstore.save to S3 compression=auto (the default on S3)",
    "s3torchconnector": "s3torchconnector S3Checkpoint + torch.save",
}
S3_LOADS = {
    "fmstore": "fmstore.load from S3 (raw)",
    "fmstore-auto": "fmstore.load from S3 (auto)",
    "s3torchconnector": "s3torchconnector S3Checkpoint + torch.load",
}


def _own_cpu() -> float:
    """CPU seconds of this process, every thread (the runtime's pools, the CRT's) included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _server_quiet(pid: int, timeout: float = 30.0) -> None:
    """Wait until the server stops working on what the case before left it (volume growth,
    flushes, a vacuum): under 5% of a core for half a second."""
    deadline = time.monotonic() + timeout
    last = cpu_of(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = cpu_of(pid)
        if now - last < 0.025:
            return
        last = now


def _disk_use(path: str) -> int:
    return sum(
        os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs
    )


def _free_space(server: Any, bucket: str) -> None:
    """Delete every object of ``bucket`` and have SeaweedFS reclaim the space: deleted
    chunks keep their disk space until a vacuum, and rounds of 4 GiB states would fill the
    disk.  The filer deletes chunks in the background, so the vacuum is repeated until the
    space is back (30 s at most).  Untimed, between rounds."""
    cli = server.boto3_client()
    for page in cli.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            cli.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000]})
    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
        args = f.read().decode().split("\0")
    port = next(a.split("=", 1)[1] for a in args if a.startswith("-master.port="))
    url = f"http://127.0.0.1:{port}/vol/vacuum?garbageThreshold=0.0001"
    deadline = time.monotonic() + 30
    while _disk_use(server.dir) > 256 << 20 and time.monotonic() < deadline:
        time.sleep(1)
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=300) as r:
            r.read()


def bench_s3(tag: str, state: Any, n: int, rounds: int) -> None:
    if not have("fmstore.stores.s3") or not have("fmstore.testing.seaweed"):
        NOTES.append("S3 section skipped: fmstore.stores.s3 / SeaweedFS launcher not available")
        return
    from fmstore.stores import open_store
    from fmstore.testing.seaweed import SeaweedServer

    with SeaweedServer() as server:
        assert server.proc is not None
        pid = server.proc.pid
        bucket = server.create_bucket("ckpt-bench")
        opts = server.store_options()
        saves: dict[str, Any] = {}
        loads: dict[str, Any] = {}
        for kind, comp in (("fmstore", "raw"), ("fmstore-auto", "auto")):

            def fm_save(key: str, c: str = comp) -> None:
                store = open_store(f"s3://{bucket}/{key}", **opts)
                try:
                    fmstore.save(state, store, compression=c)
                finally:
                    fmstore.runtime.run(store.close())

            def fm_load(key: str) -> None:
                store = open_store(f"s3://{bucket}/{key}", **opts)
                try:
                    fmstore.load(store)
                finally:
                    fmstore.runtime.run(store.close())

            saves[kind], loads[kind] = fm_save, fm_load
        if have("s3torchconnector"):
            from s3torchconnector import S3Checkpoint
            from s3torchconnector._s3client import S3ClientConfig

            # Credentials through the environment; SeaweedFS needs path-style addressing.
            os.environ.update(server.env())
            ck = S3Checkpoint(
                region=server.region,
                endpoint=server.endpoint_url,
                s3client_config=S3ClientConfig(force_path_style=True),
            )

            def tc_save(key: str) -> None:
                with ck.writer(f"s3://{bucket}/{key}.pt") as w:
                    torch.save(state, w)

            def tc_load(key: str) -> None:
                with ck.reader(f"s3://{bucket}/{key}.pt") as r:
                    torch.load(r, weights_only=True)

            saves["s3torchconnector"], loads["s3torchconnector"] = tc_save, tc_load
        else:
            NOTES.append("s3torchconnector not installed (make setup-bench): S3 peer skipped")
        # SeaweedFS grows its volumes on a bucket's first writes: every client writes once,
        # untimed, before anything is measured.
        for kind, fn in saves.items():
            fn(f"warm-{kind}")
        _free_space(server, bucket)
        got: dict[tuple[str, str], list[tuple[float, float, float]]] = {}

        def measure(op: str, kind: str, fn: Any, key: str) -> None:
            settle()
            _server_quiet(pid)
            c0, s0, t0 = _own_cpu(), cpu_of(pid), time.perf_counter()
            fn(key)
            dt = time.perf_counter() - t0
            got.setdefault((op, kind), []).append((dt, _own_cpu() - c0, cpu_of(pid) - s0))

        kinds = list(saves)
        for r in range(rounds):
            # Rotating order: no client always runs first (or right after the same peer).
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
            for kind in order:
                measure("save", kind, saves[kind], f"r{r}-{kind}")
            for kind in order:
                measure("load", kind, loads[kind], f"r{r}-{kind}")
            _free_space(server, bucket)
        gib = n / (1 << 30)
        for op, labels in (("save", S3_SAVES), ("load", S3_LOADS)):
            peer = got.get((op, "s3torchconnector"))
            peer_s = statistics.median(x[0] for x in peer) if peer else None
            for kind in kinds:
                runs = got[(op, kind)]
                s = statistics.median(x[0] for x in runs)
                extra: dict[str, Any] = {
                    "client CPU s/GiB": statistics.median(x[1] for x in runs) / gib,
                    "server CPU s/GiB": statistics.median(x[2] for x in runs) / gib,
                    "runs": " ".join(f"{x[0]:.2f}" for x in runs),
                }
                if peer_s is not None and kind != "s3torchconnector":
                    extra["vs s3torchconnector"] = peer_s / s
                row(tag, f"S3 {op}", labels[kind], s, n, **extra)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="1GiB,4GiB", help="comma-separated state sizes")
    ap.add_argument("--quick", action="store_true", help="one small size (128MiB)")
    ap.add_argument("--dir", default=None, help="local directory to write to (default: a temp dir)")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument(
        "--sections",
        default="save,async,load,codecs,s3",
        help="which sections to run (load reads what save wrote)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="sync saves and S3: rounds of every case in turn (medians)",
    )
    ap.add_argument("--stall-child", choices=STALL_KINDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stall_child:  # one fresh-process measurement for bench_async
        print(json.dumps(stall_child(args.stall_child, args.size, args.dir)))
        return
    sections = set(args.sections.split(","))
    if "load" in sections:
        sections.add("save")
    sizes = ["128MiB"] if args.quick else args.size.split(",")
    base = args.dir or tempfile.mkdtemp(prefix="fmstore-ckpt-bench-")
    os.makedirs(base, exist_ok=True)
    print(f"writing under {base}: {disk_of(base)}")
    try:
        for s in sizes:
            total = parse_size(s)
            state = make_state(total)
            n = nbytes_of(state)
            tag = f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"
            root = os.path.join(base, s)
            os.makedirs(root, exist_ok=True)
            if "save" in sections:
                bench_save(tag, state, root, n, args.rounds)
            if "async" in sections:
                bench_async(tag, s, state, root, n)
            if "load" in sections:
                bench_load(tag, state, root, n)
            if "codecs" in sections:
                bench_codecs(tag, state)
            if "s3" in sections and not args.no_s3:
                bench_s3(tag, state, n, args.rounds)
            shutil.rmtree(root, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    cols = [
        "size",
        "group",
        "what",
        "s",
        "GB/s",
        "vs floor",
        "vs fresh floor",
        "vs DCP",
        "vs torch.save",
        "vs s3torchconnector",
        "vs torch.load",
        "vs full load",
        "ratio",
        "enc MB/s",
        "dec MB/s",
        "commit s",
        "prepare s",
        "client CPU s/GiB",
        "server CPU s/GiB",
        "runs",
    ]
    text = print_table("checkpoint", ROWS, cols)
    for note in NOTES:
        print("note:", note)
    save_json("checkpoint", {"rows": ROWS, "notes": NOTES, "table": text, "sizes": sizes})


if __name__ == "__main__":
    main()
