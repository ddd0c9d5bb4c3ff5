"""The multi-node cases of ``benchmarks/loader.py``: how well an order mixes, and what each
node downloads.

``shuffle`` (no I/O): the orders that ``--nodes`` nodes x ``--ranks-per-node`` ranks read
in one epoch of a dataset of ``SHARDS`` shards x ``PER_SHARD`` samples, for fmstore's
global order of old (``partition="global"``), fmstore's node-partitioned order, Mosaic
Streaming's ``py1e`` shuffle over its ``orig`` partition at the same cache size (its
``shuffle_block_size`` = fmstore's window in samples) and a uniform random permutation (the
ideal mix, no locality at all).  Per order:

* ``batch_shards``: distinct shards in a rank's batch of ``--batch`` samples (mean; more
  is better mixed, ``--batch`` at most);
* ``global_batch_shards``: distinct shards in one step's batches of all ranks (mean);
* ``neighbour_gap``: |original position of a sample - that of the one after it| on its
  rank, over the dataset's size (mean; a uniform shuffle gives 1/3);
* ``node_shards``: the share of all shards each node reads in the epoch (mean; 1.0: every
  node downloads every shard);
* ``open_shards``: the most shards a node has between their first and last use at one
  step (the cache footprint that never downloads a shard twice in the epoch).

``nodes``: ``--nodes`` nodes x 2 ranks as plain processes on loopback, each node its own
cache directory and its own counting proxy in front of one SeaweedFS, one epoch of case
(a)'s token sequences (fmstore shards, and MDS shards for Mosaic Streaming): bytes each
node read at the server, in total and for the busiest node, over the dataset's bytes, and
samples/s per rank, for fmstore (node-partitioned, the same without the first batches'
ranged reads, and global) and Mosaic Streaming (its nodes one after the other: its shared
memory names are per host, so two of its nodes cannot run on one host at once).
"""

from __future__ import annotations

from typing import Any

import numpy as np

SHARDS, PER_SHARD, WINDOW = 256, 512, 4


def _orders_fmstore(nodes: int, per: int, mode: str) -> list[np.ndarray]:
    from fmstore.loaders.order import Plan, ShuffleOptions, positions, rank_count

    counts = np.full(SHARDS, PER_SHARD, np.int64)
    plan = Plan([counts], ShuffleOptions(True, 0, WINDOW))
    parts = nodes if mode == "node" else 1
    order = plan.epoch(0, parts)
    world = nodes * per
    n = rank_count(len(order), 0, world)
    out = []
    for node in range(nodes):
        for lr in range(per):
            slot = node + nodes * lr if mode == "node" else node * per + lr
            out.append(order[positions(len(order), 0, slot, world, np.arange(n))])
    return out


def _orders_mosaic(nodes: int, per: int, batch: int) -> list[np.ndarray] | str:
    from benchmarks.loader import _mds_writer

    if _mds_writer() is None:  # imports streaming (with the torchvision stand-in if needed)
        return "mosaicml-streaming is not installed"
    from streaming.base.partition import get_partitions
    from streaming.base.shuffle import get_shuffle

    sizes = np.full(SHARDS, PER_SHARD, np.int64)
    shuffle = get_shuffle("py1e", sizes, nodes, 0, 0, block_size=WINDOW * PER_SHARD)
    ids = get_partitions("orig", SHARDS * PER_SHARD, nodes, nodes, per, 1, batch)
    out = []
    for node in range(nodes):
        for lr in range(per):
            seq = ids[node, lr].ravel()
            out.append(shuffle[seq[seq >= 0]])
    return out


def _orders_uniform(nodes: int, per: int) -> list[np.ndarray]:
    perm = np.random.default_rng(0).permutation(SHARDS * PER_SHARD)
    world = nodes * per
    return [perm[r::world] for r in range(world)]


def _open_max(shards: np.ndarray) -> int:
    """The most shards between their first and last use at one index of ``shards``."""
    n = len(shards)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, s in enumerate(shards.tolist()):
        first.setdefault(s, i)
        last[s] = i
    delta = np.zeros(n + 1, np.int64)
    for s, f in first.items():
        delta[f] += 1
        delta[last[s] + 1] -= 1
    return int(np.cumsum(delta).max())


def quality(seqs: list[np.ndarray], nodes: int, per: int, batch: int) -> dict[str, float]:
    total = SHARDS * PER_SHARD
    steps = min(len(s) for s in seqs) // batch
    shards = [s // PER_SHARD for s in seqs]
    per_batch = [
        len(np.unique(sh[b * batch : (b + 1) * batch])) for sh in shards for b in range(steps)
    ]
    per_step = [
        len(np.unique(np.concatenate([sh[b * batch : (b + 1) * batch] for sh in shards])))
        for b in range(steps)
    ]
    gaps = np.concatenate([np.abs(np.diff(s.astype(np.int64))) for s in seqs]) / total
    node_shards, open_max = [], []
    for node in range(nodes):
        mine = shards[node * per : (node + 1) * per]
        k = min(len(m) for m in mine)
        step_order = np.stack([m[:k] for m in mine], 1).ravel()  # the node's ranks in step
        node_shards.append(len(np.unique(step_order)) / SHARDS)
        open_max.append(_open_max(step_order))
    return {
        "batch_shards": float(np.mean(per_batch)),
        "global_batch_shards": float(np.mean(per_step)),
        "neighbour_gap": float(gaps.mean()),
        "node_shards": float(np.mean(node_shards)),
        "open_shards": float(max(open_max)),
    }


SHUFFLE_COLUMNS = ["order", "batch_shards", "global_batch_shards", "neighbour_gap",
                   "node_shards", "open_shards", "error"]  # fmt: skip


def shuffle_rows(nodes: int, per: int, batch: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cases: list[tuple[str, list[np.ndarray] | str]] = [
        ("fmstore global (of old)", _orders_fmstore(nodes, per, "global")),
        ("fmstore node-partitioned", _orders_fmstore(nodes, per, "node")),
        (f"mosaic py1e (block {WINDOW * PER_SHARD})", _orders_mosaic(nodes, per, batch)),
        ("uniform permutation", _orders_uniform(nodes, per)),
    ]
    for name, seqs in cases:
        if isinstance(seqs, str):
            rows.append({"order": name, "error": seqs})
            continue
        assert len(np.unique(np.concatenate(seqs))) == SHARDS * PER_SHARD, name  # every sample
        rows.append({"order": name, **quality(seqs, nodes, per, batch)})
    return rows


# ---- nodes: bytes read at the server ---------------------------------------------------

#: Shards of 4 MiB: 64 in the default 256 MiB, as many as of 64 MiB in 4 GiB.  (Smaller ones
#: make the first batches' ranged reads, whose neighbouring ranges are merged up to 256 KiB
#: apart, cover most of each shard they touch: the shard's bytes then come twice.)
NODE_SHARD = 4 << 20
#: fmstore without the first batches' ranged reads: its downloads alone.
DIRECT_OFF = "fmstore direct_reads=0"
NODE_COLUMNS = ["library", "nodes", "ranks", "x_dataset", "busiest_node_x", "busiest_x_n",
                "samples", "samples_s_per_rank", "error"]  # fmt: skip


def _rank_loader(cfg: dict[str, Any]) -> Any:
    import os

    from benchmarks.loader import SEQ, _mds_writer

    lib, batch, opts = cfg["lib"], cfg["batch"], cfg["opts"]
    if lib.startswith("fmstore"):
        from fmstore.loaders import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(
            f"s3://{cfg['bucket']}/fmstore", cfg["cache"], batch_size=batch,
            storage_options=opts, seq_len=SEQ, targets=False, sample_dtype=None,
            partition="global" if lib == "fmstore-global" else "node",
            direct_reads=0 if lib == DIRECT_OFF else None,
        )  # fmt: skip
        return StreamingDataLoader(ds, batch_size=batch, num_workers=cfg["workers"])
    import torch.distributed as dist
    import torch.utils.data as tud

    _mds_writer()
    from streaming import StreamingDataset as MDS

    # Mosaic's local leader and its other ranks meet at torch.distributed barriers: a group
    # of this node's ranks (its world comes from RANK / WORLD_SIZE / LOCAL_* all the same).
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=int(os.environ["LOCAL_RANK"]), world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
    )  # fmt: skip
    os.environ.update(
        S3_ENDPOINT_URL=opts["endpoint_url"], AWS_ACCESS_KEY_ID=opts["access_key"],
        AWS_SECRET_ACCESS_KEY=opts["secret_key"],
        AWS_DEFAULT_REGION=opts.get("region") or "us-east-1",
    )  # fmt: skip
    ds = MDS(
        remote=f"s3://{cfg['bucket']}/mds", local=cfg["cache"], batch_size=batch, shuffle=True,
        num_canonical_nodes=cfg["nodes"], shuffle_algo="py1e", partition_algo="orig",
        shuffle_block_size=WINDOW * cfg["per_shard"],
    )  # fmt: skip
    for stream in ds.streams:  # each forked worker opens its own client (see loader.py)
        stream._downloader.clean_up()
    return tud.DataLoader(ds, batch_size=batch, num_workers=cfg["workers"])


def rank_main(cfg: dict[str, Any]) -> None:
    """One rank of the ``nodes`` case: one epoch; prints its samples and seconds."""
    import json
    import time

    dl = _rank_loader(cfg)
    t0 = time.perf_counter()
    n = 0
    for b in dl:
        n += len(b["tokens"]) if isinstance(b, dict) else len(b)
    print("RESULT " + json.dumps({"samples": n, "seconds": time.perf_counter() - t0}))


def _launch_node(cfg: dict[str, Any], node: int, per: int, timeout: float) -> list[Any]:
    import json
    import os
    import subprocess
    import sys

    from fmstore.testing.seaweed import free_ports

    procs = []
    port = free_ports(1)[0]
    for lr in range(per):
        env = {**os.environ, "RANK": str(node * per + lr), "WORLD_SIZE": str(cfg["nodes"] * per),
               "LOCAL_RANK": str(lr), "LOCAL_WORLD_SIZE": str(per),
               "FMSTORE_NODE_ID": f"bench-node{node}", "PYTHONWARNINGS": "ignore"}  # fmt: skip
        mine = {**cfg, "cache": f"{cfg['cache']}-n{node}", "port": port,
                "opts": {**cfg["opts"], "endpoint_url": cfg["endpoints"][node]}}  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.loader_nodes", json.dumps(mine)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    return procs


def _results(procs: list[Any], timeout: float) -> list[dict[str, Any]] | str:
    import json

    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except Exception:
            p.kill()
            p.communicate()
            return f"timed out after {timeout} s"
        got = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not got:
            return (text.strip().splitlines() or [f"exit {p.returncode}"])[-1][:160]
        out.append(json.loads(got[-1][len("RESULT ") :]))
    return out


def nodes_rows(srv: Any, work: str, args: Any) -> list[dict[str, Any]]:
    """The ``nodes`` case (see the module's docstring)."""
    import os
    import shutil

    from benchmarks.loader import SEQ, _mds_writer, tokens, upload_dir
    from fmstore.loaders import write_dataset
    from fmstore.loaders.formats import FormatOptions, load_format
    from fmstore.stores import open_store
    from fmstore.testing.faultproxy import FaultProxy, tally

    nodes, per = args.nodes, 2
    bucket = srv.create_bucket()
    opts = srv.store_options()
    data = tokens(args.nodes_size)
    np.save(os.path.join(work, "tok.npy"), data)
    store = open_store(f"s3://{bucket}/fmstore", **opts)
    write_dataset(os.path.join(work, "tok.npy"), store, shard_size=NODE_SHARD)
    os.unlink(os.path.join(work, "tok.npy"))
    layouts = {
        "fmstore": (
            f"/{bucket}/fmstore/",
            load_format(store, FormatOptions(seq_len=SEQ, targets=False)).shards,
        )
    }
    per_shard = NODE_SHARD // (2 * SEQ)
    libs = ["fmstore", DIRECT_OFF, "fmstore-global"]
    mds = _mds_writer()
    if mds is not None:
        out = os.path.join(work, "mds")
        with mds(out=out, columns={"tokens": f"ndarray:uint16:{SEQ}"}, size_limit=NODE_SHARD) as w:
            for x in data.reshape(-1, SEQ):
                w.write({"tokens": x})
        upload_dir(srv.boto3_client(), out, bucket, "mds")
        shutil.rmtree(out)
        libs.append("mosaic")
    rows: list[dict[str, Any]] = []
    for lib in libs:
        print(f"nodes: {lib} on {nodes} nodes x {per} ranks ...", flush=True)
        proxies = [FaultProxy(srv.endpoint_url).start() for _ in range(nodes)]
        cfg = {"lib": lib, "bucket": bucket, "opts": opts, "batch": args.batch,
               "workers": args.workers, "nodes": nodes, "per_shard": per_shard,
               "cache": os.path.join(work, "cache-" + lib.replace(" ", "-")),
               "endpoints": [p.endpoint_url for p in proxies]}  # fmt: skip
        try:
            if lib == "mosaic":  # its shared memory names are per host: one node at a time
                got: list[dict[str, Any]] | str = []
                for n in range(nodes):
                    r = _results(_launch_node(cfg, n, per, args.timeout), args.timeout)
                    got = r if isinstance(r, str) else [*got, *r]  # type: ignore[misc]
                    if isinstance(got, str):
                        break
            else:
                procs = [p for n in range(nodes) for p in _launch_node(cfg, n, per, args.timeout)]
                got = _results(procs, args.timeout)
            fetched = [p.fetched() for p in proxies]
        finally:
            for p in proxies:
                p.stop()
        if isinstance(got, str):
            rows.append({"library": lib, "nodes": nodes, "ranks": per, "error": got})
            continue
        prefix = f"/{bucket}/mds/" if lib == "mosaic" else f"/{bucket}/fmstore/"
        total, per_node = _served(
            fetched, prefix, None if lib == "mosaic" else layouts["fmstore"][1], tally
        )
        rows.append({
            "library": lib, "nodes": nodes, "ranks": per,
            "x_dataset": sum(per_node) / total, "busiest_node_x": max(per_node) / total,
            "busiest_x_n": max(per_node) / total * nodes,
            "samples": sum(r["samples"] for r in got),
            "samples_s_per_rank": float(np.median([r["samples"] / r["seconds"] for r in got])),
        })  # fmt: skip
    return rows


def _served(
    fetched: list[dict[str, Any]], prefix: str, shards: Any, tally: Any
) -> tuple[int, list[int]]:
    """The dataset's shard bytes, and the shard bytes each node was sent."""
    if shards is not None:
        total = sum(sp.size for sp in shards)
        per_node = [
            sum(
                tally(f.get(prefix + sp.key, []), sp.start, sp.start + sp.size).bytes
                for sp in shards
            )
            for f in fetched
        ]
        return total, per_node
    # MDS: every object named shard.*.mds, whole; its size is the largest end served.
    sizes: dict[str, int] = {}
    for f in fetched:
        for key, seen in f.items():
            if key.startswith(prefix) and key.rsplit("/", 1)[-1].startswith("shard."):
                ends = [s.served[1] for s in seen if s.status in (200, 206)]
                sizes[key] = max([sizes.get(key, 0), *ends])
    per_node = [
        sum(tally(f.get(k, []), 0, size).bytes for k, size in sizes.items()) for f in fetched
    ]
    return sum(sizes.values()), per_node


if __name__ == "__main__":
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rank_main(json.loads(sys.argv[1]))
