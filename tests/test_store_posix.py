from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from pagecache import cachestat

from fmstore import runtime
from fmstore.errors import NotFound, PermissionDenied, PreconditionFailed, TierFull
from fmstore.stores import PosixOptions, PosixStore, PutOptions, open_store
from fmstore.stores.posix import TMP_MARK
from fmstore.testing.store_tests import PosixBackdoor, StoreConformance


class TestPosixConformance(StoreConformance):
    @pytest.fixture
    def store(self, posix_root):
        return open_store(posix_root, tier="nvme")

    @pytest.fixture
    def backdoor(self, posix_root):
        return PosixBackdoor(posix_root)


class TestPosixDirectIO(StoreConformance):
    @pytest.fixture
    def store(self, posix_root):
        return PosixStore(posix_root, tier="nvme", options=PosixOptions(direct_io=True))

    @pytest.fixture
    def backdoor(self, posix_root):
        return PosixBackdoor(posix_root)


def test_if_match_conditional_put(posix_root):
    s = PosixStore(posix_root)
    m1 = runtime.run(s.put("k", b"one"))
    m2 = runtime.run(s.put("k", b"two", PutOptions(mode="if_match", if_match=m1.etag)))
    assert m2.etag != m1.etag
    with pytest.raises(PreconditionFailed):
        runtime.run(s.put("k", b"three", PutOptions(mode="if_match", if_match=m1.etag)))
    assert runtime.run(s.get("k")) == b"two"


def test_put_meta_is_the_stored_files_without_reading_it_back(posix_root):
    """A small put builds its answer from the temp file's fstat and the metadata it wrote
    (no second stat, no xattr read): the same as a later stat, FSx times included."""
    s = PosixStore(posix_root)
    meta = {"fmstore-crc32c": "0badcafe", "file-mtime": "1700000000123ns", "n": "1"}
    for durable in (False, True):
        put = runtime.run(s.put("d/m", b"x" * 5000, PutOptions(metadata=meta, durable=durable)))
        now = runtime.run(s.stat("d/m"))
        assert (put.key, put.size, put.mtime, put.etag) == (now.key, now.size, now.mtime, now.etag)
        assert dict(put.metadata) == dict(now.metadata) == meta
        assert os.stat(os.path.join(posix_root, "d/m")).st_mtime_ns == 1700000000123


def test_metadata_of_a_file_changed_since_reads_as_none(posix_root):
    """Metadata describes the bytes fmstore wrote: a file written in place afterwards (or
    truncated, or touched) has none, in a read-only mode too; an untouched one keeps it."""
    s = PosixStore(posix_root)
    meta = {"fmstore-crc32c": "0badcafe", "file-permissions": "0100444"}
    for key in ("same", "edited", "truncated"):
        runtime.run(s.put(key, b"x" * 100, PutOptions(metadata=meta)))
    assert runtime.run(s.stat("same")).metadata == meta
    later = time.time() + 5
    with open(os.path.join(posix_root, "edited"), "r+b") as f:
        f.write(b"y")
    os.utime(os.path.join(posix_root, "edited"), (later, later))
    os.truncate(os.path.join(posix_root, "truncated"), 10)
    for key in ("edited", "truncated"):
        assert runtime.run(s.stat(key)).metadata == {}
    copied = runtime.run(s.copy("same", "copy"))
    assert copied.metadata == meta == runtime.run(s.stat("copy")).metadata


def test_unwritable_directory_is_permission_error(tmp_path):
    if os.geteuid() == 0:
        # root ignores mode bits; a read-only bind is not available, so use a file as parent
        blocker = tmp_path / "file"
        blocker.write_text("x")
        s = PosixStore(str(tmp_path))
        with pytest.raises(NotFound):
            runtime.run(s.put("file/child", b"x"))
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    s = PosixStore(str(ro))
    with pytest.raises(PermissionDenied):
        runtime.run(s.put("k", b"x"))


def test_read_only_filesystem_is_permission_error(tmp_path):
    """A real read-only mount (tmpfs remounted ro), when this machine lets us mount."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount tmpfs here (needs root)")
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        s = PosixStore(str(mnt))
        with pytest.raises(PermissionDenied):
            runtime.run(s.put("k", b"x"))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_is_tier_full_and_leaves_nothing(tmp_path):
    """ENOSPC on a small tmpfs: a clear TierFull, no temp file or partial object left."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount tmpfs here (needs root); see test_file_size_limit_is_tier_full")
    try:
        s = PosixStore(str(mnt))
        runtime.run(s.put("small", b"ok"))
        with pytest.raises(TierFull) as ei:
            runtime.run(s.put("huge", os.urandom(4 << 20)))
        assert ei.value.key == "huge"
        assert sorted(os.listdir(mnt)) == ["small"]
        w = runtime.run(s.open_writer("streamed"))
        with pytest.raises(TierFull):
            for _ in range(8):
                runtime.run(w.write(os.urandom(1 << 20)))
        runtime.run(w.abort())
        assert sorted(os.listdir(mnt)) == ["small"]

        async def streamed_part() -> None:
            pw = await s.open_part_writer("parts", 4 << 20, 4 << 20)
            stream = pw.stream_part(0)
            try:
                for _ in range(16):
                    pending = stream.write(memoryview(os.urandom(256 << 10)))
                    if pending is not None:
                        await pending
            finally:
                await pw.abort()

        with pytest.raises(TierFull):
            runtime.run(streamed_part())
        assert sorted(os.listdir(mnt)) == ["small"]

        async def ringed_part() -> None:  # received into its ring: written with O_DIRECT
            pw = await s.open_part_writer("parts", 4 << 20, 4 << 20)
            stream = pw.stream_part(0)
            assert stream.ring is not None
            try:
                for _ in range(4):
                    stream.ring[:] = os.urandom(stream.ring.nbytes)
                    pending = stream.write(stream.ring)
                    if pending is not None:
                        await pending
            finally:
                await pw.abort()

        with pytest.raises(TierFull):
            runtime.run(ringed_part())
        assert sorted(os.listdir(mnt)) == ["small"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_streamed_parts_go_to_disk_from_their_ring(posix_root):
    """A streamed part of a local file offers its source a page-aligned ring; whole pages
    handed over from the ring's start, at a page boundary of the file, are written from
    it with O_DIRECT (none of them in the page cache after), everything else (bytes from
    elsewhere, a piece not starting on a page of the file, a tail short of a page) through
    the page cache.  The bytes are exact either way."""
    mib = 1 << 20
    size = 4 * mib - 100
    data = os.urandom(size)
    store = PosixStore(posix_root)

    async def feed(stream, pieces) -> None:
        for pos, n, from_ring in pieces:
            view = stream.ring[:n] if from_ring else memoryview(data[pos : pos + n])
            if from_ring:
                view[:] = data[pos : pos + n]
            pending = stream.write(view)
            if pending is not None:
                await pending
        await stream.close()
        assert stream.ring is None  # handed back

    async def go() -> None:
        pw = await store.open_part_writer("f", size, 2 * mib)
        s0, s1 = pw.stream_part(0), pw.stream_part(1)
        assert s0.ring is not None and s0.ring.nbytes == mib
        # Part 0 never lines up: 1,000 bytes from the ring (not a whole page), then ring
        # pieces at offsets off a page boundary, then bytes not from the ring.
        await feed(s0, [(0, 1000, True), (1000, mib, True), (mib + 1000, mib - 1000, False)])
        # Part 1: one whole ring, then the rest from the ring: its whole pages direct, the
        # last 3,996 bytes (short of a page) through the cache.
        await feed(s1, [(2 * mib, mib, True), (3 * mib, mib - 100, True)])
        await pw.commit()

    runtime.run(go())
    path = os.path.join(posix_root, "f")
    cached = cachestat(path)[0]
    with open(path, "rb") as f:
        assert f.read() == data
    # Part 0's 512 pages and the tail's one; the 511 pages written direct are not cached
    # (all 1,024 are when everything goes through the page cache).
    assert cached <= 513


def test_streamed_part_writes_leave_the_loop_when_slow_or_not_local(posix_root, monkeypatch):
    """Writes run on the event loop on a local file system until one is slow, or a window
    of them is slow together; then, and on a striped (Lustre) tier from the start, they go
    to the I/O pool (an awaitable)."""
    from fmstore.stores import posix_io

    data = os.urandom(1 << 20)

    async def write(store: PosixStore, key: str) -> list[bool]:
        pw = await store.open_part_writer(key, len(data), len(data))
        stream = pw.stream_part(0)
        waited = []
        for pos in range(0, len(data), 256 << 10):
            pending = stream.write(memoryview(data)[pos : pos + (256 << 10)])
            waited.append(pending is not None)
            if pending is not None:
                await pending
        await stream.close()
        await pw.commit()
        return waited

    local = PosixStore(posix_root)
    # No write counts as slow here however loaded the machine: 20 ms is the default.
    monkeypatch.setattr(posix_io, "SLOW_WRITE_S", 3600.0)
    assert runtime.run(write(local, "a")) == [False] * 4
    # Writes slow together: after a window of them (two here), no write on its own slow.
    monkeypatch.setattr(posix_io, "SLOW_WRITE_RATE", float("inf"))
    monkeypatch.setattr(posix_io, "WRITE_WINDOW", 2)
    assert runtime.run(write(local, "d")) == [False, False, True, True]
    monkeypatch.setattr(posix_io, "SLOW_WRITE_RATE", 0.0)
    monkeypatch.setattr(posix_io, "SLOW_WRITE_S", 0.0)
    assert runtime.run(write(local, "b")) == [False, True, True, True]
    striped = PosixStore(posix_root, options=PosixOptions(stripe_count=2))
    assert runtime.run(write(striped, "c")) == [True] * 4
    for key in "abcd":
        assert runtime.run(local.get(key)) == data


def test_file_size_limit_is_tier_full(tmp_path):
    """RLIMIT_FSIZE in a child process (works without root): EFBIG becomes TierFull."""
    code = f"""
import os, resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
from fmstore import runtime
from fmstore.errors import TierFull
from fmstore.stores import PosixStore
s = PosixStore({str(tmp_path)!r})
try:
    runtime.run(s.put("big", os.urandom(2 << 20)))
except TierFull as e:
    print("TierFull", e.key)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "TierFull big" in out.stdout, out.stderr
    assert os.listdir(tmp_path) == []


def test_temp_files_are_hidden_and_cleaned(posix_root):
    s = PosixStore(posix_root)
    junk = os.path.join(posix_root, f"{TMP_MARK}dead.obj")
    with open(junk, "wb") as f:
        f.write(b"partial")
    os.utime(junk, (0, 0))
    assert runtime.run(s.list_keys()) == []
    assert runtime.run(s.cleanup_temp(older_than=60)) == 1
    assert not os.path.exists(junk)


def test_delete_prunes_empty_directories(posix_root):
    s = PosixStore(posix_root)
    runtime.run(s.put("a/b/c/d", b"x"))
    runtime.run(s.delete("a/b/c/d"))
    assert os.listdir(posix_root) == []


def test_symlink_outside_root_is_not_listed_as_dir(posix_root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    os.symlink(outside, os.path.join(posix_root, "link"))
    s = PosixStore(posix_root)
    assert runtime.run(s.list_keys()) == []


def test_fs_type_reads_the_mount_table(tmp_path):
    from fmstore.stores.posix_io import _LOCAL_FS, fs_type

    assert fs_type("/proc/self") == "proc"
    kind = fs_type(str(tmp_path))
    assert kind is not None
    store = PosixStore(str(tmp_path / "s"))
    # Small writes run on the event loop only on local file systems.
    assert store._inline_puts == (kind in _LOCAL_FS)
    runtime.run(store.put("a/b", b"x" * 100))
    assert runtime.run(store.get("a/b")) == b"x" * 100


# ---- symbolic links inside a tier: never followed -----------------------------------------


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    """Both ways of resolving beneath the root: openat2 (when the kernel has it) and the
    O_NOFOLLOW walk used without it."""
    from fmstore.stores import beneath

    if request.param == "walk":
        monkeypatch.setattr(beneath, "_openat2", lambda: None)
    elif beneath._openat2() is None:
        pytest.skip("this kernel has no openat2")
    return request.param


@pytest.fixture
def planted(posix_root, tmp_path):
    """A tier holding links another user could plant: ``link -> outside/``,
    ``deep/inner -> outside/``, ``leak -> outside/secret``; and a real file ``real``."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    old_tmp = outside / f"{TMP_MARK}old"
    old_tmp.write_bytes(b"t")
    os.utime(old_tmp, (1, 1))
    os.symlink(outside, os.path.join(posix_root, "link"))
    os.makedirs(os.path.join(posix_root, "deep"))
    os.symlink(outside, os.path.join(posix_root, "deep", "inner"))
    os.symlink(outside / "secret", os.path.join(posix_root, "leak"))
    with open(os.path.join(posix_root, "real"), "wb") as f:
        f.write(b"real")
    return outside


def _outside_untouched(outside) -> None:
    assert sorted(os.listdir(outside)) == sorted(["secret", f"{TMP_MARK}old"])
    assert (outside / "secret").read_bytes() == b"secret"


def test_writes_through_a_link_in_the_tier_are_refused(posix_root, planted, resolver):
    s = PosixStore(posix_root, tier="lustre")
    for key in ("link/x", "deep/inner/x", "link/new/dir/x", "leak/x"):
        with pytest.raises((PermissionDenied, NotFound)) as e:
            runtime.run(s.put(key, b"evil"))
        assert e.value.tier == "lustre"
    with pytest.raises(PermissionDenied):
        runtime.run(s.put("link/x", b"e" * (2 << 20), PutOptions(durable=True)))
    with pytest.raises(PermissionDenied):
        runtime.run(s.open_writer("link/x"))
    with pytest.raises(PermissionDenied):
        runtime.run(s.open_part_writer("link/x", 10, 5))
    with pytest.raises(PermissionDenied):
        runtime.run(s.copy("real", "link/x"))
    _outside_untouched(planted)


def test_reads_and_deletes_through_a_link_in_the_tier_are_refused(posix_root, planted, resolver):
    s = PosixStore(posix_root)
    for key in ("link/secret", "deep/inner/secret", "leak"):
        for op in (s.get, s.stat, s.get_with_meta, lambda k: s.get_range(k, 0, 1)):
            with pytest.raises(PermissionDenied):
                runtime.run(op(key))
        with pytest.raises(PermissionDenied):
            runtime.run(s.copy(key, "stolen"))
    for key in ("link/secret", "deep/inner/secret"):
        with pytest.raises(PermissionDenied):
            runtime.run(s.delete(key))
    _outside_untouched(planted)
    assert not os.path.exists(os.path.join(posix_root, "stolen"))
    # A key naming a link itself deletes the link, never its target.
    runtime.run(s.delete("leak"))
    assert not os.path.lexists(os.path.join(posix_root, "leak"))
    _outside_untouched(planted)


def test_listing_and_cleanup_never_pass_through_links(posix_root, planted, resolver):
    s = PosixStore(posix_root)
    assert runtime.run(s.list_keys()) == ["real"]  # neither link to a dir nor to a file
    with pytest.raises(PermissionDenied):
        runtime.run(s.list_keys("link"))
    with pytest.raises(PermissionDenied):
        runtime.run(s.list_keys("deep/inner/"))
    assert runtime.run(s.cleanup_temp(0)) == 0
    with pytest.raises(PermissionDenied):
        runtime.run(s.cleanup_temp(0, under="link"))
    _outside_untouched(planted)


def test_local_path_refuses_a_link_on_the_way(posix_root, planted):
    s = PosixStore(posix_root)
    assert s.local_path("real") == os.path.join(posix_root, "real")
    assert s.local_path("not/there") == os.path.join(posix_root, "not", "there")
    for key in ("link/secret", "leak", "deep/inner/secret"):
        with pytest.raises(PermissionDenied):
            s.local_path(key)
    with pytest.raises(PermissionDenied):
        s.sub("deep").local_path("inner/secret")  # wrappers ask the same


def test_page_cache_writes_are_at_most_one_mib_each(tmp_path, monkeypatch):
    """A write of 2 MiB or more makes the kernel take whole 2 MiB blocks of free memory
    for the page cache, which a VM's host may have taken back (see ``CACHE_WRITE``): a
    put, a writer and pieces all reach the file in writes of at most 1 MiB, and in order.
    Every write call into a file under the root is recorded on its way to the real one."""
    import random

    from fmstore.stores.posix_io import CACHE_WRITE, pwrite_all

    root = tmp_path / "root"
    root.mkdir()
    sizes: list[int] = []

    def recorded(real, nbytes):
        def call(fd, data, *rest):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(root)):
                sizes.append(nbytes(data))
            return real(fd, data, *rest)

        return call

    monkeypatch.setattr(os, "write", recorded(os.write, lambda d: memoryview(d).nbytes))
    monkeypatch.setattr(os, "pwrite", recorded(os.pwrite, lambda d: memoryview(d).nbytes))
    monkeypatch.setattr(
        os, "pwritev", recorded(os.pwritev, lambda ds: sum(memoryview(d).nbytes for d in ds))
    )

    rnd = random.Random(7)
    body = rnd.randbytes(9 << 20)
    s = PosixStore(str(root))
    runtime.run(s.put("one", body))  # one 9 MiB buffer
    w = runtime.run(s.open_writer("seq"))
    runtime.run(w.write([body[: 3 << 20], body[3 << 20 : (3 << 20) + 5]]))
    runtime.run(w.write(memoryview(body)[(3 << 20) + 5 :]))
    runtime.run(w.commit())
    # Pieces of every size around the cap, written at an offset.
    cuts = sorted(rnd.sample(range(1, len(body)), 40))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
    fd = os.open(root / "pieces", os.O_WRONLY | os.O_CREAT)
    try:
        pwrite_all(fd, pieces, 4096)
    finally:
        os.close(fd)
    monkeypatch.undo()

    assert (root / "one").read_bytes() == body
    assert (root / "seq").read_bytes() == body
    assert (root / "pieces").read_bytes() == bytes(4096) + body
    assert sum(sizes) == 3 * len(body)
    assert max(sizes) == CACHE_WRITE


def test_large_synced_writes_leave_the_page_cache_behind_them(tmp_path, monkeypatch):
    """A synced put or writer of a large file goes to disk as it is written, and the page
    cache holds at most two windows of it at a time (fresh memory for the whole file is
    what made big saves slow, see ``pwrite_behind``); once committed none of it is
    cached, and the bytes are exact.  A store that does not sync leaves its file cached."""
    import random

    from fmstore.stores import posix_io

    window = 1 << 20
    monkeypatch.setattr(posix_io, "WRITE_BEHIND", window)
    real_pwrite_all = posix_io.pwrite_all
    cached_before_write: list[int] = []

    def recording(fd, data, offset):
        cached_before_write.append(cachestat(fd)[0])
        return real_pwrite_all(fd, data, offset)

    monkeypatch.setattr(posix_io, "pwrite_all", recording)
    body = random.Random(3).randbytes(8 * window + 5)
    root = tmp_path / "root"
    s = PosixStore(str(root))
    runtime.run(s.put("one", body))
    w = runtime.run(s.open_writer("seq"))
    # Windows carry over from one write to the next (a writer's writes may be of one
    # window, a compressed chunk each); one under a window is written plainly.
    runtime.run(w.write([body[: 3 * window + 3], body[3 * window + 3 : 4 * window]]))
    runtime.run(w.write(memoryview(body)[4 * window : 6 * window + 7]))
    runtime.run(w.write(memoryview(body)[6 * window + 7 : 7 * window + 7]))
    runtime.run(w.write(memoryview(body)[7 * window + 7 :]))
    runtime.run(w.commit())
    scratch = PosixStore(str(tmp_path / "scratch"), options=PosixOptions(fsync=False))
    runtime.run(scratch.put("one", body))
    monkeypatch.undo()

    page = os.sysconf("SC_PAGE_SIZE")
    pages = -(-len(body) // page)
    assert len(cached_before_write) >= 8 + 8  # window by window, both files
    assert max(cached_before_write) <= 2 * window // page + 1
    assert cachestat(root / "one")[0] == 0 and cachestat(root / "seq")[0] == 0
    assert cachestat(tmp_path / "scratch" / "one")[0] == pages
    for path in (root / "one", root / "seq", tmp_path / "scratch" / "one"):
        assert path.read_bytes() == body
