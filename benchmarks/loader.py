"""Streaming dataloaders from S3: fmstore vs mosaicml-streaming vs litdata (vs WebDataset),
against the floor (the same samples fed from memory), one run, one SeaweedFS.

    python -m benchmarks.loader [--size 2GiB] [--b-samples 100000]
        [--case a,b,ranks,shuffle,nodes] [--nodes 4] [--nodes-size 256MiB] [--quick]

(a) ``--size`` bytes of uint16 tokens read as 2048-token sequences (and, as
``fmstore-parquet``, the same sequences as a Parquet ``fixed_size_list<uint16>[2048]``
column, files of 64 MiB, row groups of 1024 rows, pyarrow's default snappy; as
``litdata-tokens``, litdata's own layout for token streams, its ``TokensLoader``, beside
``litdata``'s one numpy array per item); every reader yields uint16 arrays, as the floor
does (fmstore's ``sample_dtype=None``: by default it yields int64); (b) ``--b-samples``
samples of ~100 KB.  Each library converts the data with its own writer; everything is
served from the same SeaweedFS started here.  Each reader runs in its own process through
the same ``DataLoader`` (``--workers`` workers, batch ``--batch``): epoch 1 with an empty
cache (cold), epoch 2 warm.  Reported: samples/s per epoch, time to the first batch, peak
RSS (the reader's process plus its largest worker), bytes in the local cache after each
epoch (what was downloaded and kept), and fmstore / floor ratios.
Peers that are not installed are skipped with a note.

``ranks``: many ranks on one node (``--ranks`` ranks under torchrun, gloo, CPU, each with
``--workers`` DataLoader workers, one shared node cache) streaming (a)'s sequences, against
the floor fed from memory through the same DataLoader setup at the same ranks and workers:
aggregate samples/s per epoch, and the GETs and bytes per shard each epoch, counted at a
proxy in front of SeaweedFS (see ``benchmarks/loader_ranks.py``).

``shuffle``: how well the orders of ``--nodes`` nodes x 2 ranks mix (fmstore's global order
of old, its node-partitioned order, Mosaic's ``py1e`` at the same cache size, a uniform
permutation); ``nodes``: ``--nodes`` nodes x 2 ranks as plain processes with their own
caches, ``--nodes-size`` of (a)'s sequences on SeaweedFS, the bytes each node read counted
at its own proxy, for fmstore (node-partitioned and global) and Mosaic Streaming (see
``benchmarks/loader_nodes.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import have, print_table, save_json

SEQ = 2048
B_SIZE = 100_000
SHARD = 64 << 20
PEERS = ("fmstore", "fmstore-parquet", "mosaic", "litdata", "litdata-tokens", "webdataset")
PQ_ROW_GROUP = 1024
#: Where each litdata layout goes in the bucket (neither a prefix of the other).
LIT_PREFIX = {"litdata": "lit-items", "litdata-tokens": "lit-tokens"}


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


# ---- data ----------------------------------------------------------------------------


def tokens(size: int) -> np.ndarray:
    n = size // 2 // SEQ * SEQ
    return np.random.default_rng(0).integers(0, 50_000, n, dtype=np.uint16)


def blobs(n: int) -> Iterator[bytes]:
    """The (b) samples, regenerated identically on every call (never all held at once)."""
    rng = np.random.default_rng(1)
    for _ in range(n):
        yield rng.integers(
            0, 256, B_SIZE + int(rng.integers(-2000, 2000)), dtype=np.uint8
        ).tobytes()


def upload_dir(client: Any, local: str, bucket: str, prefix: str) -> None:
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=8)
    for root, _dirs, files in os.walk(local):
        for f in files:
            path = os.path.join(root, f)
            key = f"{prefix}/{os.path.relpath(path, local)}"
            client.upload_file(path, bucket, key, Config=cfg)


def write_all(
    case: str, srv: Any, bucket: str, work: str, args: argparse.Namespace, peers: list[str]
) -> None:
    """Convert the case's data with each library's writer and put it in the bucket."""
    from fmstore.stores import open_store

    client = srv.boto3_client()
    opts = srv.store_options()
    data: Any = tokens(args.size) if case == "a" else None
    seqs = data.reshape(-1, SEQ) if case == "a" else None

    def samples() -> Any:
        return seqs if case == "a" else blobs(args.b_samples)

    t0 = time.perf_counter()
    if "fmstore" in peers:
        from fmstore.loaders import write_dataset, write_samples

        dst = open_store(f"s3://{bucket}/fmstore", **opts)
        if case == "a":
            np.save(os.path.join(work, "tok.npy"), data)
            write_dataset(os.path.join(work, "tok.npy"), dst, shard_size=SHARD)
            os.unlink(os.path.join(work, "tok.npy"))
        else:
            write_samples(samples(), dst, shard_size=SHARD)
    if "fmstore-parquet" in peers and case == "a":
        write_parquet(seqs, os.path.join(work, "parquet"))
        upload_dir(client, os.path.join(work, "parquet"), bucket, "parquet")
        shutil.rmtree(os.path.join(work, "parquet"))
    if "mosaic" in peers:
        mds_writer = _mds_writer()
        out = os.path.join(work, "mds")
        cols = {"tokens": f"ndarray:uint16:{SEQ}"} if case == "a" else {"data": "bytes"}
        with mds_writer(out=out, columns=cols, size_limit=SHARD) as w:
            for x in samples():
                w.write({"tokens": x} if case == "a" else {"data": x})
        upload_dir(client, out, bucket, "mds")
        shutil.rmtree(out)  # the local copy is only the writer's staging
    for lit in [p for p in ("litdata", "litdata-tokens") if p in peers]:
        from litdata.streaming.item_loader import TokensLoader
        from litdata.streaming.writer import BinaryWriter

        if lit == "litdata-tokens" and case != "a":
            continue
        out = os.path.join(work, lit)
        loader = TokensLoader() if lit == "litdata-tokens" else None
        w = BinaryWriter(out, chunk_bytes=SHARD, item_loader=loader)
        for i, x in enumerate(samples()):
            w[i] = x
        w.done()
        w.merge()
        upload_dir(client, out, bucket, LIT_PREFIX[lit])
        shutil.rmtree(out)
    if "webdataset" in peers and case == "b":
        import webdataset as wds

        out = os.path.join(work, "wds")
        os.makedirs(out)
        with wds.ShardWriter(os.path.join(out, "shard-%05d.tar"), maxsize=SHARD, verbose=0) as w:
            for i, x in enumerate(samples()):
                w.write({"__key__": f"{i:08d}", "bin": x})
        upload_dir(client, out, bucket, "wds")
        shutil.rmtree(out)
    print(
        f"case {case}: data written by {', '.join(peers)} in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )


def write_parquet(seqs: np.ndarray, out: str) -> None:
    """``seqs`` as Parquet files of about ``SHARD`` bytes, one ``tokens`` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out)
    per_file = max(1, SHARD // seqs[0].nbytes)
    for k, lo in enumerate(range(0, len(seqs), per_file)):
        part = seqs[lo : lo + per_file]
        col = pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), SEQ)
        pq.write_table(
            pa.table({"tokens": col}),
            os.path.join(out, f"train-{k:05d}.parquet"),
            row_group_size=PQ_ROW_GROUP,
        )


def _mds_writer() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from peer_libs import import_mds_writer  # streaming.base, without its vision package

    return import_mds_writer()


# ---- one reader, in its own process -----------------------------------------------------


def make_loader(lib: str, case: str, cfg: dict[str, Any], cache: str, epoch: int) -> Any:
    import torch.utils.data as tud

    bucket, opts, batch, workers = cfg["bucket"], cfg["opts"], cfg["batch"], cfg["workers"]
    if lib == "floor":
        data = (
            tokens(cfg["size"]).reshape(-1, SEQ) if case == "a" else list(blobs(cfg["b_samples"]))
        )

        class Mem(tud.Dataset):
            def __len__(self) -> int:
                return len(data)

            def __getitem__(self, i: int) -> Any:
                return data[i].copy() if case == "a" else data[i]

        return tud.DataLoader(Mem(), batch_size=batch, num_workers=workers, shuffle=True)
    if lib == "fmstore":
        from fmstore.loaders import StreamingDataLoader, StreamingDataset

        # uint16 samples, as the floor and the peers yield them (int64 is the default).
        kw = {"seq_len": SEQ, "targets": False, "sample_dtype": None} if case == "a" else {}
        ds = StreamingDataset(
            f"s3://{bucket}/fmstore", cache, batch_size=batch, storage_options=opts, **kw
        )
        ds.set_epoch(epoch)
        return StreamingDataLoader(ds, batch_size=batch, num_workers=workers)
    if lib == "fmstore-parquet":
        from fmstore.loaders import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(
            f"s3://{bucket}/parquet", cache, batch_size=batch, storage_options=opts,
            format="parquet", transform=lambda s: s["tokens"],
        )  # fmt: skip
        ds.set_epoch(epoch)
        return StreamingDataLoader(ds, batch_size=batch, num_workers=workers)
    if lib == "mosaic":
        _mds_writer()
        from streaming.base import StreamingDataset as MDS
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        os.environ.update(
            S3_ENDPOINT_URL=opts["endpoint_url"],
            AWS_ACCESS_KEY_ID=opts["access_key"],
            AWS_SECRET_ACCESS_KEY=opts["secret_key"],
            AWS_DEFAULT_REGION=opts.get("region") or "us-east-1",
        )
        ds = MDS(remote=f"s3://{bucket}/mds", local=cache, batch_size=batch, shuffle=True)
        # The index was fetched here, in the parent, with a boto3 client the DataLoader's
        # forked workers would inherit, open connection and all: two workers then read one
        # socket (a 60 s read-timeout stall, or another response's bytes in a shard).  Drop
        # it, so that each worker opens its own, as on a spawn start.
        for stream in ds.streams:
            stream._downloader.clean_up()
        return tud.DataLoader(ds, batch_size=batch, num_workers=workers)
    if lib in ("litdata", "litdata-tokens"):
        import litdata
        import litdata.streaming.downloader as dl
        from litdata.streaming.item_loader import TokensLoader

        # obstore refuses plain-http endpoints unless its client options allow them.
        dl._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
        storage = {
            "endpoint_url": opts["endpoint_url"],
            "aws_access_key_id": opts["access_key"],
            "aws_secret_access_key": opts["secret_key"],
            "region_name": opts.get("region") or "us-east-1",
        }
        # litdata yields bytes items as memoryviews, which workers cannot pickle back.
        # litdata-tokens: the layout litdata's guide gives token streams (chunks read as
        # one memory map, whichever workers share them); litdata: one array per item.
        ds = litdata.StreamingDataset(
            f"s3://{bucket}/{LIT_PREFIX[lib]}",
            cache_dir=cache,
            shuffle=True,
            storage_options=storage,
            transform=None if case == "a" else bytes,
            item_loader=TokensLoader(block_size=SEQ) if lib == "litdata-tokens" else None,
        )
        return litdata.StreamingDataLoader(ds, batch_size=batch, num_workers=workers)
    if lib == "webdataset":
        import webdataset as wds

        client = _boto3(opts)
        keys = sorted(
            o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="wds/")["Contents"]
        )
        urls = [
            "pipe:curl -s -f '"
            + client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": k})
            + "'"
            for k in keys
        ]
        ds = wds.WebDataset(
            urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node, empty_check=False
        )
        ds = ds.shuffle(1000).to_tuple("bin")
        return tud.DataLoader(ds, batch_size=batch, num_workers=workers)
    raise ValueError(lib)


def _boto3(opts: dict[str, Any]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        aws_access_key_id=opts["access_key"],
        aws_secret_access_key=opts["secret_key"],
        region_name=opts.get("region") or "us-east-1",
    )


def dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # a file evicted meanwhile
                total += os.path.getsize(os.path.join(root, f))
    return total


def run_one(lib: str, case: str, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = tempfile.mkdtemp(prefix=f"bench-{lib}-", dir=cfg["work"])
    out: dict[str, Any] = {"library": lib, "case": case}
    try:
        for epoch in (1, 2):
            loader = make_loader(lib, case, cfg, cache, epoch)
            t0 = time.perf_counter()
            first = None
            n = 0
            for batch in loader:
                if first is None:
                    first = time.perf_counter() - t0
                n += _batch_len(batch)
            dt = time.perf_counter() - t0
            out[f"e{epoch}_samples_s"] = n / dt
            out[f"e{epoch}_first_batch_s"] = first
            out[f"e{epoch}_samples"] = n
            out[f"e{epoch}_cache_bytes"] = dir_bytes(cache)
            del loader
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out["peak_rss_mib"] = (me + kids) / 1024
    return out


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (list, tuple)):
        batch = batch[0]
    if isinstance(batch, (list, tuple)) and len(batch) == 1 and hasattr(batch[0], "shape"):
        batch = batch[0]
    return len(batch)


# ---- driver ------------------------------------------------------------------------------


def available(peers: list[str]) -> tuple[list[str], list[str]]:
    ok, notes = [], []
    mods = {
        "fmstore": "fmstore",
        "fmstore-parquet": "pyarrow",
        "mosaic": "streaming",
        "litdata": "litdata",
        "litdata-tokens": "litdata",
        "webdataset": "webdataset",
    }
    for p in peers:
        if have(mods[p]):
            ok.append(p)
        else:
            notes.append(
                f"{p}: not installed, skipped (pip install -c constraints.txt -e '.[bench]')"
            )
    return ok, notes


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="2GiB", help="case (a): bytes of uint16 tokens")
    ap.add_argument("--b-samples", type=int, default=100_000, help="case (b): samples of ~100 KB")
    ap.add_argument(
        "--case",
        default="a,b,ranks,shuffle,nodes",
        help="comma-separated: a, b, ranks, shuffle, nodes ('both': a,b)",
    )
    ap.add_argument("--nodes", type=int, default=4, help="nodes of the 'shuffle' and 'nodes' cases")
    ap.add_argument("--nodes-size", default="256MiB", help="'nodes' case: bytes of uint16 tokens")
    ap.add_argument("--ranks", type=int, default=4, help="ranks of the 'ranks' case")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="'ranks' case: runs of s5cmd's download, the floor and fmstore, taking turns "
        "(medians reported)",
    )
    ap.add_argument(
        "--peers", default=",".join(PEERS), help="comma-separated subset of " + ",".join(PEERS)
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="(a) 64 MiB, (b) 1000 samples")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per reader run")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--run-one", nargs=3, metavar=("LIB", "CASE", "CFG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_one:
        lib, case, cfg = args.run_one
        print("RESULT " + json.dumps(run_one(lib, case, json.loads(cfg))), flush=True)
        return
    args.size = _size("64MiB" if args.quick else args.size)
    args.nodes_size = _size("64MiB" if args.quick else args.nodes_size)
    cases = ["a", "b"] if args.case == "both" else [c.strip() for c in args.case.split(",")]
    if not set(cases) <= {"a", "b", "ranks", "shuffle", "nodes"}:
        ap.error(f"--case: choose from a, b, ranks, shuffle, nodes, not {args.case!r}")
    from benchmarks import loader_nodes

    shuffle_rows = (
        loader_nodes.shuffle_rows(args.nodes, 2, args.batch) if "shuffle" in cases else []
    )
    if shuffle_rows:
        print_table(
            f"Shuffle quality: {args.nodes} nodes x 2 ranks, {loader_nodes.SHARDS} shards x "
            f"{loader_nodes.PER_SHARD} samples, window {loader_nodes.WINDOW} shards, batch "
            f"{args.batch}",
            shuffle_rows,
            loader_nodes.SHUFFLE_COLUMNS,
        )
    if args.quick:
        args.b_samples = 1000
    peers, notes = available([p.strip() for p in args.peers.split(",") if p.strip()])
    for n in notes:
        print("note:", n)
    from fmstore.testing.seaweed import SeaweedServer

    work = tempfile.mkdtemp(prefix="bench-loader-", dir=args.work)
    rows: list[dict[str, Any]] = []
    rank_rows: list[dict[str, Any]] = []
    node_rows: list[dict[str, Any]] = []
    try:
        with SeaweedServer() as srv:
            if "nodes" in cases:
                os.makedirs(os.path.join(work, "nodes"))
                node_rows = loader_nodes.nodes_rows(srv, os.path.join(work, "nodes"), args)
            if "ranks" in cases:
                from benchmarks import loader_ranks

                os.makedirs(os.path.join(work, "ranks"))
                rank_rows = loader_ranks.run(srv, os.path.join(work, "ranks"), args)
            for case in [c for c in cases if c in ("a", "b")]:
                bucket = srv.create_bucket()
                case_work = os.path.join(work, case)
                os.makedirs(case_work)
                write_all(case, srv, bucket, case_work, args, peers)
                cfg = {
                    "bucket": bucket,
                    "opts": srv.store_options(),
                    "batch": args.batch,
                    "workers": args.workers,
                    "size": args.size,
                    "b_samples": args.b_samples,
                    "work": case_work,
                    "timeout": args.timeout,
                }
                only = {"webdataset": "b", "fmstore-parquet": "a", "litdata-tokens": "a"}
                libs = ["floor", *[p for p in peers if only.get(p, case) == case]]
                for lib in libs:
                    rows.append(_subprocess(lib, case, cfg))
                floor = next(r for r in rows if r["library"] == "floor" and r["case"] == case)
                for r in rows:
                    if r["case"] == case and "e1_samples_s" in r:
                        r["e1_vs_floor"] = r["e1_samples_s"] / floor["e1_samples_s"]
                        r["e2_vs_floor"] = r["e2_samples_s"] / floor["e2_samples_s"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cols = ["case", "library", "e1_samples_s", "e2_samples_s", "e1_vs_floor", "e2_vs_floor",
            "e1_first_batch_s", "e2_first_batch_s", "peak_rss_mib", "e1_cache_bytes", "e2_cache_bytes", "error"]  # fmt: skip
    if rows:
        print_table(
            "Streaming loaders from SeaweedFS: "
            + ", ".join(
                what
                for case, what in (
                    ("a", f"(a) {args.size >> 20} MiB of uint16 tokens as {SEQ}-token sequences"),
                    ("b", f"(b) {args.b_samples} samples of ~100 KB"),
                )
                if case in cases
            )
            + f"; DataLoader {args.workers} workers, batch {args.batch}",
            rows,
            cols,
        )
    if rank_rows:
        from benchmarks.loader_ranks import COLUMNS

        print_table(
            f"Many ranks on one node: {args.ranks} ranks x {args.workers} DataLoader workers, "
            f"one node cache, (a) {args.size >> 20} MiB as {SEQ}-token sequences, batch "
            f"{args.batch}; aggregate samples/s of all ranks vs the floor at the same shape",
            rank_rows,
            COLUMNS,
        )
    if node_rows:
        print_table(
            f"Several nodes: {args.nodes} nodes x 2 ranks as processes on loopback, each node its "
            f"own cache, {args.nodes_size >> 20} MiB of (a)'s sequences in shards of "
            f"{loader_nodes.NODE_SHARD >> 20} MiB on SeaweedFS, one epoch, no cache limit; bytes "
            "each node was sent, counted at its own proxy, over the dataset's",
            node_rows,
            loader_nodes.NODE_COLUMNS,
        )
    save_json(
        "loader",
        {
            "args": {k: v for k, v in vars(args).items() if k != "run_one"},
            "notes": notes,
            "rows": rows,
            "ranks_rows": rank_rows,
            "shuffle_rows": shuffle_rows,
            "nodes_rows": node_rows,
        },
    )


def _subprocess(lib: str, case: str, cfg: dict[str, Any]) -> dict[str, Any]:
    print(f"case {case}: {lib} ...", flush=True)
    cmd = [sys.executable, "-m", "benchmarks.loader", "--run-one", lib, case, json.dumps(cfg)]
    try:
        p = subprocess.run(
            cmd, capture_output=True, text=True, timeout=cfg["timeout"],
            cwd=str(Path(__file__).resolve().parent.parent),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"  timed out after {cfg['timeout']} s", flush=True)
        return {"library": lib, "case": case, "error": f"timed out after {cfg['timeout']} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            print(f"  {json.dumps(r)}", flush=True)
            return r
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    print(f"  failed: {' | '.join(tail)}", flush=True)
    return {
        "library": lib,
        "case": case,
        "error": (tail[-1] if tail else f"exit {p.returncode}")[:120],
    }


if __name__ == "__main__":
    main()
