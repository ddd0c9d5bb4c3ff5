"""The node-local shard cache, shared by every rank and DataLoader worker on a node.

Guarantees:

* **one download per shard per node**: a download holds the shard's file lock; others wait
  on it (readers) or skip it (prefetch) and then find the finished file;
* **a half-downloaded shard is never read**: bytes go to a temp file that is renamed into
  place after its checksum (and size) check;
* **crashes recover**: locks are ``flock`` locks, which the kernel drops when a process dies;
  temp files whose lock is free are removed as stale;
* **the cache stays under ``limit`` bytes**: space is reserved (the temp file is sized to the
  shard's full length) under a cache-wide lock before a download starts; eviction drops the
  shard needed furthest in the future (the order is known), never one in use; a shard in use
  holds a shared ``flock`` on its pin file, which the evictor must take exclusively;
* **no deadlock under the limit**: nobody waits for space while holding shards.  A download
  that must wait for space marks its shard (``.locks/NAME.full``), and it and every reader
  waiting for that download first let go of the shards they hold (``release``, given by the
  dataset, closes its readers; they reopen them when next needed); under a limit the dataset
  also lets go at the end of each batch, so an idle DataLoader worker holds nothing.  Ranks
  on a node that drift apart, so that their shards in use outgrow the limit, still progress:
  once everyone waits, nothing is held and a space-waiter can evict; the cost is downloading
  again what was evicted meanwhile;
* **bad bytes are caught**: a checksum failure is re-fetched once, then :class:`CorruptData`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import xxhash
from filelock import AcquireReturnProxy, FileLock, Timeout

from .. import runtime
from ..errors import CorruptData, FmstoreError, InvalidRange, NotFound, PermissionDenied, TierFull
from ..format.codecs import zstd_decompress_exact
from ..stores import Store
from ..stores.posix_io import QuickWrites, pwrite_all
from . import metrics
from .formats.base import ShardSpec

#: ``next_use(name)``: how far in the future (in samples) a cached file is needed again.
NextUse = Callable[[str], float]
#: ``release()``: let go of (unpin) every shard this reader holds, before it waits.
Release = Callable[[], None]
TMP = ".tmp."
CHUNK = 8 << 20
CONCURRENCY = 8
#: Seconds between looks at a shard lock a reader waits on.
POLL = 0.005


@dataclass(frozen=True)
class CacheOptions:
    """The node cache of a :class:`~fmstore.loaders.StreamingDataset`.

    ``local``: the cache directory shared by every process on the node (None: under the
    ``nvme`` tier).  ``limit``: bytes the cache may hold (None: no limit); it must hold
    twice the shuffle window's shards.  ``prefetch``: shards each worker keeps downloading
    ahead (None: the shuffle window), ``max_concurrency`` at once.  ``direct_reads``:
    samples each worker may fetch by byte range at the start of an epoch while their shards
    are still downloading, so the first batch does not wait for whole shards (None: one
    batch; 0 turns it off).
    """

    local: str | None = None
    limit: int | None = None
    prefetch: int | None = None
    max_concurrency: int = 4
    direct_reads: int | None = None


class CacheFull(FmstoreError):
    """The cache limit cannot hold the shards in use (raise ``cache_limit``)."""


class ShardCache:
    """A cache directory holding complete shard files by name."""

    def __init__(self, root: str, limit: int | None = None, *, wait_timeout: float = 600.0) -> None:
        self.root = os.path.abspath(root)
        self.locks = os.path.join(self.root, ".locks")
        self.limit = limit
        self.wait_timeout = wait_timeout
        self._pins: dict[str, tuple[int, int]] = {}
        self._pid = os.getpid()
        try:
            os.makedirs(self.locks, exist_ok=True)
            probe = os.path.join(self.root, f"{TMP}probe.{os.getpid()}.{uuid.uuid4().hex[:8]}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as e:
            raise PermissionDenied(
                f"cache directory {self.root!r} is not writable: {e.strerror}",
                tier="cache",
                key=self.root,
            ) from None

    # ---- paths and pins ---------------------------------------------------------------

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _lock(self, name: str) -> FileLock:
        return FileLock(os.path.join(self.locks, name + ".lock"))

    def _fork_check(self) -> None:
        if os.getpid() != self._pid:  # inherited fds share the parent's locks; forget them
            self._pins = {}
            self._pid = os.getpid()

    def pin(self, name: str) -> None:
        """Mark ``name`` in use by this process (shared lock: it is never evicted)."""
        self._fork_check()
        fd, n = self._pins.get(name, (-1, 0))
        if fd < 0:
            fd = os.open(os.path.join(self.locks, name + ".use"), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)
        self._pins[name] = (fd, n + 1)

    def unpin(self, name: str) -> None:
        self._fork_check()
        fd, n = self._pins.get(name, (-1, 0))
        if fd < 0:
            return
        if n <= 1:
            del self._pins[name]
            os.close(fd)  # drops the shared lock
        else:
            self._pins[name] = (fd, n - 1)

    def unpin_all(self) -> None:
        for name in list(self._pins):
            self._pins[name] = (self._pins[name][0], 1)
            self.unpin(name)

    # ---- accounting and eviction ------------------------------------------------------

    def entries(self) -> list[tuple[str, int]]:
        """``(file name, size)`` of every file in the cache, temp files included."""
        out = []
        with os.scandir(self.root) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        out.append((e.name, e.stat().st_size))
        return out

    def usage(self) -> int:
        return sum(size for _name, size in self.entries())

    def _try_evict(self, name: str) -> bool:
        fd = os.open(os.path.join(self.locks, name + ".use"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # someone reads it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(name))
                metrics.EVICTIONS.inc()
            return True
        finally:
            os.close(fd)

    def _clean_stale_tmp(self, name: str) -> int:
        """Remove a temp file whose downloader is gone; returns the bytes freed."""
        base = name[len(TMP) :].rsplit(".", 2)[0] if name.startswith(TMP) else None
        if base is None or base == "probe":
            return 0
        lock = self._lock(base)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return 0
        try:
            try:
                size = os.stat(self.path(name)).st_size
                os.unlink(self.path(name))
            except FileNotFoundError:
                return 0
            return size
        finally:
            lock.release()

    def _reserve(
        self,
        name: str,
        size: int,
        next_use: NextUse,
        *,
        wait: bool,
        release: Release | None = None,
    ) -> str | None:
        """Create a temp file of ``size`` bytes for ``name`` once it fits under the limit.

        Evicts complete shards needed later than ``name`` itself (a prefetch, ``wait=False``,
        never pushes out something needed sooner; a reader may push out anything not in use).
        Returns the temp path, or None when a prefetch does not fit now.  A reader that has
        to wait marks ``name`` full and lets go of its shards first (see the module doc).
        """
        mark = self._full_mark(name)
        try:
            return self._reserve_loop(name, size, next_use, wait, release, mark)
        finally:
            if wait:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(mark)

    def _reserve_loop(
        self,
        name: str,
        size: int,
        next_use: NextUse,
        wait: bool,
        release: Release | None,
        mark: str,
    ) -> str | None:
        deadline = time.monotonic() + self.wait_timeout
        mine = next_use(name)
        marked = False
        while True:
            with self._space_lock():
                if self.limit is not None:
                    ents = self.entries()
                    used = sum(s for _n, s in ents)
                    if used + size > self.limit:
                        for n, _s in ents:
                            if n.startswith(TMP) and used + size > self.limit:
                                used -= self._clean_stale_tmp(n)
                        victims = sorted(
                            (
                                (next_use(n), n, s)
                                for n, s in ents
                                if not n.startswith(TMP) and n != name
                            ),
                            reverse=True,
                        )
                        for when, n, s in victims:
                            if used + size <= self.limit:
                                break
                            if not wait and when <= mine:
                                break
                            if n not in self._pins and self._try_evict(n):
                                used -= s
                    if used + size > self.limit:
                        if not wait:
                            return None
                        if time.monotonic() > deadline:
                            raise CacheFull(
                                f"cache_limit {self.limit} bytes cannot hold shard {name} "
                                f"({size} bytes) beside the {used} bytes in use",
                                tier="cache",
                                key=self.root,
                            )
                        pending = True
                    else:
                        pending = False
                else:
                    pending = False
                if not pending:
                    tmp = self.path(f"{TMP}{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
                    try:
                        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                        try:
                            os.ftruncate(fd, size)
                        finally:
                            os.close(fd)
                    except OSError as e:
                        with contextlib.suppress(OSError):
                            os.unlink(tmp)
                        cls = (
                            TierFull
                            if e.errno in (errno.ENOSPC, errno.EDQUOT)
                            else PermissionDenied
                        )
                        raise cls(
                            f"cannot write to the cache: {e.strerror}", tier="cache", key=tmp
                        ) from None
                    return tmp
            if not marked:
                # Those waiting for this download, and this reader, hold nothing while it
                # waits: otherwise readers spread over more shards than fit wait on each other.
                with open(mark, "wb"):
                    pass
                marked = True
                if release is not None:
                    release()
                    continue  # what it let go of may be evictable now
            time.sleep(0.05)  # wait for readers elsewhere on the node to release shards

    # ---- fetching ---------------------------------------------------------------------

    def get(
        self,
        name: str,
        store: Store,
        spec: ShardSpec,
        next_use: NextUse,
        release: Release | None = None,
    ) -> str:
        """Path of the complete, verified shard ``name``, pinned for this process.

        Blocks while another process downloads it; downloads it when nobody does.  Before
        waiting for space, or for a download that waits for space, calls ``release`` (once),
        which must unpin every other shard the caller holds.  Call :meth:`unpin` when done.
        """
        self.pin(name)
        try:
            path = self.path(name)
            if os.path.exists(path):
                metrics.CACHE_HITS.inc()
                return path
            t0 = time.perf_counter()
            # Another process is downloading it (or was): look again soon after it is done.
            with self._wait_lock(name, release):
                if not os.path.exists(path):
                    metrics.CACHE_MISSES.inc()
                    self._fetch(name, store, spec, next_use, wait=True, release=release)
                else:
                    metrics.CACHE_HITS.inc()
            metrics.WAIT_SECONDS.inc(time.perf_counter() - t0)
            return path
        except BaseException:
            self.unpin(name)
            raise

    def _space_lock(self) -> FileLock:
        """The cache-wide lock under which files enter and leave the cache's listing: a
        scan that races a rename can miss the renamed file, and a reservation that missed
        a complete shard would let the cache outgrow its limit."""
        return FileLock(os.path.join(self.locks, "space.lock"))

    def _full_mark(self, name: str) -> str:
        return os.path.join(self.locks, name + ".full")

    def _wait_lock(self, name: str, release: Release | None) -> AcquireReturnProxy:
        """``name``'s lock, acquired (a context that releases it); while its holder waits
        for space, ``release`` first."""
        lock = self._lock(name)
        while True:
            try:
                return lock.acquire(timeout=0)
            except Timeout:
                pass
            if release is not None and os.path.exists(self._full_mark(name)):
                release()
                release = None
            time.sleep(POLL)

    def prefetch(self, name: str, store: Store, spec: ShardSpec, next_use: NextUse) -> bool:
        """Download ``name`` unless present, being downloaded, or not fitting now."""
        if os.path.exists(self.path(name)):
            return True
        lock = self._lock(name)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return False
        try:
            if os.path.exists(self.path(name)):
                return True
            metrics.CACHE_MISSES.inc()
            return self._fetch(name, store, spec, next_use, wait=False)
        finally:
            lock.release()

    def _fetch(
        self,
        name: str,
        store: Store,
        spec: ShardSpec,
        next_use: NextUse,
        *,
        wait: bool,
        release: Release | None = None,
    ) -> bool:
        # We hold the shard's lock: any temp file (or full mark) of this shard is a dead
        # downloader's.
        for n, _s in self.entries():
            if n.startswith(f"{TMP}{name}."):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(n))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._full_mark(name))
        _check_object(store, spec)
        for attempt in (1, 2):
            tmp = self._reserve(name, spec.cached_size, next_use, wait=wait, release=release)
            if tmp is None:
                return False
            try:
                runtime.run(_download(store, spec, tmp))
            except CorruptData:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                if attempt == 2:
                    raise
                metrics.REFETCHES.inc()
                continue
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            with self._space_lock():
                os.replace(tmp, self.path(name))
            return True
        return False  # pragma: no cover


def _check_object(store: Store, spec: ShardSpec) -> None:
    """The shard's object must exist and hold the bytes the index lists, before any space
    is reserved for it (the index may be hostile, or the object replaced since)."""
    try:
        size = runtime.run(store.stat(spec.key)).size
    except NotFound:
        raise NotFound(
            "shard listed in the dataset index is missing", tier=store.tier, key=spec.key
        ) from None
    if spec.start + spec.size > size:
        raise CorruptData(
            f"shard is {size} bytes, shorter than the {spec.start + spec.size} the index lists",
            tier=store.tier,
            key=spec.key,
        )


async def _download(store: Store, spec: ShardSpec, tmp: str) -> None:
    """Fetch ``spec``'s bytes into ``tmp`` (sized already) and verify them."""
    try:
        if spec.compression is not None:
            if spec.compression != "zstd":
                raise CorruptData(
                    f"unknown shard compression {spec.compression!r}", tier=store.tier, key=spec.key
                )
            data = await store.get_range(spec.key, spec.start, spec.start + spec.size)
            metrics.BYTES_DOWNLOADED.inc(len(data))
            await runtime.to_cpu(_verify, store, spec, data)
            await runtime.to_cpu(_decompress_to, store, spec, data, tmp)
            return
        fd = os.open(tmp, os.O_WRONLY)
        try:
            import asyncio

            write = QuickWrites(functools.partial(pwrite_all, fd))

            async def part(lo: int) -> None:
                hi = min(spec.size, lo + CHUNK)
                pos = lo

                # Written from the transport's small reused ring as the bytes arrive: received
                # into fresh buffers instead, every 4 KiB page downloaded cost a page fault.
                def take(view: memoryview) -> Awaitable[None] | None:
                    nonlocal pos
                    off, pos = pos, pos + view.nbytes
                    return write(view, off)

                await store.read_to(spec.key, spec.start + lo, spec.start + hi, take)
                got = pos - lo
                if got != hi - lo:
                    raise CorruptData(
                        f"short read: {got} of {hi - lo} bytes",
                        tier=store.tier,
                        key=spec.key,
                    )
                metrics.BYTES_DOWNLOADED.inc(got)

            # A fixed pool of workers, not one coroutine per piece: the piece count comes
            # from the index's size, which is checked but should not size our task list.
            pieces = iter(range(0, spec.size, CHUNK))

            async def worker() -> None:
                for lo in pieces:
                    await part(lo)

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        finally:
            os.close(fd)
        if spec.checksum:
            await runtime.to_cpu(_verify_file, store, spec, tmp)
    except InvalidRange:
        raise CorruptData(
            f"shard is shorter than the {spec.size} bytes the index lists",
            tier=store.tier,
            key=spec.key,
        ) from None
    except NotFound:
        raise NotFound(
            "shard listed in the dataset index is missing", tier=store.tier, key=spec.key
        ) from None


def _verify(store: Store, spec: ShardSpec, data: bytes) -> None:
    if len(data) != spec.size:
        raise CorruptData(
            f"shard is {len(data)} bytes, the index lists {spec.size}",
            tier=store.tier,
            key=spec.key,
        )
    if spec.checksum and "xxh3_64:" + xxhash.xxh3_64_hexdigest(data) != spec.checksum:
        raise CorruptData("shard fails its checksum", tier=store.tier, key=spec.key)


def _verify_file(store: Store, spec: ShardSpec, path: str) -> None:
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        _verify(store, spec, m)  # type: ignore[arg-type]


def _decompress_to(store: Store, spec: ShardSpec, data: bytes, tmp: str) -> None:
    # Bounded by the index's raw size: a frame declaring more is refused before decoding.
    try:
        raw = zstd_decompress_exact(data, spec.cached_size)
    except CorruptData as e:
        raise CorruptData(
            f"shard does not decompress to the {spec.cached_size} bytes the index lists: "
            f"{e.message}",
            tier=store.tier,
            key=spec.key,
        ) from None
    with open(tmp, "r+b") as f:
        f.write(raw)
