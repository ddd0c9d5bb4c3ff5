"""The conformance suite every Store backend and wrapper passes.

Subclass :class:`StoreConformance` in a test module and provide two fixtures:

* ``store``: a fresh, empty :class:`~fmstore.stores.Store`;
* ``backdoor``: a :class:`Backdoor` that reads the same storage *without* the store under
  test, so results are checked against the truth rather than against the store itself.

A read-only store (a read-through cache) sets ``read_only`` and overrides
:meth:`StoreConformance.source` to name the store it reads from: the suite puts its test
objects there and reads them back through the store under test, checks that the store
refuses every write, and skips the cases whose subject is a write.
"""

from __future__ import annotations

import abc
import asyncio
import os
import threading
from collections.abc import Awaitable
from typing import Any

import pytest

from .. import runtime
from ..errors import (
    AlreadyExists,
    InvalidKey,
    InvalidRange,
    NotFound,
    NotSupported,
    StoreUnavailable,
)
from ..stores.base import Buffer, ByteRange, PutOptions, Store


class Backdoor(abc.ABC):
    @abc.abstractmethod
    def read(self, key: str) -> bytes | None:
        """The raw bytes stored under ``key``, or None."""

    @abc.abstractmethod
    def keys(self) -> list[str]:
        """Every object key visible in the raw storage (sorted), temp artefacts included."""


class PosixBackdoor(Backdoor):
    """Reads a POSIX tier's directory directly; ignores the per-directory lock files."""

    def __init__(self, root: str) -> None:
        self.root = root

    def read(self, key: str) -> bytes | None:
        try:
            with open(os.path.join(self.root, key), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def keys(self) -> list[str]:
        out = []
        for d, _dirs, files in os.walk(self.root):
            for f in files:
                if f != ".fmstore-lock":
                    out.append(os.path.relpath(os.path.join(d, f), self.root))
        return sorted(out)


def run(coro: Any) -> Any:
    return runtime.run(coro, timeout=300)


BIG = int(os.environ.get("FMSTORE_TEST_BIG_MB", "256")) << 20


class StoreConformance:
    #: Whether the store under test refuses writes (see the module docstring).
    read_only = False

    def source(self, store: Store) -> Store:
        """Where the suite puts the objects it then reads: the store under test, or the
        store a read-only one reads from."""
        return store

    def _needs_writes(self) -> None:
        if self.read_only:
            pytest.skip("a write is the subject; the store is read-only (test_writes_are_refused)")

    # ---- round trips -------------------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, 4096, 5 * 1024 * 1024 + 7])
    def test_put_get_roundtrip(self, store: Store, backdoor: Backdoor, size: int) -> None:
        data = os.urandom(size)
        meta = run(self.source(store).put("dir/obj.bin", data))
        assert meta.size == size
        assert backdoor.read("dir/obj.bin") == data
        assert run(store.get("dir/obj.bin")) == data
        assert run(store.stat("dir/obj.bin")).size == size

    def test_big_object_roundtrip(self, store: Store, backdoor: Backdoor) -> None:
        self._needs_writes()
        data = os.urandom(1 << 20) * (BIG >> 20)
        run(store.put("big", data))
        assert run(store.stat("big")).size == len(data)
        got = run(store.get("big"))
        assert len(got) == len(data) and got == data
        del got
        w = run(store.open_writer("big2"))
        view = memoryview(data)
        for off in range(0, len(data), 24 << 20):
            run(w.write(view[off : off + (24 << 20)]))
        run(w.commit())
        assert backdoor.read("big2") == data

    def test_get_into(self, store: Store) -> None:
        data = os.urandom(100_000)
        run(self.source(store).put("x", data))
        out = bytearray(1000)
        run(store.get_into("x", 500, memoryview(out)))
        assert bytes(out) == data[500:1500]

    def test_read_to_hands_over_the_range_in_order(self, store: Store) -> None:
        data = os.urandom(3 << 20)
        run(self.source(store).put("s", data))
        for start, end in ((0, len(data)), (1, len(data) - 1), (7, 7)):
            got = bytearray()
            run(store.read_to("s", start, end, got.extend))
            assert got == data[start:end]
        waited = bytearray()

        def slow(view: memoryview) -> Awaitable[None]:
            waited.extend(view)
            return asyncio.sleep(0)

        run(store.read_to("s", 3, 3 + (2 << 20), slow))
        assert waited == data[3 : 3 + (2 << 20)]
        with pytest.raises(InvalidRange):
            run(store.read_to("s", 0, len(data) + 1, got.extend))
        with pytest.raises(NotFound):
            run(store.read_to("missing", 0, 1, got.extend))

        def refuse(view: memoryview) -> None:
            raise OSError(28, "No space left on device")

        with pytest.raises(OSError, match="No space left"):
            run(store.read_to("s", 0, 100, refuse))

    def test_read_to_pinned_to_an_etag_refuses_another_version(self, store: Store) -> None:
        """A reader of several ranges pins each to the version it stat-ed: the ranges of
        two versions must never be spliced into one copy."""
        src = self.source(store)
        run(src.put("v", b"1" * 100_000))
        etag = run(store.stat("v")).etag
        if etag is None:
            pytest.skip("the store has no etags to pin a read to")
        got = bytearray()
        run(store.read_to("v", 10, 100_000, got.extend, etag=etag))
        assert got == b"1" * 99_990
        run(src.put("v", b"2" * 100_001))
        with pytest.raises(StoreUnavailable, match="changed"):
            run(store.read_to("v", 10, 100_000, bytearray().extend, etag=etag))
        fresh = run(store.stat("v")).etag
        got.clear()
        run(store.read_to("v", 0, 100_001, got.extend, etag=fresh))
        assert got == b"2" * 100_001

    def test_range_pieces_join_to_the_range(self, store: Store) -> None:
        data = os.urandom(3 << 20)
        run(self.source(store).put("p", data))
        for start, end in ((0, len(data)), (1, len(data) - 1), (5, 5 + (1 << 20)), (7, 7)):
            pieces = run(store.get_range_pieces("p", start, end))
            assert b"".join(pieces) == data[start:end]
        with pytest.raises(InvalidRange):
            run(store.get_range_pieces("p", 0, len(data) + 1))

    def test_part_writer_takes_pieces(self, store: Store, backdoor: Backdoor) -> None:
        self._needs_writes()
        part = 5 << 20  # S3's smallest part
        data = os.urandom(2 * part + 3)

        async def go() -> None:
            w = await store.open_part_writer("pw", len(data), part)
            view = memoryview(data)
            # Part 0 as uneven pieces, part 1 as one buffer, the tail as an empty + 3 bytes.
            await w.write_part(0, [view[:1], view[1:4097], bytes(view[4097:part])])
            await w.write_part(1, view[part : 2 * part])
            await w.write_part(2, [b"", view[2 * part :]])
            await w.commit()

        run(go())
        assert backdoor.read("pw") == data

    def test_part_writer_streams_parts_where_it_can(self, store: Store, backdoor: Backdoor) -> None:
        self._needs_writes()
        """A part written in order as its bytes arrive, beside parts written whole; a
        stream closed short is an error.  Stores that take whole parts only say None."""
        part = 5 << 20
        data = os.urandom(2 * part + 10)

        async def go() -> bool:
            w = await store.open_part_writer("ps", len(data), part)
            stream = w.stream_part(0)
            if stream is None:
                await w.abort()
                return False
            view = memoryview(data)
            for pos in range(0, part, 1 << 20):  # some writes done at once, some awaited
                pending = stream.write(view[pos : pos + (1 << 20)])
                if pending is not None:
                    await pending
            await stream.close()
            short = w.stream_part(2)
            assert short is not None
            pending = short.write(view[2 * part : 2 * part + 4])
            if pending is not None:
                await pending
            with pytest.raises(ValueError, match="4 of 10 bytes"):
                await short.close()
            with pytest.raises(ValueError, match="no more"):
                w.stream_part(2).write(memoryview(bytes(11)))  # type: ignore[union-attr]
            await w.write_part(1, view[part : 2 * part])
            await w.write_part(2, view[2 * part :])
            await w.commit()
            return True

        if run(go()):
            assert backdoor.read("ps") == data

    # ---- ranges ---------------------------------------------------------------------

    def test_ranges_at_edges(self, store: Store) -> None:
        data = bytes(range(256)) * 40
        run(self.source(store).put("r", data))
        n = len(data)
        assert run(store.get_range("r", 0, 1)) == data[:1]
        assert run(store.get_range("r", n - 1, n)) == data[-1:]
        assert run(store.get_range("r", n - 1)) == data[-1:]
        assert run(store.get_range("r", 100, 5000)) == data[100:5000]
        assert run(store.get_range("r", n, n)) == b""
        assert run(store.get_range("r", n)) == b""

    def test_range_past_end_is_clear_error(self, store: Store) -> None:
        run(self.source(store).put("r", b"0123456789"))
        with pytest.raises(InvalidRange, match="past the end"):
            run(store.get_range("r", 5, 11))
        with pytest.raises(InvalidRange):
            run(store.get_range("r", 11))
        with pytest.raises(NotFound):
            run(store.get_range("missing", 0, 1))

    def test_get_ranges_coalesces_correctly(self, store: Store) -> None:
        data = os.urandom(3 << 20)
        run(self.source(store).put("r", data))
        ranges = [
            ByteRange(10, 20),
            ByteRange(0, 5),
            ByteRange(2 << 20, (2 << 20) + 100),
            ByteRange(15, 40),
        ]
        got = run(store.get_ranges("r", ranges, coalesce=1024))
        assert got == [data[r.start : r.end] for r in ranges]

    # ---- stat, delete, copy -----------------------------------------------------------

    def test_missing_keys(self, store: Store) -> None:
        with pytest.raises(NotFound) as ei:
            run(store.stat("nope/x"))
        assert ei.value.key == "nope/x" and ei.value.tier == store.tier
        with pytest.raises(FileNotFoundError):  # NotFound is a FileNotFoundError
            run(store.get("nope"))
        if not self.read_only:
            run(store.delete("nope"))  # deleting a missing key is fine
        assert not run(store.exists("nope"))

    def test_delete_and_delete_many(self, store: Store, backdoor: Backdoor) -> None:
        self._needs_writes()
        for i in range(5):
            run(store.put(f"d/{i}", b"x"))
        run(store.delete("d/0"))
        assert backdoor.read("d/0") is None
        run(store.delete_many(["d/1", "d/2", "d/missing"]))
        assert run(store.list_keys("d")) == ["d/3", "d/4"]

    def test_copy(self, store: Store, backdoor: Backdoor) -> None:
        self._needs_writes()
        data = os.urandom(10_000)
        run(store.put("a/src", data, PutOptions(metadata={"color": "blue"})))
        run(store.copy("a/src", "b/dst"))
        assert backdoor.read("b/dst") == data
        assert backdoor.read("a/src") == data
        with pytest.raises(NotFound):
            run(store.copy("a/missing", "b/x"))

    def test_create_mode_refuses_existing(self, store: Store, backdoor: Backdoor) -> None:
        self._needs_writes()
        run(store.put("c", b"first", PutOptions(mode="create")))
        with pytest.raises(AlreadyExists):
            run(store.put("c", b"second", PutOptions(mode="create")))
        assert backdoor.read("c") == b"first"

    def test_metadata_roundtrip(self, store: Store) -> None:
        opts = PutOptions(metadata={"file-permissions": "0100644", "k": "v"})
        run(self.source(store).put("m", b"x", opts))
        assert (
            dict(run(store.stat("m")).metadata).items()
            >= {"file-permissions": "0100644", "k": "v"}.items()
        )

    def test_put_returns_what_stat_says(self, store: Store) -> None:
        """Callers record the meta a put returns (the copy engine's etag, the catalog's
        size): it must describe the object as stored."""
        self._needs_writes()
        cases: list[tuple[Any, bool]] = [
            ("create", False),
            ("overwrite", False),
            ("overwrite", True),
        ]
        for i, (mode, durable) in enumerate(cases):
            opts = PutOptions(mode=mode, metadata={"k": f"v{i}"}, durable=durable)
            put = run(store.put("said", b"abc" * (100 + i), opts))
            now = run(store.stat("said"))
            assert put.size == now.size == 3 * (100 + i)
            if put.etag is not None:
                assert put.etag == now.etag

    # ---- listing ----------------------------------------------------------------------

    def test_list_paginates_past_1000(self, store: Store) -> None:
        keys = [f"many/{i:05d}" for i in range(1100)]

        async def put_all() -> None:
            import asyncio

            sem = asyncio.Semaphore(64)

            async def one(k: str) -> None:
                async with sem:
                    await self.source(store).put(k, b"")

            await asyncio.gather(*(one(k) for k in keys))

        run(put_all())
        run(self.source(store).put("other/x", b""))
        assert run(store.list_keys("many")) == keys
        assert run(store.list_keys("many/")) == keys

        async def after() -> list[str]:
            return [
                m.key async for m in store.list("many", start_after="many/01049", page_size=100)
            ]

        assert run(after()) == keys[1050:]

    def test_list_order_prefix_and_dirs(self, store: Store) -> None:
        for k in ["p/a", "p/b/c", "p/b/d", "p-x/e", "p/ab", "pq"]:
            run(self.source(store).put(k, b"1"))
        assert run(store.list_keys("p")) == ["p/a", "p/ab", "p/b/c", "p/b/d"]
        assert run(store.list_keys("")) == ["p-x/e", "p/a", "p/ab", "p/b/c", "p/b/d", "pq"]

        async def shallow() -> list[tuple[str, bool]]:
            return [(m.key, m.is_dir) async for m in store.list("p", recursive=False)]

        assert run(shallow()) == [("p/a", False), ("p/ab", False), ("p/b/", True)]
        assert run(store.list_keys("nothing-here")) == []

    # ---- atomicity --------------------------------------------------------------------

    def test_overwrite_is_atomic_for_readers(self, store: Store) -> None:
        self._needs_writes()
        size = 2 << 20
        a, b = b"a" * size, b"b" * size
        run(store.put("atom", a))
        stop = threading.Event()
        seen: list[bytes] = []
        errors: list[BaseException] = []

        def reader() -> None:
            while not stop.is_set():
                try:
                    got = run(store.get("atom"))
                except NotFound as e:  # never acceptable: the key always exists
                    errors.append(e)
                    return
                seen.append(got[:1] if got in (a, b) else b"torn")

        t = threading.Thread(target=reader)
        t.start()
        try:
            for i in range(20):
                run(store.put("atom", b if i % 2 == 0 else a))
        finally:
            stop.set()
            t.join()
        assert not errors
        assert seen and b"torn" not in seen

    def test_aborted_writer_leaves_nothing(self, store: Store, backdoor: Backdoor) -> None:
        self._needs_writes()
        w = run(store.open_writer("w/aborted"))
        run(w.write(os.urandom(6 << 20)))
        run(w.abort())

        async def failing() -> None:
            async with await store.open_writer("w/failed") as w2:
                await w2.write(b"partial")
                raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            run(failing())
        assert not run(store.exists("w/aborted"))
        assert [k for k in backdoor.keys() if k.startswith("w/")] == []
        assert run(store.list_keys("w")) == []

    def test_writer_streams_and_commits(self, store: Store, backdoor: Backdoor) -> None:
        self._needs_writes()
        parts = [os.urandom(3 << 20) for _ in range(4)]

        async def write() -> None:
            async with await store.open_writer("w/ok") as w:
                for p in parts:
                    await w.write(p)
                assert not await store.exists("w/ok")  # nothing visible before commit

        run(write())
        assert backdoor.read("w/ok") == b"".join(parts)

    def test_writer_takes_pieces_and_leaves_them_to_the_caller(
        self, store: Store, backdoor: Backdoor
    ) -> None:
        # Pieces of every buffer type and of sizes that straddle any part boundary (an empty
        # one too), in one write big enough for S3 to send whole parts from them directly.
        self._needs_writes()
        sizes = [1, 0, 3 << 20, 64, (5 << 20) + 7, 2 << 20, 29 << 20, 4099, 9 << 20, 100]
        pieces = [bytearray(os.urandom(n)) for n in sizes]
        views: list[Buffer] = [bytes(p) if i % 3 == 0 else p for i, p in enumerate(pieces)]
        views[2] = memoryview(pieces[2])
        expected = b"".join(bytes(p) for p in pieces) + b"tail"

        async def write() -> None:
            async with await store.open_writer("w/pieces") as w:
                await w.write(views)
                for p in pieces:  # the caller's buffers are its own again once write returns
                    p[:] = bytes(len(p))
                await w.write([b"tail"])

        run(write())
        assert backdoor.read("w/pieces") == expected

    def test_fifty_concurrent_puts(self, store: Store, backdoor: Backdoor) -> None:
        self._needs_writes()
        import asyncio

        blobs = {f"conc/{i}": os.urandom(64 * 1024 + i) for i in range(50)}

        async def go() -> None:
            await asyncio.gather(*(store.put(k, v) for k, v in blobs.items()))

        run(go())
        for k, v in blobs.items():
            assert backdoor.read(k) == v

    # ---- keys -------------------------------------------------------------------------

    @pytest.mark.parametrize(
        "bad",
        [
            "../escape",
            "a/../../b",
            "/abs",
            "a//b",
            "a/",
            "",
            "a\x00b",
            "./a",
            "a\\..\\b",
            "x" * 1100,
        ],
    )
    def test_bad_keys_are_refused(self, store: Store, backdoor: Backdoor, bad: str) -> None:
        before = backdoor.keys()
        for op in (
            lambda: store.put(bad, b"x"),
            lambda: store.get(bad),
            lambda: store.stat(bad),
            lambda: store.delete(bad),
            lambda: store.copy("ok", bad),
        ):
            with pytest.raises(InvalidKey):
                run(op())
        assert backdoor.keys() == before

    def test_sub_store_is_rooted(self, store: Store, backdoor: Backdoor) -> None:
        sub = store.sub("root/inner")
        run(self.source(store).sub("root/inner").put("k", b"v"))
        assert backdoor.read("root/inner/k") == b"v"
        assert run(sub.list_keys()) == ["k"]
        assert run(sub.get("k")) == b"v"
        with pytest.raises(InvalidKey):
            run(sub.put("../k", b"v"))

    # ---- read-only stores ---------------------------------------------------------------

    def test_writes_are_refused(self, store: Store, backdoor: Backdoor) -> None:
        """A read-only store refuses every write with NotSupported, and nothing changes
        in the storage below it."""
        if not self.read_only:
            pytest.skip("the store takes writes")
        run(self.source(store).put("ro/k", b"v"))
        before = backdoor.keys()
        for op in (
            lambda: store.put("ro/k", b"w"),
            lambda: store.put("ro/new", b"w", PutOptions(mode="create")),
            lambda: store.open_writer("ro/w"),
            lambda: store.open_part_writer("ro/p", 10, 5),
            lambda: store.delete("ro/k"),
            lambda: store.delete_many(["ro/k"]),
            lambda: store.copy("ro/k", "ro/c"),
        ):
            with pytest.raises(NotSupported):
                run(op())
        assert backdoor.keys() == before
        assert run(store.get("ro/k")) == b"v"
