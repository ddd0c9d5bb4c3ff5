"""The copy engine: many objects from one store to another, parallel, verified, resumable.

Shared by ``fmstore stage`` / ``cp`` and the tiering mover.  Input is a list of
:class:`CopyItem` (what to copy where) and :class:`TransferOptions`; :func:`copy_items`
returns a :class:`TransferReport`.  Guarantees:

* **Bounded.**  At most ``concurrency`` files and ``concurrency`` parts are in flight and at
  most ``max_inflight_bytes`` are held in memory; ``bwlimit`` (bytes/s) is one token bucket
  shared by every transfer.
* **Verified.**  The CRC32C of every byte read is computed while copying (per part for big
  objects, combined into the whole object's CRC), compared with the checksum the source
  recorded (``fmstore-crc32c`` metadata) when there is one, handed to the destination
  (``PutOptions.content_crc32c``) and recorded there as metadata with the source's version.
  ``verify=True`` checks the destination's CRC32C: the store's own (S3), else read back.
  A mismatch is retried, then reported as a failed file.
* **Atomic.**  Small objects are one ``put``; big ones (and, from a remote store to a
  local file, any over :data:`STREAM_OVER`, streamed) go through
  :meth:`~fmstore.stores.base.Store.open_part_writer`: nothing is visible at the final key
  before every part is written and the whole checksum matched.
* **Cheap re-runs.**  A destination object with the same size and a recorded checksum or
  source version equal to the source's is skipped (the journal answers without a request
  when it recorded the file).
* **Resumable.**  With a :class:`~fmstore.tiering.copy.journal.Journal`, a run killed at any
  point (Ctrl-C, ``kill -9``) resumes without rewriting finished files or the finished
  parts of big ones.
* **Durable when it returns.**  On a destination that caches writes (POSIX) files and
  parts are written without an fsync each; the destination is synced every
  ``sync_every`` seconds and before the run returns, and the journal records each sync,
  so after a power loss only what was written since the last sync is checked again
  (files and parts re-read and compared with their journaled checksums).
  A run of a single file fsyncs that file instead (a file system sync would flush
  everyone's writes).  ``fsync="each"`` fsyncs every file and part; ``fsync="none"`` never syncs
  (scratch data: the run returns before its bytes are on disk, and a resumed run re-reads
  everything it journaled).
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import random
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ... import runtime
from ...buffers import huge_buffer
from ...errors import CorruptData, FmstoreError, NotFound, StoreUnavailable
from ...limits import ByteBudget, TokenBucket
from ...stores import posixmeta
from ...stores.base import (
    Buffer,
    ObjectMeta,
    PartStream,
    PartWriter,
    Pieces,
    PutOptions,
    Store,
    nbytes,
    part_bounds,
    part_count,
)
from ...stores.crc import combine_all, crc32c, crc32c_of, from_hex, to_hex
from .journal import Journal, PendingParts

#: Metadata keys fmstore records on every object it writes (``x-amz-meta-…`` on S3).
META_CRC = "fmstore-crc32c"
META_SRC_VERSION = "fmstore-src-version"

MiB = 1 << 20
#: From a remote store to a local file, objects bigger than this stream in parts.
STREAM_OVER = 8 * MiB
#: From a local file, objects this big or bigger copied whole are read into a reused buffer.
REUSE_OVER = 1 * MiB


@dataclass(frozen=True)
class CopyItem:
    """One object to copy.  ``version`` identifies the source's content (its etag, or size
    and mtime) and ``crc32c`` is its checksum when already known (from a manifest or
    metadata); both are optional."""

    src_key: str
    dst_key: str
    size: int
    version: str | None = None
    crc32c: int | None = None


@dataclass(frozen=True)
class TransferOptions:
    concurrency: int = 32
    part_size: int = 32 * MiB
    multipart_threshold: int = 64 * MiB
    max_inflight_bytes: int = 1024 * MiB
    bwlimit: float | None = None
    verify: bool = False
    retries: int = 3
    skip_identical: bool = True
    posix_attrs: bool = True
    #: Restore owner and group from the source's metadata on a POSIX destination (only
    #: on the operator's word: see :mod:`fmstore.stores.posixmeta`).
    preserve_owner: bool = False
    fsync: Literal["batch", "each", "none"] = "batch"
    sync_every: float = 30.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.part_size < 1 * MiB // 16:
            raise ValueError("part_size must be at least 64 KiB")
        if self.bwlimit is not None and self.bwlimit <= 0:
            raise ValueError("bwlimit must be positive")
        if self.fsync not in ("batch", "each", "none"):
            raise ValueError(f"fsync must be batch, each or none, not {self.fsync!r}")
        if self.sync_every <= 0:
            raise ValueError("sync_every must be positive")


@dataclass
class TransferProgress:
    """Live counters, updated on the event loop and read from any thread."""

    files_total: int = 0
    bytes_total: int = 0
    files_copied: int = 0
    files_skipped: int = 0
    files_failed: int = 0
    bytes_copied: int = 0  # bytes moved by this run
    bytes_skipped: int = 0  # bytes of files found identical
    bytes_resumed: int = 0  # bytes of parts a previous run had finished
    started: float = field(default_factory=time.monotonic)

    @property
    def files_done(self) -> int:
        return self.files_copied + self.files_skipped + self.files_failed

    @property
    def bytes_done(self) -> int:
        return self.bytes_copied + self.bytes_skipped + self.bytes_resumed


@dataclass(frozen=True)
class Failure:
    key: str
    error: str
    exc: FmstoreError | None = None  # typed, for callers that classify (never by message)


@dataclass
class TransferReport:
    """``written``: the whole-object CRC32C of every object this run wrote, by destination
    key, taken from the very bytes handed to the destination (and checked against the
    source's expected checksum); objects skipped as identical are not in it."""

    progress: TransferProgress
    failures: list[Failure]
    seconds: float
    written: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, object]:
        p = self.progress
        return {
            "files_total": p.files_total,
            "bytes_total": p.bytes_total,
            "files_copied": p.files_copied,
            "files_skipped": p.files_skipped,
            "files_failed": p.files_failed,
            "bytes_copied": p.bytes_copied,
            "bytes_skipped": p.bytes_skipped,
            "bytes_resumed": p.bytes_resumed,
            "seconds": round(self.seconds, 3),
            "failures": [{"key": f.key, "error": f.error} for f in self.failures],
        }


def version_of(meta: ObjectMeta) -> str | None:
    """What identifies an object's content cheaply: its etag, else size and mtime."""
    if meta.etag:
        return meta.etag.strip('"')
    if meta.mtime is not None:
        return f"{meta.size}:{meta.mtime!r}"
    return None


async def gather_or_cancel(aws: Iterable[Awaitable[object]]) -> None:
    """Await all; on the first failure cancel the rest and re-raise it."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Transfer:
    """One run of the engine over a list of items (see :func:`copy_items`)."""

    def __init__(
        self,
        src: Store,
        dst: Store,
        options: TransferOptions,
        *,
        journal: Journal | None = None,
        progress: TransferProgress | None = None,
        dst_existing: Mapping[str, ObjectMeta] | None = None,
    ) -> None:
        self.src, self.dst, self.opt = src, dst, options
        self.journal = journal or Journal(None)
        self.progress = progress or TransferProgress()
        self.dst_existing = dst_existing
        self.failures: list[Failure] = []
        self.written: dict[str, int] = {}
        self.bucket = TokenBucket(options.bwlimit) if options.bwlimit else None
        self.budget = ByteBudget(options.max_inflight_bytes)
        self.part_sem = asyncio.Semaphore(options.concurrency)
        self.src_local = src.local_root is not None
        self.dst_local = dst.local_root is not None
        # Batch durability: writes skip their own fsync, the flusher syncs the destination
        # (set per run: a run of one file fsyncs it rather than the whole file system).
        self.batch_sync = self.dst_local and options.fsync != "each"
        self._unsynced_writes = False
        # Part buffers, in huge pages (see fmstore.buffers), kept for the next parts up to
        # half the in-flight budget.
        self._spare: list[mmap.mmap | bytearray] = []
        # Ranges one object is read as, at most, when it streams into a file (see
        # _part_size): set by run() from the number of objects.
        self._ranges_per_object = 8

    async def run(self, items: Sequence[CopyItem]) -> TransferReport:
        t0 = time.monotonic()
        p = self.progress
        p.files_total += len(items)
        p.bytes_total += sum(i.size for i in items)
        if len(items) == 1 and self.opt.fsync == "batch":
            self.batch_sync = False
        # Requests left idle by the objects themselves: with as many objects as requests
        # in flight, each is one GET.
        idle = self.opt.concurrency // max(1, min(len(items), self.opt.concurrency))
        self._ranges_per_object = max(1, min(8, idle))
        queue = iter(items)
        flusher = asyncio.ensure_future(self._flush_loop())

        async def worker() -> None:
            for item in queue:
                await self._one(item)

        try:
            await gather_or_cancel(
                worker() for _ in range(min(self.opt.concurrency, len(items) or 1))
            )
            await self._sync()
        finally:
            flusher.cancel()
            with contextlib.suppress(BaseException):
                await flusher
            await asyncio.shield(self.journal.flush())
        return TransferReport(p, list(self.failures), time.monotonic() - t0, dict(self.written))

    async def _flush_loop(self) -> None:
        last_sync = time.monotonic()
        while True:
            await asyncio.sleep(0.25)
            await self.journal.flush()
            if time.monotonic() - last_sync >= self.opt.sync_every:
                await self._sync()
                last_sync = time.monotonic()

    async def _sync(self) -> None:
        """Make the writes so far durable and say so in the journal."""
        if self.batch_sync and self._unsynced_writes and self.opt.fsync == "batch":
            self._unsynced_writes = False
            await self.journal.synced(self.dst.sync)

    # ---- one file -------------------------------------------------------------------

    async def _one(self, item: CopyItem) -> None:
        p = self.progress
        try:
            if self.opt.skip_identical and await self._identical(item):
                p.files_skipped += 1
                p.bytes_skipped += item.size
                return
            attempt = 0
            while True:
                try:
                    if self._in_parts(item.size):
                        await self._copy_big(item)
                    else:
                        await self._copy_small(item)
                    break
                except (StoreUnavailable, CorruptData) as e:
                    attempt += 1
                    if attempt > self.opt.retries:
                        raise
                    await asyncio.sleep(min(5.0, 0.2 * 2**attempt) * (0.5 + random.random()))
                    del e
            p.files_copied += 1
        except asyncio.CancelledError:
            raise
        except FmstoreError as e:
            p.files_failed += 1
            self.failures.append(Failure(item.src_key, str(e), e))
        except Exception as e:  # a bug or an unexpected OS error: report it, keep going
            p.files_failed += 1
            self.failures.append(Failure(item.src_key, f"{type(e).__name__}: {e}"))

    async def _identical(self, item: CopyItem) -> bool:
        if self.dst_existing is not None:
            dmeta = self.dst_existing.get(item.dst_key)
        else:
            try:
                dmeta = await self.dst.stat(item.dst_key)
            except NotFound:
                dmeta = None
        if dmeta is None or dmeta.size != item.size:
            return False
        rec = self.journal.files.get(item.dst_key)
        if (
            rec is not None
            and rec.size == item.size
            and rec.version is not None
            and rec.version == item.version
            and (rec.dst_etag is None or rec.dst_etag == dmeta.etag)
        ):
            if rec.synced or not self.dst_local:
                return True
            # Written after the last sync of a previous run: maybe lost to a power cut.
            return await self._holds(item, from_hex(rec.crc))
        if not dmeta.metadata:
            try:
                dmeta = await self.dst.stat(item.dst_key)
            except NotFound:
                return False
        recorded_crc = from_hex(dmeta.metadata.get(META_CRC))
        if item.crc32c is not None and recorded_crc == item.crc32c:
            return True
        recorded_version = dmeta.metadata.get(META_SRC_VERSION)
        return item.version is not None and recorded_version == item.version

    async def _surviving_parts(
        self, w: PartWriter, pend: PendingParts
    ) -> dict[int, tuple[int, int]]:
        """Journaled parts of a resumed write that are still intact: parts journaled after
        the last sync (maybe lost to a power cut, kept after a crash) are read back and
        checked against their checksum, or written again where they cannot be read."""
        done = {}
        for i, (c, n) in pend.parts.items():
            if i in pend.unsynced and self.dst_local:
                data = await w.read_part(i)
                if data is None or len(data) != n or await self._crc(data) != c:
                    continue
            done[i] = (c, n)
        return done

    async def _holds(self, item: CopyItem, crc: int | None) -> bool:
        """Whether the destination's bytes have checksum ``crc``."""
        if crc is None:
            return False
        try:
            if self._in_parts(item.size):
                got = await self._read_crc(self.dst, item.dst_key, item.size)
            else:
                got = await self._crc(await self.dst.get(item.dst_key))
        except NotFound:
            return False
        return got == crc

    async def _attrs(self, item: CopyItem, src_meta: ObjectMeta) -> dict[str, str]:
        """FSx-convention POSIX attributes to carry: from the source file on a POSIX tier,
        else whatever the source object recorded."""
        if not self.opt.posix_attrs:
            return {}
        if src_meta.stat is not None:
            return posixmeta.from_stat(src_meta.stat)
        if self.src_local:
            path = self.src.local_path(item.src_key)
            if path is not None:
                with contextlib.suppress(OSError):
                    return posixmeta.from_stat(await runtime.to_io(os.lstat, path))
        return posixmeta.pick(src_meta.metadata)

    def _dst_metadata(
        self, attrs: Mapping[str, str], crc: int, version: str | None
    ) -> dict[str, str]:
        md = dict(attrs)
        md[META_CRC] = to_hex(crc)
        if version:
            md[META_SRC_VERSION] = version
        return md

    def _finish(self, item: CopyItem, dmeta: ObjectMeta, crc: int, version: str | None) -> None:
        # A POSIX destination applied the FSx attributes when it wrote the file.
        self.written[item.dst_key] = crc
        self.journal.file_done(item.dst_key, dmeta.size, version, crc, dmeta.etag)

    def _check(self, item: CopyItem, what: str, expected: int | None, got: int) -> None:
        if expected is not None and expected != got:
            raise CorruptData(
                f"checksum mismatch ({what}): expected crc32c {to_hex(expected)}, got {to_hex(got)}",
                tier=self.src.tier if what == "source" else self.dst.tier,
                key=item.src_key if what == "source" else item.dst_key,
            )

    async def _crc(self, data: Buffer | Pieces) -> int:
        return crc32c_of(data) if nbytes(data) < MiB else await runtime.to_cpu(crc32c_of, data)

    async def _copy_small(self, item: CopyItem) -> None:
        held = await self.budget.acquire(max(item.size, 1))
        try:
            if self.src_local and item.size >= REUSE_OVER:
                smeta, data, buf = await self._read_local(item.src_key)
            else:
                (smeta, data), buf = await self.src.get_with_meta(item.src_key), None
            if self.bucket:
                await self.bucket.acquire(len(data))
            crc = await self._crc(data)
            self._check(item, "source", item.crc32c, crc)
            self._check(item, "source", from_hex(smeta.metadata.get(META_CRC)), crc)
            version = version_of(smeta)
            attrs = await self._attrs(item, smeta)
            opts = PutOptions(
                metadata=self._dst_metadata(attrs, crc, version),
                content_crc32c=crc,
                durable=not self.batch_sync,
                preserve_owner=self.opt.preserve_owner,
            )
            dmeta = await self.dst.put(item.dst_key, data, opts)
            self._unsynced_writes = self.batch_sync
            self.progress.bytes_copied += len(data)
            del data
            if buf is not None:
                self._spare_buffer(buf)
            if self.opt.verify:
                await self._verify_destination(item, crc)
            self._finish(item, dmeta, crc, version)
        finally:
            await self.budget.release(held)

    async def _read_local(self, key: str) -> tuple[ObjectMeta, Buffer, mmap.mmap | bytearray]:
        """A local file read whole into a reused buffer (fresh memory costs a fault per page),
        with its metadata; a stat after the read says the file did not change meanwhile."""
        meta = await self.src.stat(key)
        buf = self._part_buffer(meta.size, part=False)
        data = memoryview(buf)[: meta.size]
        await self.src.get_into(key, 0, data)
        after = await self.src.stat(key)
        if version_of(after) != version_of(meta) or after.size != meta.size:
            raise StoreUnavailable("source changed while being copied", tier=self.src.tier, key=key)
        return meta, data, buf

    async def _verify_destination(self, item: CopyItem, crc: int) -> None:
        """``verify``: the destination's checksum of its copy, as the store computed it
        when it took the bytes (S3: the server's, which it checked against the one we
        sent), else the bytes read back; CorruptData unless it is ``crc``."""
        size, got = await self.dst.stored_crc32c(item.dst_key)
        if got is None:
            if self._in_parts(size):
                got = await self._read_crc(self.dst, item.dst_key, size)
            else:
                got = await self._crc(await self.dst.get(item.dst_key))
        self._check(item, "destination", crc, got)

    def _in_parts(self, size: int) -> bool:
        """Whether an object is copied in parts: above the multipart threshold, or, from a
        remote store to a local file, above :data:`STREAM_OVER` (its parts then stream
        into the file: no buffer the size of the object, one pass over its bytes)."""
        if size > self.opt.multipart_threshold:
            return True
        return size > STREAM_OVER and self.dst_local and not self.src_local

    def _part_size(self, size: int) -> int:
        # No store takes more than 10,000 parts (S3's limit).
        least = -(-size // 10_000)
        if self.dst_local and not self.src_local:
            # Streamed into a file, a part needs no buffer and S3's 5 MiB floor does not
            # apply: a mid-sized object copied alone still goes as several ranges at once (up
            # to eight, in whole MiB so parts start on page boundaries), but not when other
            # objects keep the requests busy (every range costs a request, and the server
            # its work).
            ranges = self._ranges_per_object
            share = -(-size // (ranges * MiB)) * MiB
            return max(least, min(self.opt.part_size, max(STREAM_OVER, share)))
        return max(least, self.opt.part_size)

    async def _copy_big(self, item: CopyItem) -> None:
        smeta = await self.src.stat(item.src_key)
        size, version = smeta.size, version_of(smeta)
        expected = (
            item.crc32c if item.crc32c is not None else from_hex(smeta.metadata.get(META_CRC))
        )
        part_size = self._part_size(size)
        pend = self.journal.pending.get(item.dst_key)
        token = None
        if pend is not None and pend.version == version and pend.part_size >= -(-size // 10_000):
            # A resumed write keeps the part size it began with (a run of other files, or
            # with other options, would choose another).
            token, part_size = pend.token, pend.part_size
        if pend is not None and token is None:
            await self._drop_pending(item.dst_key, size, pend)
        attrs = await self._attrs(item, smeta)
        if expected is None and self.src_local and not self.dst_local:
            # Remote stores fix metadata when an upload starts (S3 multipart) and would need
            # a server-side copy of the whole object to add the checksum at commit; a local
            # file is cheaper to read twice (the second read comes from the page cache).
            expected = await self._read_crc(self.src, item.src_key, size)
        # What is known up front goes in at open.
        early = dict(attrs)
        if version:
            early[META_SRC_VERSION] = version
        if expected is not None:
            early[META_CRC] = to_hex(expected)
        w = await self.dst.open_part_writer(
            item.dst_key,
            size,
            part_size,
            token=token,
            options=PutOptions(
                metadata=early,
                content_crc32c=expected,
                durable=not self.batch_sync,
                preserve_owner=self.opt.preserve_owner,
            ),
        )
        self._unsynced_writes = self.batch_sync
        if token is not None and w.resumed and pend is not None:
            done = await self._surviving_parts(w, pend)
            resumed = sum(n for _c, n in done.values())
            self.progress.bytes_resumed += resumed
        else:
            done = {}
            await self.journal.parts_started(item.dst_key, w.token, version, part_size)
        n = part_count(size, part_size)
        crcs: dict[int, tuple[int, int]] = dict(done)

        counted = 0
        # Parts read pinned to the etag stat saw cannot mix two versions of the source; any
        # other part (read from a file, or into a buffer) is checked by a second stat below.
        pinned = smeta.etag is not None and not done

        async def one(i: int) -> None:
            nonlocal counted, pinned
            start, end = part_bounds(i, size, part_size)
            async with self.part_sem:
                # The budget bounds bytes in flight: in buffers, and asked of the source (a
                # server holds what it is asked for until it is taken).
                held = await self.budget.acquire(end - start)
                try:
                    # A remote source streams into a destination that takes a part in
                    # order (a file); otherwise the part goes through a buffer.
                    stream = None if self.src_local else w.stream_part(i)
                    if stream is not None:
                        c = await self._stream_part(item.src_key, start, end, stream, smeta.etag)
                    else:
                        pinned = False
                        c = await self._buffer_part(item.src_key, start, end, w, i)
                finally:
                    await self.budget.release(held)
            crcs[i] = (c, end - start)
            self.progress.bytes_copied += end - start
            counted += end - start
            await self.journal.part_done(item.dst_key, w.token, i, c, end - start)

        # Parts stay on a failure or interruption: the next attempt resumes from them.
        try:
            await gather_or_cancel(one(i) for i in range(n) if i not in done)
            whole = combine_all(crcs[i] for i in range(n))
            after = smeta if pinned else await self.src.stat(item.src_key)
            if version_of(after) != version or after.size != size:
                await w.abort()
                self.journal.forget(item.dst_key)
                raise StoreUnavailable(
                    "source changed while being copied", tier=self.src.tier, key=item.src_key
                )
            try:
                self._check(item, "source", expected, whole)
            except CorruptData:
                await w.abort()
                self.journal.forget(item.dst_key)
                raise
            dmeta = await w.commit(
                self._dst_metadata(attrs, whole, version),
                part_crc32c={i: c for i, (c, _n) in crcs.items()},
            )
            if self.opt.verify:
                await self._verify_destination(item, whole)
        except BaseException:
            # Not copied: a retry or the next run counts the parts it keeps as resumed.
            self.progress.bytes_copied -= counted
            raise
        self._finish(item, dmeta, whole, version)

    async def _drop_pending(self, key: str, size: int, pend: PendingParts) -> None:
        """An earlier run's write of ``key`` that cannot be resumed (the source changed, or
        the part size): its temp file or upload is removed rather than left behind."""
        with contextlib.suppress(FmstoreError):
            old = await self.dst.open_part_writer(key, size, pend.part_size, token=pend.token)
            await old.abort()
        self.journal.forget(key)

    async def _stream_part(
        self, key: str, start: int, end: int, stream: PartStream, etag: str | None
    ) -> int:
        """Bytes ``[start, end)`` of the source (of the version with ``etag``) written to
        ``stream`` as they arrive, and their CRC32C, taken on the way while they are in the
        CPU's cache."""
        if self.bucket:
            await self.bucket.acquire(end - start)
        crc = 0

        def take(view: memoryview) -> Awaitable[None] | None:
            nonlocal crc
            crc = crc32c(view, crc)
            return stream.write(view)

        await self.src.read_to(key, start, end, take, etag=etag, ring=stream.ring)
        await stream.close()
        return crc

    async def _buffer_part(self, key: str, start: int, end: int, w: PartWriter, i: int) -> int:
        """Bytes ``[start, end)`` of the source read into a reused buffer (straight from
        the socket or the file), then written as part ``i``; their CRC32C."""
        buf = self._part_buffer(end - start)
        data = memoryview(buf)[: end - start]
        await self.src.get_into(key, start, data)
        if self.bucket:
            await self.bucket.acquire(end - start)
        c = await self._crc(data)
        await w.write_part(i, data)
        del data
        # Only now, after success: a cancelled read may still be filling it.
        self._spare_buffer(buf)
        return c

    def _part_buffer(self, n: int, part: bool = True) -> mmap.mmap | bytearray:
        """A spare buffer of ``n`` bytes or more, else a new one: of a part's size (a last
        part's then serves a full one), or without ``part`` of ``n`` in whole MiB."""
        for i, b in enumerate(self._spare):
            if len(b) >= n:
                return self._spare.pop(i)
        return huge_buffer(max(n, self.opt.part_size) if part else -(-n // MiB) * MiB)

    def _spare_buffer(self, buf: mmap.mmap | bytearray) -> None:
        if (len(self._spare) + 1) * len(buf) <= self.opt.max_inflight_bytes // 2:
            self._spare.append(buf)

    async def _read_crc(self, store: Store, key: str, size: int) -> int:
        """CRC32C of a stored object, read in parts concurrently."""
        part_size = self.opt.part_size
        out: dict[int, tuple[int, int]] = {}

        async def one(i: int) -> None:
            start, end = part_bounds(i, size, part_size)
            async with self.part_sem:
                held = await self.budget.acquire(end - start)
                try:
                    buf = self._part_buffer(end - start)
                    data = memoryview(buf)[: end - start]
                    await store.get_into(key, start, data)
                    out[i] = (await self._crc(data), end - start)
                    del data
                    self._spare_buffer(buf)  # after success: a cancelled read may still fill it
                finally:
                    await self.budget.release(held)

        n = part_count(size, part_size)
        await gather_or_cancel(one(i) for i in range(n))
        return combine_all(out[i] for i in range(n))


async def copy_items(
    src: Store,
    dst: Store,
    items: Sequence[CopyItem],
    options: TransferOptions = TransferOptions(),
    *,
    journal: Journal | None = None,
    progress: TransferProgress | None = None,
    dst_existing: Mapping[str, ObjectMeta] | None = None,
) -> TransferReport:
    """Copy ``items`` from ``src`` to ``dst``; see the module docstring for the guarantees.

    ``dst_existing`` (the destination's listing, when the caller has it) saves one ``stat``
    per item when deciding what to skip.  Failed files are reported, not raised; an
    interruption (cancellation) leaves the journal and pending parts for the next run.
    """
    t = Transfer(src, dst, options, journal=journal, progress=progress, dst_existing=dst_existing)
    return await t.run(items)
