"""Sharded checkpoints of a job of 1, 2 and 3 nodes on this machine: the save stall and the
time until a step is durable, on node-local NVMe, on Lustre and on S3.

Each node is a ``torchrun`` agent on loopback with 2 ranks and its own config (own ``nvme``
directory, ``scope = "node"``, own state directory: :mod:`fmstore.testing.cluster`); the
``lustre`` directory and one SeaweedFS S3 server are shared.  The state (``--size`` in all,
bf16 weights and two fp32 moments sharded as DTensors over every rank) is saved by every
way that works today, each timed barrier to barrier on every rank after one untimed round:

* ``fmstore nvme (async)``: :class:`~fmstore.tiering.managers.sharded.ShardedCheckpointManager`
  on the node-local tier: the stall (``save()`` returns once staged) and the time until
  the step is committed on every node;
* ``fmstore lustre (async)`` / ``fmstore s3 (async)``: the same manager writing to the
  shared tier: the stall, and the time until the step is durable there;
* ``fmstore Writer lustre`` / ``fmstore Writer s3``: ``fmstore.checkpoint.dcp.save``
  straight to the shared tier (the stall is the whole save);
* ``torch FileSystemWriter lustre``: ``dcp.save`` with torch's ``FileSystemWriter``
  (``sync_files=True``) straight to the Lustre directory;
* ``fmstore nvme + exports: lustre`` / ``s3``: the manager on the node-local tier while
  every node's ``fmstore daemon`` exports its own part (``every_steps`` policies): the
  stall, and the time from ``save()`` until the copy is committed on Lustre / S3 (its
  manifest there, written once every node's part is verified);
* the bounds of this machine: ``floor: disk`` (each rank writes its tensors' bytes to one
  file on the shared disk, write + fsync) and ``floor: s3 put`` (each rank PUTs the same
  bytes as one object with boto3's ``upload_file``, default multipart settings).

On one host every node shares
one disk and one S3 server (and here two cores), so more nodes do not add bandwidth: the
figures show how a fixed total divides, not how a cluster scales.

    python -m benchmarks.cluster --size 256MiB     # the figures of RESULTS.md
    python -m benchmarks.cluster --quick           # 32 MiB, to check the script works

Prints one table and writes benchmarks/out/cluster.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine, mbps, print_table, save_json  # noqa: E402
from benchmarks.dcp import floor, make_state, nbytes_of, parse_size  # noqa: E402

NODES = ("n0", "n1", "n2")
EXPORT_EVERY = 1000  # only the export phase's steps are exported
POLICIES = f"""
[policies]
ladder = ["nvme", "lustre", "s3"]
write_tier = "nvme"
[[policies.export]]
to = "lustre"
every_steps = {EXPORT_EVERY}
[[policies.export]]
to = "s3"
every_steps = {EXPORT_EVERY}
[daemon]
interval = "0.1s"
"""


# ---- worker (one per rank, under torchrun on every node) ---------------------------------


def _timed(fn: Any) -> tuple[float, float]:
    """(stall, durable): ``fn()`` returns a future or None; every rank between barriers."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fut = fn()
    stall = time.perf_counter() - t0
    if fut is not None:
        fut.result()
    dist.barrier()
    return stall, time.perf_counter() - t0


def s3_put(path: str, bucket: str, prefix: str) -> tuple[float, float]:
    """The server's bound: each rank uploads the file :func:`floor` wrote as one object."""
    import boto3
    import torch.distributed as dist

    c = boto3.client(
        "s3",
        endpoint_url=os.environ["BENCH_S3_ENDPOINT"],
        region_name=os.environ.get("BENCH_S3_REGION", "us-east-1"),
    )
    name = f"rank{dist.get_rank()}.bin"
    return _timed(lambda: c.upload_file(os.path.join(path, name), bucket, f"{prefix}/{name}"))


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import fmstore.checkpoint.dcp as fdcp
    from fmstore.config import get_config
    from fmstore.testing.cluster import pg_timeout
    from fmstore.tiering.managers.sharded import ShardedCheckpointManager

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=pg_timeout())
    ckpt = dist.new_group(backend="gloo", timeout=pg_timeout())
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = make_state(args.size)
    total = nbytes_of(sd) * world
    cfg = get_config()
    lustre = cfg.tier("lustre").url
    bucket = cfg.tier("s3").url.removeprefix("s3://").split("/", 1)[0]
    tag = f"w{world}"
    mgrs = {
        t: ShardedCheckpointManager(f"bench/{tag}/mgr-{t}", process_group=ckpt, write_tier=t)
        for t in ("nvme", "lustre", "s3")
    }
    names = [f"fmstore {t} (async)" for t in mgrs]
    names += ["fmstore Writer lustre", "fmstore Writer s3", "torch FileSystemWriter lustre"]

    def save_with(name: str, rnd: int) -> Any:
        """One save of round ``rnd``: a future (the managers') or None (done)."""
        if name.endswith("(async)"):
            return mgrs[name.split()[1]].save(rnd + 1, sd)
        if name.startswith("fmstore Writer"):
            tier = name.rsplit(" ", 1)[1]
            fdcp.save(sd, f"{tier}:bench/{tag}/fdcp/r{rnd}", process_group=ckpt)
            return None
        where = os.path.join(lustre, "bench", tag, "torchfs", f"r{rnd}")
        dcp.save(sd, storage_writer=FileSystemWriter(where, sync_files=True), process_group=ckpt)
        return None

    rows: dict[str, list[tuple[float, float]]] = {}
    for rnd in range(args.rounds + 1):  # round 0 is untimed: first-time costs
        for name in names:
            got = _timed(lambda name=name, rnd=rnd: save_with(name, rnd))
            if rnd:
                rows.setdefault(name, []).append(got)
        floor_dir = os.path.join(lustre, "bench", tag, "floor", f"r{rnd}")
        save_s, _load = floor(sd, floor_dir)
        put = s3_put(floor_dir, bucket, f"bench/{tag}/put/r{rnd}")
        if rnd:
            rows.setdefault("floor: disk", []).append((save_s, save_s))
            rows.setdefault("floor: s3 put", []).append(put)
        for m in mgrs.values():
            m.wait()
    exported = export_phase(args, sd, ckpt, tag)
    if rank == 0:
        for name, got in exported.items():
            rows[name] = got
        out = [
            {
                "method": name,
                "stall_s": min(s for s, _d in got),
                "durable_s": min(d for _s, d in got),
                "bytes": total,
                "ranks": world,
            }
            for name, got in rows.items()
        ]
        with open(args.worker_out, "w") as f:
            json.dump(out, f)
    dist.barrier(group=ckpt)
    dist.destroy_process_group()


def export_phase(
    args: argparse.Namespace, sd: dict[str, Any], ckpt: Any, tag: str
) -> dict[str, list[tuple[float, float]]]:
    """Saves to the node-local tier while the daemons export every node's part; rank 0
    watches Lustre and S3 for the commit (the manifest).  ``{name: [(stall, durable)]}``."""
    import boto3
    import torch.distributed as dist
    from botocore.exceptions import ClientError

    from fmstore.config import get_config
    from fmstore.tiering.managers.sharded import ShardedCheckpointManager

    cfg = get_config()
    lustre = cfg.tier("lustre").url
    bucket, _, prefix = cfg.tier("s3").url.removeprefix("s3://").partition("/")
    client = boto3.client(
        "s3",
        endpoint_url=os.environ["BENCH_S3_ENDPOINT"],
        region_name=os.environ.get("BENCH_S3_REGION", "us-east-1"),
    )
    root = f"bench/{tag}/exp"
    mgr = ShardedCheckpointManager(root, process_group=ckpt, write_tier="nvme")
    rows: dict[str, list[tuple[float, float]]] = {}
    for rnd in range(args.rounds + 1):
        step = EXPORT_EVERY * (rnd + 1)
        key = f"{root}/step_{step:012d}/manifest.json"
        dist.barrier()
        t0 = time.perf_counter()
        fut = mgr.save(step, sd)
        stall = time.perf_counter() - t0
        fut.result()
        done: dict[str, float] = {}
        if dist.get_rank() == 0:
            deadline = time.monotonic() + 900
            while len(done) < 2 and time.monotonic() < deadline:
                if "lustre" not in done and os.path.exists(os.path.join(lustre, key)):
                    done["lustre"] = time.perf_counter() - t0
                if "s3" not in done:
                    try:
                        client.head_object(Bucket=bucket, Key=f"{prefix}/{key}")
                        done["s3"] = time.perf_counter() - t0
                    except ClientError:
                        pass
                time.sleep(0.02)
        dist.barrier()
        if rnd:
            for tier, secs in done.items():
                rows.setdefault(f"fmstore nvme + exports: {tier}", []).append((stall, secs))
    return rows


# ---- driver -----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="256MiB", help="total state over every rank")
    ap.add_argument("--quick", action="store_true", help="32 MiB, 1 timed round")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds (best is reported)")
    ap.add_argument("--nodes", default="1,2,3", help="node counts to run")
    ap.add_argument("--dir", default=None, help="where the nodes' directories go")
    ap.add_argument("worker", nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.size, args.rounds = "32MiB", 1
    args.size = parse_size(args.size)
    if args.worker == "worker":
        worker(args)
        return

    from fmstore.testing.cluster import Cluster, S3Tier
    from fmstore.testing.seaweed import SeaweedServer

    rows: list[dict[str, Any]] = []
    with SeaweedServer() as s3, tempfile.TemporaryDirectory(dir=args.dir) as base:
        bucket = s3.create_bucket("bench-cluster")
        tier = S3Tier(f"s3://{bucket}/fm", s3.endpoint_url, s3.env(), s3.region)
        with Cluster(base, nproc=2, s3=tier, policies=POLICIES, pg_timeout=900) as c:
            for n in [int(x) for x in args.nodes.split(",")]:
                for node in NODES[:n]:  # they export the export phase's steps only
                    c.start_daemon(node)
                out = os.path.join(base, f"res-{n}.json")
                cmd = [os.path.abspath(__file__), "worker", "--size", str(args.size)]
                cmd += ["--rounds", str(args.rounds), "--worker-out", out]
                env = {"BENCH_S3_ENDPOINT": s3.endpoint_url, "BENCH_S3_REGION": s3.region}
                rcs = c.run(cmd[0], cmd[1:], NODES[:n], name=f"bench{n}", env=env, timeout=1800)
                for node in NODES[:n]:
                    c.kill_daemon(node)
                if rcs != [0] * n:
                    raise SystemExit(c.logs(f"bench{n}", NODES[:n]))
                with open(out) as f:
                    got = json.load(f)
                fl = next(r for r in got if r["method"] == "floor: disk")["durable_s"]
                put = next(r for r in got if r["method"] == "floor: s3 put")["durable_s"]
                for r in got:
                    on_s3 = "s3" in r["method"]
                    rows.append(
                        {
                            "nodes": n,
                            "ranks": r["ranks"],
                            "method": r["method"],
                            "stall s": "" if r["method"].startswith("floor") else r["stall_s"],
                            "durable s": r["durable_s"],
                            "MB/s": mbps(r["bytes"], r["durable_s"]),
                            "x floor": (put if on_s3 else fl) / r["durable_s"],
                        }
                    )
    size_mib = args.size / (1 << 20)
    title = f"sharded checkpoints of 1-3 nodes x 2 ranks, {size_mib:.0f} MiB in all, one host"
    print_table(
        title, rows, ["nodes", "ranks", "method", "stall s", "durable s", "MB/s", "x floor"]
    )
    save_json("cluster", {"size": args.size, "rows": rows, "machine": machine()})


if __name__ == "__main__":
    main()
