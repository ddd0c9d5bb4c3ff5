"""A loader state read from a checkpoint is checked for sense, not only shape: every field
a whole number in its range, and no more canonical partitions than the dataset needs."""

from __future__ import annotations

import math
import time

import pytest
from loader_helpers import make_dataset

from fmstore.errors import ConfigError
from fmstore.loaders import StreamingDataset
from fmstore.loaders.state import MAX_CANONICAL, LoaderState

N = 600


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state")
    return make_dataset(tmp, N), str(tmp / "cache")


def good() -> dict:
    return LoaderState(epoch=2, position=16, seed=0, length=N, world_size=1).to_dict()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epoch", math.inf),  # raised OverflowError
        ("epoch", -3),  # raised numpy's ValueError on the first epoch
        ("epoch", 2.0),
        ("epoch", True),
        ("position", "16"),
        ("seed", -1),
        ("seed", None),
        ("length", 1 << 70),
        ("world_size", 0),
        pytest.param("world_size", 10**30000, id="world_size-huge"),  # too long for str()
        ("version", 0),
        ("canonical", -1),
        ("canonical", float(N)),
        ("canonical", [1]),
    ],
)
def test_a_field_that_is_no_sane_whole_number_is_refused_by_name(field, value):
    d = good() | {field: value}
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        LoaderState.from_dict(d)


def test_a_missing_field_is_named_and_a_good_state_round_trips():
    d = good()
    assert LoaderState.from_dict(d).to_dict() == d
    del d["seed"]
    with pytest.raises(ConfigError, match="no field 'seed'"):
        LoaderState.from_dict(d)


def test_canonical_partitions_beyond_the_dataset_are_refused_when_applied(dataset):
    remote, cache = dataset
    ds = StreamingDataset(remote, cache, batch_size=8)
    state = ds.state_dict(num_samples=8) | {"canonical": MAX_CANONICAL}
    LoaderState.from_dict(state)  # a sane shape: only the dataset knows it is too many
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="field 'canonical' is 1048576"):
        ds.load_state_dict(state)  # accepted before: minutes of CPU every epoch
    assert time.monotonic() - t0 < 5
    # as many partitions as samples is still an order (each one sample long)
    ds.load_state_dict(state | {"canonical": N})
    rest = ds.sample_ids().tolist()
    assert len(rest) == len(set(rest)) == N - 8
