"""Multi-rank checkpoints (torch.distributed.checkpoint): fmstore's Writer/Reader vs DCP's own
FileSystemWriter/Reader on the same directory, and on S3 (SeaweedFS) vs s3torchconnector's
S3StorageWriter/Reader and DCP's fsspec writer over s3fs (each when installed).

2 ranks (torchrun, gloo), a state of bf16 weights and fp32 Adam moments sharded as DTensors
(``--size`` is the total over both ranks).  Measured: save time (barrier to barrier), cold
load time (page cache dropped before each POSIX load), both also against the disk's floor
(each rank writes its tensors' bytes to one file with write + fsync and reads them back cold)
and for fmstore with ``compression="bytegroup+zstd"`` (fewer bytes for the disk, more CPU);
on S3 the server's ceiling for the same bytes is ``s5cmd cp`` of each rank's floor file up
and down (when s5cmd is installed);
and the ``async_save`` stall (how long
the training loop is blocked: staging) for fmstore's reusable-buffer Stager vs DCP's default
staging of FileSystemWriter.  Every method first saves and loads once untimed-for-the-ratio
(reported as "first save/load s"; to another URI): the compared times are a process's later
checkpoints, without one-time costs (imports, S3 client setup).  ``--no-warmup`` times the
first ones instead.

    python benchmarks/dcp.py --size 2GiB            # full size (quiet machine)
    python benchmarks/dcp.py --quick                # 128 MiB, to check the script works

Prints one table and writes benchmarks/out/dcp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import drop_caches, have, machine, print_table, save_json  # noqa: E402
from fmstore.testing.seaweed import free_ports  # noqa: E402


def parse_size(s: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = s.strip().lower().removesuffix("ib").removesuffix("b")
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(s)


# ---- worker (one per rank, under torchrun) ----------------------------------------------


def make_state(total: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    per_rank = total // world
    # A layer: bf16 weight (2 B/elt) + two fp32 moments (8 B/elt): 10 B per element.
    layer_elems = 16 << 20
    nlayers = max(1, per_rank // (layer_elems * 10))
    layer_elems = per_rank // (nlayers * 10)
    g = torch.Generator().manual_seed(rank)
    sd: dict[str, Any] = {"model": {}, "optim": {}}
    rows = 1024
    cols = max(1, layer_elems // rows)
    for i in range(nlayers):

        def dt(dtype: torch.dtype) -> DTensor:
            local = torch.randn(rows, cols, generator=g).to(dtype)
            return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

        sd["model"][f"layers.{i}.weight"] = dt(torch.bfloat16)
        sd["optim"][f"layers.{i}.exp_avg"] = dt(torch.float32)
        sd["optim"][f"layers.{i}.exp_avg_sq"] = dt(torch.float32)
    sd["optim"]["step"] = 100
    return sd


def nbytes_of(sd: Any) -> int:
    import torch

    if isinstance(sd, dict):
        return sum(nbytes_of(v) for v in sd.values())
    if isinstance(sd, torch.Tensor):
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        return local.numel() * local.element_size()
    return 0


def zeros_like_state(sd: Any) -> Any:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, DTensor):
        return DTensor.from_local(
            torch.zeros_like(sd.to_local()), sd.device_mesh, sd.placements, run_check=False
        )
    return sd


def writers(kind: str, uri: str, s3: dict[str, Any]) -> tuple[Any, Any]:
    """(writer, reader) for one method."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from fmstore.checkpoint.dcp import Reader, Writer

    if kind == "fmstore-zstd":
        w = Writer(uri, overwrite=True, compression="bytegroup+zstd")
        return w, Reader(uri)
    if kind == "fmstore":
        so = s3 if uri.startswith("s3://") else {}
        if so:
            # Import the S3 backend's client library here, as the peers' packages are
            # imported below, so no method's first save is charged with its imports.
            import aiobotocore.session  # noqa: F401

            import fmstore.stores.s3  # noqa: F401
        return Writer(uri, store_options=so, overwrite=True), Reader(uri, store_options=so)
    if kind == "dcp-fs":
        return FileSystemWriter(uri, sync_files=True), FileSystemReader(uri)
    if kind == "s3torchconnector":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        os.environ.setdefault("AWS_ACCESS_KEY_ID", s3["access_key"])
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", s3["secret_key"])
        cfg = S3ClientConfig(force_path_style=True)
        sw = S3StorageWriter(region=s3["region"], path=uri, s3client_config=cfg)
        sr = S3StorageReader(region=s3["region"], path=uri, s3client_config=cfg)
        # Its DCP classes take no endpoint: give their file system a client for this server.
        for x in (sw, sr):
            x.fs._client = S3Client(
                region=s3["region"], endpoint=s3["endpoint_url"], s3client_config=cfg
            )
        return sw, sr
    if kind == "dcp-fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        opts = {
            "key": s3["access_key"],
            "secret": s3["secret_key"],
            "client_kwargs": {"endpoint_url": s3["endpoint_url"], "region_name": s3["region"]},
        }
        return FsspecWriter(uri, sync_files=False, **opts), FsspecReader(uri, **opts)
    raise ValueError(kind)


def save_and_load(sd: dict[str, Any], w: Any, r: Any, uri: str) -> tuple[float, float]:
    """Seconds of one save with ``w`` and one cold load (page cache dropped on local tiers)
    with ``r``, every rank between barriers."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=w)
    dist.barrier()
    save_s = time.perf_counter() - t0
    if dist.get_rank() == 0 and not uri.startswith("s3://"):
        drop_caches()
    target = zeros_like_state(sd)
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=r)
    dist.barrier()
    return save_s, time.perf_counter() - t0


def local_tensors(sd: Any) -> list[Any]:
    import torch

    if isinstance(sd, dict):
        return [t for v in sd.values() for t in local_tensors(v)]
    if isinstance(sd, torch.Tensor):
        return [sd.to_local() if hasattr(sd, "to_local") else sd]
    return []


def floor(sd: dict[str, Any], path: str) -> tuple[float, float]:
    """The disk's floor for the same bytes, between the same barriers: each rank writes its
    tensors' bytes to one file (write + fsync), then reads them back cold into fresh
    tensors (page cache dropped)."""
    import torch
    import torch.distributed as dist

    tensors = local_tensors(sd)
    os.makedirs(path, exist_ok=True)
    name = os.path.join(path, f"rank{dist.get_rank()}.bin")
    dist.barrier()
    t0 = time.perf_counter()
    with open(name, "wb", buffering=0) as f:
        for t in tensors:
            f.write(t.contiguous().view(torch.uint8).numpy())
        os.fsync(f.fileno())
    dist.barrier()
    save_s = time.perf_counter() - t0
    if dist.get_rank() == 0:
        drop_caches()
    dist.barrier()
    t0 = time.perf_counter()
    with open(name, "rb", buffering=0) as f:
        for t in tensors:
            out = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
            f.readinto(out.numpy())
    dist.barrier()
    return save_s, time.perf_counter() - t0


def s3_ceiling(path: str, uri: str, s3: dict[str, Any]) -> tuple[float, float]:
    """What the server takes and gives for the same bytes with a lean native client: each
    rank uploads the file :func:`floor` wrote with ``s5cmd cp`` and downloads it again,
    between the same barriers."""
    import torch.distributed as dist

    exe = os.path.join(os.path.dirname(sys.executable), "s5cmd")
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3["access_key"],
        "AWS_SECRET_ACCESS_KEY": s3["secret_key"],
        "AWS_REGION": s3["region"],
    }
    base = [exe, "--endpoint-url", s3["endpoint_url"], "cp", "--concurrency", "16"]
    name = f"rank{dist.get_rank()}.bin"
    times = []
    for src, dst in (
        (os.path.join(path, name), f"{uri}/{name}"),
        (f"{uri}/{name}", os.path.join(path, "back-" + name)),
    ):
        dist.barrier()
        t0 = time.perf_counter()
        subprocess.run([*base, src, dst], env=env, check=True, capture_output=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fmstore.checkpoint.dcp import Stager, async_save

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    s3 = json.loads(os.environ.get("BENCH_S3", "{}"))
    sd = make_state(args.size)
    local_bytes = nbytes_of(sd)
    results: list[dict[str, Any]] = []
    for spec in args.methods:
        kind, uri = spec.split("=", 1)
        first: dict[str, float] = {}
        if kind in ("floor", "s5cmd"):
            floor_dir = args.methods[0].split("=", 1)[1]  # the floor runs first
            save_s, load_s = floor(sd, uri) if kind == "floor" else s3_ceiling(floor_dir, uri, s3)
        else:
            if args.warmup:
                # The first save of a process also pays one-time costs (imports, an S3
                # client's service models and connections): timed here, reported apart, on
                # its own URI.
                w, r = writers(kind, uri + "-first", s3)
                first["first_save_s"], first["first_load_s"] = save_and_load(sd, w, r, uri)
            w, r = writers(kind, uri, s3)
            save_s, load_s = save_and_load(sd, w, r, uri)
        results.append(
            {
                "method": kind,
                "uri": uri,
                "save_s": save_s,
                "load_s": load_s,
                "bytes": local_bytes,
                **first,
            }
        )
        if uri.startswith("s3://") or kind != "fmstore" and kind != "dcp-fs":
            continue
        # async_save stall on the same tier: fmstore's Stager (2nd save: buffers reused)
        # vs DCP's default staging for its writer.
        pg = dist.new_group(backend="gloo")
        stalls = []
        if kind == "fmstore":
            stager = Stager()
            for _ in range(2):
                w, _r = writers(kind, uri, s3)
                t0 = time.perf_counter()
                fut = async_save(sd, w, stager=stager, process_group=pg)
                stalls.append(time.perf_counter() - t0)
                fut.result()
        else:
            for _ in range(2):
                w, _r = writers(kind, uri, s3)
                t0 = time.perf_counter()
                fut = dcp.async_save(sd, storage_writer=w, process_group=pg)
                stalls.append(time.perf_counter() - t0)
                fut.result()
        results[-1]["stall_first_s"] = stalls[0]
        results[-1]["stall_s"] = stalls[1]
        dist.barrier()
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


# ---- driver -----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="2GiB", help="total state over both ranks")
    ap.add_argument("--quick", action="store_true", help="128 MiB")
    ap.add_argument("--dir", default=None, help="directory for the POSIX runs")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 runs")
    ap.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="time each method's first save and load in the process (one-time costs included)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--methods", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.size = parse_size("128MiB" if args.quick else args.size)
    if args.worker:
        worker(args)
        return

    base = tempfile.mkdtemp(prefix="fmstore-bench-dcp-", dir=args.dir)
    methods = [
        f"floor={base}/floor",
        f"fmstore={base}/fmstore",
        f"dcp-fs={base}/dcp-fs",
        f"fmstore-zstd={base}/fmstore-zstd",
    ]
    env = dict(os.environ)
    server = None
    skipped = []
    if not args.no_s3:
        from fmstore.testing.seaweed import SeaweedServer

        server = SeaweedServer().start()
        bucket = server.create_bucket()
        env["BENCH_S3"] = json.dumps(server.store_options())
        if os.access(os.path.join(os.path.dirname(sys.executable), "s5cmd"), os.X_OK):
            methods.append(f"s5cmd=s3://{bucket}/s5cmd")
        else:
            skipped.append("S3 ceiling with s5cmd (not installed)")
        methods.append(f"fmstore=s3://{bucket}/fmstore")
        if have("s3torchconnector"):
            methods.append(f"s3torchconnector=s3://{bucket}/s3tc")
        else:
            skipped.append("s3torchconnector (not installed)")
        if have("s3fs"):
            methods.append(f"dcp-fsspec=s3://{bucket}/fsspec")
        else:
            skipped.append("DCP fsspec writer over s3fs (s3fs not installed)")
    out_json = os.path.join(base, "worker.json")
    try:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--master-addr=127.0.0.1", f"--master-port={free_ports(1)[0]}", os.path.abspath(__file__),
            "--worker", "--worker-out", out_json, "--size", str(args.size), "--methods", *methods,
        ] + ([] if args.warmup else ["--no-warmup"])  # fmt: skip
        subprocess.run(cmd, env=env, check=True)
        with open(out_json) as f:
            res = json.load(f)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)

    total = args.size
    rows = []
    ref = {("s3" if r["uri"].startswith("s3://") else "posix", r["method"]): r for r in res}
    for r in res:
        tier = "s3" if r["uri"].startswith("s3://") else "posix"
        peer = ref.get((tier, "dcp-fs" if tier == "posix" else "s3torchconnector"))
        row = {
            "tier": tier,
            "method": r["method"],
            "save s": round(r["save_s"], 3),
            "save MB/s": round(total / r["save_s"] / 1e6),
            "load s": round(r["load_s"], 3),
            "load MB/s": round(total / r["load_s"] / 1e6),
            "stall s": round(r["stall_s"], 4) if "stall_s" in r else "",
            "first save s": round(r["first_save_s"], 3) if "first_save_s" in r else "",
            "first load s": round(r["first_load_s"], 3) if "first_load_s" in r else "",
        }
        fl = ref.get((tier, "floor" if tier == "posix" else "s5cmd"))
        if fl is not None and fl is not r:
            row["save x floor"] = round(fl["save_s"] / r["save_s"], 2)
            row["load x floor"] = round(fl["load_s"] / r["load_s"], 2)
        if peer is not None and peer is not r and r["method"] not in ("floor", "s5cmd"):
            row["save x peer"] = round(peer["save_s"] / r["save_s"], 2)
            row["load x peer"] = round(peer["load_s"] / r["load_s"], 2)
            if "stall_s" in r and "stall_s" in peer:
                row["stall / peer"] = round(r["stall_s"] / peer["stall_s"], 2)
        rows.append(row)
    cols = ["tier", "method", "save s", "save MB/s", "load s", "load MB/s", "stall s",
            "save x peer", "load x peer", "stall / peer", "save x floor", "load x floor",
            "first save s", "first load s"]  # fmt: skip
    print_table(f"DCP, 2 ranks, {total / 2**20:.0f} MiB total", rows, cols)
    for s in skipped:
        print(f"skipped: {s}")
    cold = drop_caches()
    path = save_json(
        "dcp",
        {
            "machine": machine(),
            "size": total,
            "results": res,
            "rows": rows,
            "skipped": skipped,
            "cold_cache": cold,
        },  # fmt: skip
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
