"""Node partitioning of the epoch's order, in one process: each node's ranks read a disjoint
share of the shards, every sample once; resumes on the same or another number of nodes
continue the epoch exactly; old states still load."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from loader_helpers import make_dataset

from fmstore.errors import ConfigError
from fmstore.loaders import Stream, StreamingDataset
from fmstore.loaders.nodes import PartitionOptions, layout

N, BATCH = 1920, 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nodes")
    return make_dataset(tmp, N, shard_size=2000), str(tmp / "cache")


def rank_ds(remote, cache, node, nodes, per, local, **kw):
    return StreamingDataset(
        remote, cache, batch_size=BATCH, rank=node * per + local, world_size=nodes * per,
        partition=PartitionOptions(node=node, nodes=nodes, **kw.pop("part", {})), **kw,
    )  # fmt: skip


def job(remote, cache, nodes, per, state=None, **kw) -> dict[tuple[int, int], StreamingDataset]:
    out = {}
    for n in range(nodes):
        for lr in range(per):
            ds = out[n, lr] = rank_ds(remote, cache, n, nodes, per, lr, **kw)
            if state is not None:
                ds.load_state_dict(state)
    return out


def shard_share(ds: StreamingDataset, ids: np.ndarray) -> set[int]:
    return set(ds.plan.shard_of(ids).tolist())


def test_four_nodes_read_disjoint_shards_and_every_sample_once(dataset):
    remote, cache = dataset
    ranks = job(remote, cache, 4, 2)
    got = {k: ds.sample_ids(0, 1) for k, ds in ranks.items()}
    assert Counter(i for v in got.values() for i in v.tolist()) == Counter(range(N))
    assert len({len(v) for v in got.values()}) == 1  # equal samples per rank
    one = ranks[0, 0]
    nshards = len(one.specs)
    per_node = [shard_share(one, np.concatenate([got[n, 0], got[n, 1]])) for n in range(4)]
    # Each node reads about a quarter of the shards: only the up to 3 shards cut between two
    # canonical partitions are read by two nodes.
    assert sum(len(s) for s in per_node) <= nshards + 3
    assert max(len(s) for s in per_node) <= nshards / 4 + 2
    # ... and in a shuffled order, mixing the node's shards (not shard after shard).
    seq = one.plan.shard_of(got[0, 0])
    assert len(set(seq[:BATCH].tolist())) > 1
    # The two ranks of one node walk the same shards at the same time (one node cache).
    assert shard_share(one, got[0, 0][:40]) & shard_share(one, got[0, 1][:40])


def test_one_node_keeps_the_order_of_old(dataset):
    remote, cache = dataset
    new = StreamingDataset(remote, cache, batch_size=BATCH, rank=1, world_size=2)
    old = StreamingDataset(
        remote, cache, batch_size=BATCH, rank=1, world_size=2, partition="global"
    )
    assert new.canonical == 1 and old.canonical == 0
    assert new.sample_ids(1, 2).tolist() == old.sample_ids(1, 2).tolist()


def consumed_and_state(ranks, batches: int) -> tuple[list[int], dict]:
    head = [i for ds in ranks.values() for i in ds.sample_ids(0, 1)[: batches * BATCH].tolist()]
    return head, ranks[0, 0].state_dict(num_samples=batches * BATCH)


@pytest.mark.parametrize(("first", "then"), [((4, 2), (2, 2)), ((2, 1), (3, 1)), ((4, 2), (4, 2))])
def test_resume_on_another_number_of_nodes_covers_the_rest_once(dataset, first, then):
    remote, cache = dataset
    a = job(remote, cache, *first)
    head, state = consumed_and_state(a, 7)
    assert state["canonical"] == first[0]  # the first run's node count
    b = job(remote, cache, *then, state=state)
    rest = [i for ds in b.values() for i in ds.sample_ids(0, 1).tolist()]
    pad = -(N - state["position"]) % (then[0] * then[1])
    # Every sample of the epoch once; only the documented padding (the epoch's first
    # positions again, so every rank gets as many samples) repeats.
    assert len(rest) == N - len(head) + pad
    assert set(head + rest) == set(range(N))
    assert len(set(rest)) == len(rest) and len(set(head) & set(rest)) == pad
    if then == first:  # the same topology: bit-exact, rank by rank
        for k, ds in b.items():
            assert ds.sample_ids(0, 1).tolist() == a[k].sample_ids(0, 1)[7 * BATCH :].tolist()
    # The epochs after the resumed one keep the first run's canonical partitions.
    for ds in b.values():
        ds.set_epoch(1)
        assert ds.state_dict(0)["canonical"] == first[0]


def test_a_state_without_canonical_partitions_resumes_in_the_global_order(dataset):
    remote, cache = dataset
    old = StreamingDataset(remote, cache, batch_size=BATCH, partition="global")
    state = old.state_dict(num_samples=100)
    del state["canonical"]
    state["version"] = 1  # as written before node partitioning
    [ds] = job(remote, cache, 1, 1, part={"canonical": 3}, state=state).values()
    old.load_state_dict(state)
    assert ds.sample_ids().tolist() == old.sample_ids().tolist()
    assert ds.state_dict(5)["canonical"] == 0
    ds.set_epoch(1)  # the next epoch: the configured order
    assert ds.state_dict(0)["canonical"] == 3


def test_a_state_for_other_canonical_partitions_is_refused(dataset):
    remote, cache = dataset
    state = job(remote, cache, 2, 1)[0, 0].state_dict(num_samples=8)
    with pytest.raises(ConfigError, match="2 canonical partitions"):
        job(remote, cache, 1, 1, part={"canonical": 4}, state=state)


def test_reading_several_partitions_at_once_needs_that_many_windows_of_cache(dataset):
    remote, cache = dataset
    ds = rank_ds(remote, cache, 0, 2, 1, 0)
    sizes = sorted((sp.cached_size for _, sp in ds.specs), reverse=True)
    limit = sum(sizes[:8])  # twice the window of 4: enough for one partition
    state = job(remote, cache, 4, 1)[0, 0].state_dict(num_samples=8)
    small = rank_ds(remote, cache, 0, 2, 1, 0, cache_limit=limit)
    with pytest.raises(ConfigError, match="canonical partition"):
        small.load_state_dict(state)  # 2 nodes read 4 partitions: 2 windows each


def test_a_weighted_mix_is_partitioned_too(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = make_dataset(tmp_path / "a", 400, shard_size=2000)
    b = make_dataset(tmp_path / "b", 240, shard_size=2000)
    streams = [Stream(a, weight=2), Stream(b, weight=1)]
    cache = str(tmp_path / "cache")

    def ids(mode: str, nodes: int, epoch: int = 0) -> list[int]:
        out = []
        for n in range(nodes):
            ds = StreamingDataset(
                streams=streams, local=cache, batch_size=BATCH, samples_per_epoch=480,
                rank=n, world_size=nodes,
                partition=PartitionOptions(mode, node=n, nodes=nodes),
            )  # fmt: skip
            ds.set_epoch(epoch)
            out += ds.sample_ids().tolist()
        return out

    e0, e1 = ids("node", 4), ids("node", 4, 1)
    # Each stream gives its weighted share of the epoch, no sample twice in it, and walks
    # its own epochs: two mix epochs hold every sample of the smaller stream.
    assert len(set(e0)) == 480
    assert sum(i >= 400 for i in e0) == sum(i >= 400 for i in ids("global", 4)) == 160
    assert {i for i in e0 + e1 if i >= 400} == set(range(400, 640))


def test_the_node_comes_from_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    got = layout(PartitionOptions(), rank=5, world=8)
    assert (got.node, got.nodes, got.local_rank, got.slot()) == (2, 4, 1, 6)
    with pytest.raises(ConfigError, match="consecutive ranks"):
        layout(PartitionOptions(), rank=4, world=8)  # LOCAL_RANK 1 on an even rank
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert layout(PartitionOptions(), rank=5, world=8).nodes == 1  # unknown: one node


def _formats(root) -> dict[str, tuple[str, dict, object]]:
    """A small dataset in each shard format: (path, options, sample -> its id)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out: dict[str, tuple[str, dict, object]] = {}
    tok = root / "tok"
    tok.mkdir()
    np.arange(12_000, dtype=np.uint16).tofile(tok / "train.bin")
    out["tokens"] = (str(tok), {"seq_len": 50, "dtype": "uint16", "shard_bytes": 1000,
                                "targets": False, "sample_dtype": None},
                     lambda s: int(s[0]) // 50)  # fmt: skip
    pqd = root / "pq"
    pqd.mkdir()
    for f in range(6):
        pq.write_table(pa.table({"i": list(range(f * 30, f * 30 + 30))}), pqd / f"p{f}.parquet")
    out["parquet"] = (str(pqd), {}, lambda s: int(s["i"]))
    try:
        import webdataset as wds
    except ImportError:
        wds = None
    if wds is not None:
        wd = root / "wds"
        wd.mkdir()
        for f in range(6):
            with wds.TarWriter(str(wd / f"data-{f:04d}.tar")) as w:
                for j in range(30):
                    w.write({"__key__": f"s{f}_{j:03d}", "json": {"i": f * 30 + j}})
        out["webdataset"] = (str(wd), {}, lambda s: int(json.loads(s["json"])["i"]))
    from peer_libs import import_mds_writer

    MDSWriter = import_mds_writer()
    if MDSWriter is not None:
        with MDSWriter(out=str(root / "mds"), columns={"i": "int"}, size_limit=300) as w:
            for i in range(180):
                w.write({"i": i})
        out["mds"] = (str(root / "mds"), {}, lambda s: int(s["i"]))
    return out


def test_every_shard_format_is_partitioned_between_nodes(tmp_path):
    formats = _formats(tmp_path)
    assert {"tokens", "parquet"} <= set(formats)
    for name, (path, opts, key) in formats.items():
        got: list[int] = []
        shards: list[set[int]] = []
        for n in range(3):
            ds = rank_ds(path, str(tmp_path / f"c-{name}"), n, 3, 1, 0, **opts)
            assert len(ds.specs) >= 6, name
            ids = ds.sample_ids()
            shards.append(shard_share(ds, ids))
            got += [key(s) for s in ds]
        assert len(got) == ds.plan.length >= 150, name
        assert Counter(got) == Counter(range(len(got))), name  # every sample once
        assert sum(len(s) for s in shards) <= len(ds.specs) + 2, (name, shards)
