"""The catalog: idempotent upserts, conditional transitions, pins, several processes."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from fmstore.tiering.inventory import catalog as cat
from fmstore.tiering.inventory.catalog import Catalog


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def catalog(tmp_path, clock):
    with Catalog(str(tmp_path / "state" / cat.DB_NAME), clock=clock) as c:
        yield c


def test_catalog_uses_wal_mode(catalog):
    mode = catalog._conn().execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_record_checkpoint_is_idempotent_and_numbers_saves(catalog, clock):
    a = catalog.record_checkpoint("run", 10, bytes=5)
    clock.t += 5
    b = catalog.record_checkpoint("run", 20)
    again = catalog.record_checkpoint("run", 10, manifest_crc32c=77)
    assert (a.seq, b.seq) == (1, 2)
    assert again.seq == 1 and again.created == a.created and again.bytes == 5
    assert again.manifest_crc32c == 77
    assert [c.step for c in catalog.checkpoints("run")] == [10, 20]
    assert catalog.roots() == ["run"]


def test_set_copy_with_expect_lets_one_racer_win(catalog):
    catalog.record_checkpoint("run", 1)
    assert catalog.set_copy("run", 1, "lustre", cat.EXPORTING, expect=[None, cat.CORRUPT])
    assert not catalog.set_copy("run", 1, "lustre", cat.EXPORTING, expect=[None, cat.CORRUPT])
    assert catalog.set_copy("run", 1, "lustre", cat.PRESENT, bytes=9, verified=3.0)
    cp = catalog.copy("run", 1, "lustre")
    assert cp is not None and (cp.state, cp.bytes, cp.verified) == (cat.PRESENT, 9, 3.0)


def test_unknown_state_is_refused(catalog):
    with pytest.raises(ValueError, match="unknown copy state"):
        catalog.set_copy("run", 1, "nvme", "half-there")


def test_tier_bytes_counts_only_copies_that_hold_bytes(catalog):
    catalog.set_copy("r", 1, "nvme", cat.PRESENT, bytes=100)
    catalog.set_copy("r", 2, "nvme", cat.RELEASED, bytes=50)
    catalog.set_copy("r", 1, "s3", cat.PRESENT, bytes=100)
    assert catalog.tier_bytes() == {"nvme": 100, "s3": 100}


def test_pins_expire(catalog, clock):
    pid = catalog.pin("r", 1, reason="restore", owner="me", ttl=10)
    assert [p.id for p in catalog.pins()] == [pid]
    clock.t += 11
    assert catalog.pins() == []


def test_files_upsert_keeps_checksum(catalog):
    catalog.set_file("ds", "a/0.tar", "nvme", cat.WRITING, bytes=4)
    catalog.set_file("ds", "a/0.tar", "nvme", cat.PRESENT, checksum="abcd1234")
    catalog.set_file("ds", "a/0.tar", "nvme", cat.PRESENT)
    (f,) = catalog.files("ds")
    assert (f.state, f.bytes, f.checksum) == (cat.PRESENT, 4, "abcd1234")


def _writer(path: str, worker: int, n: int) -> None:
    c = Catalog(path)
    for i in range(n):
        c.record_checkpoint(f"run{worker}", i)
        c.set_copy(f"run{worker}", i, "nvme", cat.PRESENT, bytes=i)
        c.record_checkpoint("shared", worker * 1000 + i)
    c.close()


def test_several_processes_write_at_once_without_losing_rows(tmp_path):
    path = str(tmp_path / cat.DB_NAME)
    Catalog(path).close()
    ctx = mp.get_context("fork")  # the children only touch SQLite
    procs = [ctx.Process(target=_writer, args=(path, w, 40)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    c = Catalog(path)
    assert len(c.copies()) == 120
    shared = c.checkpoints("shared")
    assert sorted(x.seq for x in shared) == list(range(1, 121))
    c.close()
