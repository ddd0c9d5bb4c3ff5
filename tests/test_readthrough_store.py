"""ReadThroughStore (the lazy restore's cache) passes the store conformance suite as a
read-only store, and keeps on the fast tier what it serves.  The same suite over S3 is in
test_store_s3.py."""

from __future__ import annotations

import os

import pytest

from fmstore import runtime
from fmstore.stores import PosixStore
from fmstore.stores.base import Store
from fmstore.testing.store_tests import PosixBackdoor, StoreConformance
from fmstore.tiering.managers.cache import ReadThroughStore


class TestReadThroughOverPosixConformance(StoreConformance):
    """A POSIX cache in front of a second POSIX tier; the backdoor reads the slow tier."""

    read_only = True

    def source(self, store: Store) -> Store:
        assert isinstance(store, ReadThroughStore)
        return store.slow

    @pytest.fixture
    def store(self, tmp_path):
        os.makedirs(tmp_path / "fast")
        os.makedirs(tmp_path / "slow")
        fast = PosixStore(str(tmp_path / "fast"), tier="nvme")
        slow = PosixStore(str(tmp_path / "slow"), tier="lustre")
        yield ReadThroughStore(fast, slow)
        runtime.run(fast.close())
        runtime.run(slow.close())

    @pytest.fixture
    def backdoor(self, tmp_path):
        return PosixBackdoor(str(tmp_path / "slow"))


def test_what_is_read_is_kept_on_the_fast_tier(tmp_path):
    fast_root, slow_root = tmp_path / "fast", tmp_path / "slow"
    os.makedirs(fast_root)
    os.makedirs(slow_root)
    fast, slow = PosixStore(str(fast_root), tier="nvme"), PosixStore(str(slow_root))
    rt = ReadThroughStore(fast, slow)
    data = os.urandom(100_000)
    runtime.run(slow.put("d/blob", data))
    assert runtime.run(rt.get_range("d/blob", 10, 20)) == data[10:20]
    assert PosixBackdoor(str(fast_root)).read("d/blob") == data
    assert rt.fetched_bytes == len(data)
    assert runtime.run(rt.get("d/blob")) == data
    assert rt.fetched_bytes == len(data)  # served from the fast tier the second time
    assert not rt.completed  # no manifest on the slow tier: nothing to commit
