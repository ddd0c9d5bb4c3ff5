"""Streaming through the node cache: tiers, the cache limit, crashes, corruption, bad input."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid

import pytest
from filelock import FileLock
from loader_helpers import ids, make_dataset, write_jsonl

from fmstore import runtime
from fmstore.errors import ConfigError, CorruptData, NotFound, PermissionDenied
from fmstore.loaders import ShardCache, StreamingDataLoader, StreamingDataset, write_dataset
from fmstore.loaders import metrics as lm
from fmstore.loaders.formats import FormatOptions, load_format
from fmstore.stores import open_store


def shard_files(remote: str) -> list[str]:
    return sorted(f for f in os.listdir(remote) if f.startswith("shard-"))


def test_streams_from_a_posix_tier_with_zstd_shards(tmp_path):
    remote = make_dataset(tmp_path, 300, compression="zstd")
    assert all(f.endswith(".zst") for f in shard_files(remote))
    got = ids(remote, str(tmp_path / "cache"), workers=2)
    assert sorted(got) == list(range(300))


def test_streams_from_memory_store(tmp_path):
    url = f"memory://loader-{uuid.uuid4().hex[:8]}/ds"
    src = write_jsonl(tmp_path / "src.jsonl", 200)
    write_dataset(src, url, shard_size=2000)
    got = ids(url, str(tmp_path / "cache"), workers=2)
    assert sorted(got) == list(range(200))


def _has_s3() -> bool:
    import importlib.util

    return importlib.util.find_spec("fmstore.stores.s3") is not None


@pytest.mark.s3
@pytest.mark.skipif(not _has_s3(), reason="fmstore.stores.s3 is not in this tree yet")
def test_streams_from_s3(tmp_path, s3_server, s3_bucket):
    opts = s3_server.store_options()
    url = f"s3://{s3_bucket}/ds"
    write_dataset(
        write_jsonl(tmp_path / "src.jsonl", 200), open_store(url, **opts), shard_size=2000
    )
    got = ids(url, str(tmp_path / "cache"), workers=2, storage_options=opts)
    assert sorted(got) == list(range(200))


def test_cache_limit_is_never_exceeded_and_shards_are_reused(tmp_path):
    remote = make_dataset(tmp_path, 1200, shard_size=3000)  # ~30 shards
    sizes = [os.path.getsize(os.path.join(remote, f)) for f in shard_files(remote)]
    limit = 6 * max(sizes)
    cache = tmp_path / "cache"
    ds = StreamingDataset(remote, str(cache), cache_limit=limit, shuffle_window=2, batch_size=16,
                          transform=lambda s: s["i"])  # fmt: skip
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            # Under the cache's space lock, which every reservation, eviction and rename into
            # place holds: a scan without it can add a shard evicted mid-scan to the one that
            # replaced it.  (The cache's own scans missed a shard renamed mid-scan, which let
            # it reserve past the limit, about one run in thirty, until renames took it too.)
            with FileLock(str(cache / ".locks" / "space.lock")):
                total = 0
                for e in os.scandir(cache):
                    if e.is_file():
                        with contextlib.suppress(FileNotFoundError):  # a failed download's
                            total += e.stat().st_size
            peak[0] = max(peak[0], total)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        got = [int(x) for b in StreamingDataLoader(ds, batch_size=16, num_workers=2) for x in b]
    finally:
        stop.set()
        t.join()
    assert sorted(got) == list(range(1200))
    assert 0 < peak[0] <= limit
    assert ShardCache(str(cache), limit).usage() <= limit


def test_cache_limit_below_what_the_window_needs_is_refused_at_start(tmp_path):
    remote = make_dataset(tmp_path, 300)
    with pytest.raises(ConfigError, match="cache_limit"):
        StreamingDataset(remote, str(tmp_path / "cache"), cache_limit=1000, shuffle_window=4)


def test_a_dataset_that_fits_is_downloaded_once_across_epochs(tmp_path):
    remote = make_dataset(tmp_path, 300)
    cache = str(tmp_path / "cache")
    before = lm.BYTES_DOWNLOADED._value.get()
    ds = StreamingDataset(remote, cache, transform=lambda s: s["i"])
    assert sorted(ds) == list(range(300))
    first = lm.BYTES_DOWNLOADED._value.get() - before
    ds.set_epoch(1)
    assert sorted(ds) == list(range(300))
    assert (
        lm.BYTES_DOWNLOADED._value.get() - before
        == first
        == sum(os.path.getsize(os.path.join(remote, f)) for f in shard_files(remote))
    )


_KILL_CHILD = r"""
import sys
from fmstore.loaders import ShardCache
from fmstore.loaders.formats import FormatOptions, load_format
from fmstore.stores import open_store
remote, cache = sys.argv[1], sys.argv[2]
store = open_store(remote)
fmt = load_format(store, FormatOptions())
spec = fmt.shards[0]
ShardCache(cache).get("big", store, spec, lambda n: 0.0)
"""


def test_kill_9_during_a_download_then_a_restart_works(tmp_path):
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(48 << 20))
    remote = str(tmp_path / "ds")
    write_dataset(src, remote, input_format="files", shard_size=1 << 30)
    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    for _attempt in range(5):  # the kill must land while the download is in progress
        child = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, remote, cache])
        tmp_seen = False
        while child.poll() is None:
            if any(n.startswith(".tmp.big.") for n in os.listdir(cache)):
                os.kill(child.pid, signal.SIGKILL)
                tmp_seen = True
                break
        child.wait()
        if tmp_seen and not os.path.exists(os.path.join(cache, "big")):
            break
        for n in os.listdir(cache):
            if not n.startswith("."):
                os.unlink(os.path.join(cache, n))
    else:
        pytest.fail("could not catch the child mid-download")
    assert child.returncode == -signal.SIGKILL
    store = open_store(remote)
    spec = load_format(store, FormatOptions()).shards[0]
    c = ShardCache(cache)
    path = c.get("big", store, spec, lambda n: 0.0)  # the dead child's lock is free again
    c.unpin("big")
    assert [n for n in os.listdir(cache) if n != ".locks"] == ["big"]  # its temp file is gone
    with open(path, "rb") as f:
        assert f.read()[-1000:] == src.read_bytes()[-1000:]


def test_corrupted_shard_is_refetched_once_then_reported(tmp_path):
    remote = make_dataset(tmp_path, 200)
    victim = os.path.join(remote, shard_files(remote)[0])
    data = bytearray(open(victim, "rb").read())
    data[-5] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    before = lm.REFETCHES._value.get()
    ds = StreamingDataset(
        remote, str(tmp_path / "cache"), shuffle=False, prefetch=0, direct_reads=0
    )
    with pytest.raises(CorruptData, match="checksum") as e:
        list(ds)
    assert e.value.key == shard_files(remote)[0]
    assert lm.REFETCHES._value.get() - before == 1
    assert [n for n in os.listdir(tmp_path / "cache") if not n.startswith(".")] == []


def test_refetch_recovers_when_the_second_download_is_good(tmp_path):
    # The store's bytes are repaired while the first (bad) download is verified: the
    # re-fetch gets good bytes and reading goes on.
    remote = make_dataset(tmp_path, 200)
    name = shard_files(remote)[0]
    victim = os.path.join(remote, name)
    good = open(victim, "rb").read()
    bad = bytearray(good)
    bad[-5] ^= 0xFF
    open(victim, "wb").write(bytes(bad))
    store = open_store(remote)
    spec = load_format(store, FormatOptions()).shards[0]

    calls = []

    def next_use(n: str) -> float:
        calls.append(n)
        if len(calls) == 2:
            open(victim, "wb").write(good)
        return 0.0

    c = ShardCache(str(tmp_path / "cache"), limit=10 << 20)
    path = c.get(name, store, spec, next_use)
    assert open(path, "rb").read() == good


def _full_cache(tmp_path, shards: int = 4):
    """A store of ``shards`` shards, their specs, and a cache limit that fits two, not three."""
    remote = make_dataset(tmp_path, 40 * shards, shard_size=2000)
    store = open_store(remote)
    specs = load_format(store, FormatOptions()).shards[:shards]
    sizes = sorted(sp.cached_size for sp in specs)
    assert len(specs) == shards and 3 * sizes[0] > sizes[-1] + sizes[-2]
    return store, specs, sizes[-1] + sizes[-2]


def _finish(caches, jobs):
    """Run ``jobs`` (callables) in threads; each reader lets go of everything when done."""
    errors = []

    def run(job):
        try:
            job()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for c in caches:
        c.unpin_all()


def test_readers_holding_what_the_other_needs_under_the_limit_do_not_deadlock(tmp_path):
    # Two readers (two processes: each ShardCache has its own pin locks) each hold one of the
    # two shards the limit fits and need a third: each waits for space the other holds.
    # Before waiting, each lets go of its shard (release), so one can evict and go on.
    store, specs, limit = _full_cache(tmp_path)
    root = str(tmp_path / "cache")
    a, b = (ShardCache(root, limit, wait_timeout=120) for _ in range(2))
    n = [sp.cache_name for sp in specs]
    a.get(n[0], store, specs[0], lambda _n: 0.0)
    b.get(n[1], store, specs[1], lambda _n: 0.0)

    def reader(c, held, want):
        def job():
            c.get(n[want], store, specs[want], lambda _n: 0.0, lambda: c.unpin(n[held]))
            c.unpin_all()  # read to its end

        return job

    _finish([a, b], [reader(a, 0, 2), reader(b, 1, 3)])
    assert ShardCache(root, limit).usage() <= limit


def test_a_reader_waiting_for_a_download_that_waits_for_space_lets_go_first(tmp_path):
    # Reader c holds both shards the limit fits and waits for shard 2, which a downloads:
    # a waits for space c holds, c for a's download.  c sees the download's full mark
    # and lets go, so a evicts, downloads, and c gets the shard.
    store, specs, limit = _full_cache(tmp_path)
    root = str(tmp_path / "cache")
    a, c = (ShardCache(root, limit, wait_timeout=120) for _ in range(2))
    n = [sp.cache_name for sp in specs]
    for k in (0, 1):
        c.get(n[k], store, specs[k], lambda _n: 0.0)
    t = threading.Thread(target=a.get, args=(n[2], store, specs[2], lambda _n: 0.0))
    t.start()
    mark = os.path.join(root, ".locks", n[2] + ".full")
    while not os.path.exists(mark):  # a holds shard 2's lock and waits for space
        assert t.is_alive()
    released = []

    def release():
        released.append(True)
        c.unpin(n[0])
        c.unpin(n[1])

    path = c.get(n[2], store, specs[2], lambda _n: 0.0, release)
    t.join()
    assert released == [True] and os.path.exists(path)
    assert not os.path.exists(mark)
    a.unpin_all()
    c.unpin_all()
    assert ShardCache(root, limit).usage() <= limit


def _held(cache: str) -> list[str]:
    """Shards some reader holds (their pin file's lock cannot be taken exclusively)."""
    import fcntl

    out = []
    locks = os.path.join(cache, ".locks")
    for n in sorted(os.listdir(locks)):
        if n.endswith(".use"):
            fd = os.open(os.path.join(locks, n), os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                out.append(n[: -len(".use")])
            finally:
                os.close(fd)
    return out


@pytest.mark.parametrize("limit", [None, 1 << 20], ids=["no-limit", "limit"])
def test_under_a_cache_limit_a_reader_holds_no_shard_between_batches(tmp_path, limit):
    # A DataLoader worker sits between batches as long as its rank likes: under a limit it
    # must not hold shards there, or a download waiting for space could wait on it forever.
    # Without a limit nothing is evicted, so it keeps its shards open.
    remote = make_dataset(tmp_path, 300)
    cache = str(tmp_path / "cache")
    ds = StreamingDataset(remote, cache, cache_limit=limit, batch_size=8, prefetch=0,
                          direct_reads=0, transform=lambda s: s["i"])  # fmt: skip
    it = iter(ds)
    got = [next(it) for _ in range(3)]
    assert _held(cache)  # mid-batch: the shards being read are held
    got += [next(it) for _ in range(5)]
    assert bool(_held(cache)) == (limit is None)
    got += list(it)
    assert sorted(got) == list(range(300))
    assert _held(cache) == []


def test_empty_dataset_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotFound, match="no dataset"):
        StreamingDataset(str(empty), str(tmp_path / "cache"))
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(NotFound, match="no samples"):
        write_dataset(tmp_path / "e.jsonl", str(tmp_path / "out"))


def test_missing_index_is_a_clear_error(tmp_path):
    remote = make_dataset(tmp_path, 100)
    os.unlink(os.path.join(remote, "index.json"))
    with pytest.raises(NotFound, match="no index.json"):
        StreamingDataset(remote, str(tmp_path / "cache"))
    with pytest.raises(NotFound, match="index.json"):
        StreamingDataset(remote, str(tmp_path / "cache"), format="fmstore")


def test_shard_listed_but_missing_is_a_clear_error(tmp_path):
    remote = make_dataset(tmp_path, 100)
    gone = shard_files(remote)[1]
    os.unlink(os.path.join(remote, gone))
    ds = StreamingDataset(remote, str(tmp_path / "cache"), shuffle=False)
    with pytest.raises(NotFound, match="listed in the dataset index is missing") as e:
        list(ds)
    assert e.value.key == gone


def test_sample_count_mismatch_is_a_clear_error(tmp_path):
    remote = make_dataset(tmp_path, 100)
    index = json.loads(open(os.path.join(remote, "index.json")).read())
    index["shards"][0]["samples"] += 1
    open(os.path.join(remote, "index.json"), "w").write(json.dumps(index))
    ds = StreamingDataset(remote, str(tmp_path / "cache"), shuffle=False)
    with pytest.raises(CorruptData, match="index lists"):
        list(ds)


def test_unwritable_cache_dir_is_a_clear_error(tmp_path):
    remote = make_dataset(tmp_path, 100)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(PermissionDenied, match="not writable"):
        StreamingDataset(remote, str(blocker / "cache"))


def test_runtime_is_usable_after_loader_errors(tmp_path):
    assert runtime.run(open_store(str(tmp_path)).exists("nothing")) is False


def test_first_samples_come_by_ranged_reads_before_the_shard_lands(tmp_path):
    remote = make_dataset(tmp_path, 300)
    before = lm.DIRECT_BYTES._value.get()
    got = ids(remote, str(tmp_path / "cache"), workers=0, batch=8)
    assert sorted(got) == list(range(300))
    assert lm.DIRECT_BYTES._value.get() > before  # the first batches did not wait for shards
    again = lm.DIRECT_BYTES._value.get()
    assert sorted(ids(remote, str(tmp_path / "cache"), workers=0, batch=8)) == list(range(300))
    assert lm.DIRECT_BYTES._value.get() == again  # a warm cache serves everything from disk


@pytest.mark.parametrize("persistent", [False, True])
def test_the_loader_reads_its_workers_first_samples_before_they_start(tmp_path, persistent):
    """StreamingDataLoader reads each worker's first batch by range in this process (its
    counter moves here, not in a worker) and hands it to the workers it starts; the order is
    the canonical one, also on a second pass (warm cache, or persistent workers)."""
    remote = make_dataset(tmp_path, 300)
    ds = StreamingDataset(remote, str(tmp_path / "cache"), batch_size=8, seed=3,
                          transform=lambda s: s["i"])  # fmt: skip
    want = [int(i) for i in ds.sample_ids()]
    dl = StreamingDataLoader(ds, batch_size=8, num_workers=2, persistent_workers=persistent)
    before = lm.DIRECT_BYTES._value.get()
    assert [int(x) for b in dl for x in b] == want
    read_here = lm.DIRECT_BYTES._value.get() - before
    assert read_here > 0
    assert [int(x) for b in dl for x in b] == want
    assert lm.DIRECT_BYTES._value.get() - before == read_here  # nothing more: all cached


@pytest.mark.s3
@pytest.mark.skipif(not _has_s3(), reason="fmstore.stores.s3 is not in this tree yet")
def test_a_shard_corrupted_in_transit_from_s3_is_refetched(tmp_path, s3_server, s3_bucket):
    # The store's own CRC check is off, so the loader's shard checksum is what catches it.
    from fmstore.testing.faultproxy import FaultProxy, Rule

    opts = s3_server.store_options()
    url = f"s3://{s3_bucket}/ds"
    write_dataset(
        write_jsonl(tmp_path / "src.jsonl", 200), open_store(url, **opts), shard_size=3000
    )
    before = lm.REFETCHES._value.get()
    with FaultProxy(s3_server.endpoint_url) as proxy:
        proxy.add(Rule("corrupt_response", method="GET", path=r"/ds/shard-00001\.fms", times=1))
        ds = StreamingDataset(url, str(tmp_path / "cache"), shuffle=False, prefetch=0, direct_reads=0,
                              storage_options={**opts, "endpoint_url": proxy.endpoint_url,
                                               "checksum": "off"})  # fmt: skip
        assert [s["i"] for s in ds] == list(range(200))
        assert proxy.injected["corrupt_response"] == 1
    assert lm.REFETCHES._value.get() - before == 1


_FAULTS_CHILD = r"""
import json, resource, sys
from fmstore.loaders import ShardCache
from fmstore.loaders.formats import FormatOptions, load_format
from fmstore.stores import open_store
store = open_store(sys.argv[1], **json.loads(sys.argv[3]))
shards = load_format(store, FormatOptions(seq_len=512, targets=False)).shards
cache = ShardCache(sys.argv[2])
cache.get("s0", store, shards[0], lambda n: 0.0)  # imports, connections, threads: once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i, spec in enumerate(shards[1:], 1):
    cache.get(f"s{i}", store, spec, lambda n: 0.0)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"faults": faults, "bytes": sum(s.size for s in shards[1:])}))
"""


def test_a_download_goes_through_a_reused_buffer_not_fresh_memory(tmp_path, s3_server, s3_bucket):
    """Shards are written to the cache from the transport's small reused buffer: received
    into fresh memory instead, every 4 KiB page downloaded costs a page fault (which a
    virtual machine's host may have to serve: several CPU-seconds per GiB)."""
    import numpy as np

    opts = s3_server.store_options()
    url = f"s3://{s3_bucket}/faults"
    npy = tmp_path / "tok.npy"
    np.save(npy, np.arange(40 << 20 >> 1, dtype=np.uint16))  # 40 MiB of tokens
    write_dataset(str(npy), open_store(url, **opts), shard_size=8 << 20)
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_CHILD, url, str(tmp_path / "cache"), json.dumps(opts)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout)
    assert got["bytes"] >= 32 << 20
    # One fault per downloaded page would be 8,192; the reused buffers take a few hundred.
    assert got["faults"] < got["bytes"] / 4096 / 8, got


@pytest.mark.s3
def test_first_batch_ranged_reads_do_not_read_most_of_a_shard(tmp_path, s3_server, s3_bucket):
    # One shard of ~1 MiB, 8 samples of it read by range: the gaps between them, merged into
    # one request up to 256 KiB apart, used to bring most of the shard, which is then
    # downloaded whole as well (twice its bytes; on several nodes ~14 % of the dataset).
    from fmstore.testing.faultproxy import FaultProxy

    url = f"s3://{s3_bucket}/ds"
    opts = s3_server.store_options()
    write_dataset(write_jsonl(tmp_path / "src.jsonl", 1000, pad=1000), open_store(url, **opts))
    [shard] = load_format(open_store(url, **opts), FormatOptions()).shards
    with FaultProxy(s3_server.endpoint_url) as proxy:
        ds = StreamingDataset(
            url, str(tmp_path / "cache"), batch_size=8, direct_reads=8,
            storage_options={**opts, "endpoint_url": proxy.endpoint_url},
        )  # fmt: skip
        ds.preload(1)
        assert len(ds._preloaded[1][0]) == 8  # the first batch, read by range
        served = sum(s.body for s in proxy.fetched().get(f"/{s3_bucket}/ds/{shard.key}", []))
    assert served <= shard.size / 16, (served, shard.size)


def test_the_cache_directory_may_be_a_local_tiers_location(tmp_path, posix_cfg, monkeypatch):
    """``local="nvme:cache/x"`` is below the nvme tier, never a directory named after the
    URL in the working directory; a remote location is refused."""
    remote = make_dataset(tmp_path, n=40)
    monkeypatch.chdir(tmp_path)
    assert sorted(ids(remote, "nvme:cache/x")) == list(range(40))
    assert (tmp_path / "nvme" / "cache" / "x").is_dir()
    assert not [p for p in tmp_path.iterdir() if ":" in p.name]
    with pytest.raises(ConfigError, match="not a directory"):
        StreamingDataset(remote, "memory://cache", batch_size=8)
    with pytest.raises(ConfigError):
        StreamingDataset(remote, "nvme", batch_size=8)  # the bare tier name: which one?
