"""The canonical order: exact coverage across ranks x workers, determinism, exact and
elastic resume, weighted mixing."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from loader_helpers import ids, make_dataset

from fmstore.loaders import Stream, StreamingDataset
from fmstore.loaders.order import Plan, ShuffleOptions, rank_count

N = 600


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("order")
    return make_dataset(tmp, N), str(tmp / "cache")


def test_one_rank_sees_every_sample_once_in_a_shuffled_order(dataset):
    remote, cache = dataset
    got = ids(remote, cache)
    assert sorted(got) == list(range(N))
    assert got != list(range(N))


@pytest.mark.parametrize("workers", [1, 2])
def test_order_does_not_depend_on_the_number_of_workers(dataset, workers):
    remote, cache = dataset
    assert ids(remote, cache, workers=workers) == ids(remote, cache, workers=0)


@pytest.mark.parametrize("world", [2, 7])
def test_ranks_interleave_the_one_rank_order_and_cover_it_exactly(dataset, world):
    remote, cache = dataset
    one = ids(remote, cache)
    per_rank = [
        ids(remote, cache, rank=r, world_size=world, workers=2 if r == 0 else 0)
        for r in range(world)
    ]
    count = rank_count(N, 0, world)
    assert all(len(p) == count for p in per_rank)  # equal samples per rank: no DDP hang
    merged = [per_rank[p % world][p // world] for p in range(count * world)]
    pad = count * world - N
    assert merged[:N] == one
    assert merged[N:] == one[:pad]  # the documented padding: the epoch's first samples again
    assert Counter(merged) == Counter(one) + Counter(one[:pad])


def test_same_seed_same_order_other_seed_or_epoch_differs(dataset):
    remote, cache = dataset
    a = ids(remote, cache, seed=3)
    assert ids(remote, cache, seed=3) == a
    assert ids(remote, cache, seed=4) != a
    ds = StreamingDataset(remote, cache, seed=3, batch_size=8)
    ds.set_epoch(1)
    e1 = ds.sample_ids().tolist()
    assert sorted(e1) == list(range(N)) and e1 != a


def test_no_shuffle_keeps_the_dataset_order(dataset):
    remote, cache = dataset
    assert ids(remote, cache, shuffle=False) == list(range(N))


@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_yields_exactly_the_rest(dataset, workers):
    remote, cache = dataset
    full = ids(remote, cache, workers=workers)
    head, state = ids(remote, cache, workers=workers, stop_after=11)
    assert head == full[: 11 * 8]
    rest = ids(remote, cache, workers=2 - workers, state=state)
    assert head + rest == full


def test_elastic_resume_from_two_ranks_to_one_covers_the_rest_once(dataset):
    remote, cache = dataset
    seen = []
    states = []
    for r in range(2):
        head, st = ids(remote, cache, rank=r, world_size=2, workers=1, stop_after=9)
        seen += head
        states.append(st)
    assert states[0] == states[1]
    rest = ids(remote, cache, state=states[0], workers=2)
    assert sorted(seen + rest) == list(range(N))
    # and the rest is the one-rank order from the same position
    one = ids(remote, cache)
    assert rest == one[2 * 9 * 8 :]


def test_resume_state_from_another_dataset_is_refused(dataset):
    remote, cache = dataset
    ds = StreamingDataset(remote, cache, seed=1)
    other = StreamingDataset(remote, cache, seed=2)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(ds.state_dict(num_samples=5))


def test_mix_follows_weights_and_is_reproducible_and_resumable(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = make_dataset(tmp_path / "a", 200)
    b = make_dataset(tmp_path / "b", 100, shard_size=3000)
    cache = str(tmp_path / "cache")
    streams = [Stream(a, weight=3.0), Stream(b, weight=1.0)]

    def run(**kw):
        ds = StreamingDataset(
            streams=streams, local=cache, batch_size=8, samples_per_epoch=400, seed=5, **kw
        )
        return ds

    ds = run()
    order = ds.sample_ids().tolist()
    assert len(order) == 400
    from_a = [i for i in order if i < 200]
    from_b = [i for i in order if i >= 200]
    assert (len(from_a), len(from_b)) == (300, 100)
    assert len(set(from_b)) == 100  # stream b: one full pass, no repeats
    assert Counter(Counter(from_a).values()) == {1: 100, 2: 100}  # a: 1.5 passes
    assert run().sample_ids().tolist() == order
    again = run()
    again.load_state_dict(ds.state_dict(num_samples=123))
    assert again.sample_ids().tolist() == order[123:]
    samples = list(run(transform=lambda s: s["i"]))
    assert len(samples) == 400


def test_plan_shuffles_samples_within_windows_of_shards():
    counts = np.array([10, 20, 5, 15, 30, 7])
    plan = Plan([counts], ShuffleOptions(True, 9, 2))
    order = plan.epoch(0)
    assert sorted(order.tolist()) == list(range(int(counts.sum())))
    shards = plan.shard_of(order).tolist()
    pos = 0
    seen: set[int] = set()
    for _window in range(3):  # each window: the samples of exactly 2 shards, shuffled together
        group = {shards[pos]}
        while len(group) < 2 or (pos < len(shards) and shards[pos] in group):
            group.add(shards[pos])
            pos += 1
        assert len(group) == 2 and not group & seen
        assert pos == sum(int(counts[g]) for g in group | seen)
        seen |= group
    assert pos == len(order)


def test_spawned_workers_give_the_same_order(dataset):
    import torch.utils.data as tud

    from fmstore.loaders import StreamingDataLoader

    remote, cache = dataset
    ds = StreamingDataset(remote, cache, batch_size=8, seed=2)
    want = [int(i) for i in ds.sample_ids()]
    dl = StreamingDataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context="spawn")
    got = [int(s["i"]) for b in dl for s in _unbatch(b)]
    assert got == want
    assert isinstance(dl, tud.DataLoader)


def _unbatch(batch):
    return [{"i": i} for i in batch["i"]]


def test_option_objects_and_flat_keywords_give_the_same_dataset(tmp_path):
    from fmstore.loaders import CacheOptions, FormatOptions, ShuffleOptions

    remote = make_dataset(tmp_path, n=300, shard_size=2000)
    flat = StreamingDataset(
        remote, str(tmp_path / "c1"), seed=5, shuffle_window=2, cache_limit=1 << 30, prefetch=1
    )
    objects = StreamingDataset(
        remote,
        format=FormatOptions(format="fmstore"),
        shuffle=ShuffleOptions(seed=5, window=2),
        cache=CacheOptions(local=str(tmp_path / "c2"), limit=1 << 30, prefetch=1),
    )
    assert objects.plan.cfg == flat.plan.cfg == ShuffleOptions(True, 5, 2)
    assert (objects.cache_limit, objects.prefetch_depth) == (flat.cache_limit, flat.prefetch_depth)
    assert list(objects) == list(flat)
    # A flat keyword sets one field of its object; the rest of the object stays.
    mixed = StreamingDataset(
        remote, str(tmp_path / "c3"), shuffle=ShuffleOptions(seed=5, window=3), shuffle_window=2
    )
    assert mixed.plan.cfg == ShuffleOptions(True, 5, 2)
    with pytest.raises(TypeError, match="did you mean 'shuffle_window'"):
        StreamingDataset(remote, str(tmp_path / "c4"), shuffle_windw=2)
