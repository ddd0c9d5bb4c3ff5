"""Replicas streamed from memory while a rank's own write runs.

With ``[tiers.X] replicas`` on a node-local tier, :class:`~.writer.Writer` opens a
:class:`Stream` in ``write_data``: every chunk the rank writes to its own NVMe is also sent,
from the same host memory (the staged copy; for compressed chunks, the encoded bytes), with
the CRC32C the writer computed for the manifest, to each of its replica holders
(:func:`.replicas.holders_of`, from each rank's node and failure domain in the save's
plan).  The rank's record follows its blobs.  Each holder receives
every source on a thread of its own, checks every chunk's CRC32C on arrival and writes it
under ``.replicas/KEY/GEN/`` of its tier in the background; received bytes wait in a fixed
pool of :data:`SLOTS` buffers of the chunk size, so a holder never allocates a whole blob.
What a holder received (each blob's size and chunks, the record) stays in memory until the
commit: :func:`.replicas.replicate` then counts the replica only if that table equals the
committed manifest's, and writes the record and the manifest.  Until then the replica is
pending (no manifest under ``.replicas/KEY``): a save that never commits leaves only an
orphan generation there, which the sweep removes like any other.

Everything a peer sends is hostile: each header is checked (kind, blob number, offset in
order, length at most the chunk size, record at most :data:`RECORD_LIMIT`) before anything
is allocated or written, and against the source's :class:`Part` of the save plan (its blob
numbers, and the bytes its items hold) before anything is written.  A holder that finds a
bad chunk drains the rest of that source's stream (so the sender never waits for a receive
that never comes), writes nothing more of it, removes the blobs it already wrote of it at
once (not at the next sweep) and reports it.

The traffic runs on a gloo group of its own (:func:`group_for`), apart from the checkpoint
group DCP's collectives use, made on the calling thread before the save starts.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import runtime
from ...format.checksum import crc32c
from ...protocol.placement import MAX_REPLICAS
from ...stores import Store
from ...stores import Writer as BlobWriter
from ...stores.bounded import RECORD_LIMIT
from ..layout import blob_name

__all__ = ["SLOTS", "Part", "Received", "Stream", "group_for"]

#: chunks a sender has in flight, and buffers a holder receives into (each ``chunk_size``)
SLOTS = 4
#: most blobs one source may announce in one save
MAX_BLOBS = 1 << 20

#: test-only fault hooks (never set them in production): the rank named in
#: ``FMSTORE_TEST_REPLICA_CORRUPT`` flips a byte of the first chunk it sends; the ranks of
#: the node named in ``FMSTORE_TEST_REPLICA_STALL=NODE:PATH`` write ``PATH-RANK`` once their
#: first chunk is sent, then never send again (a node stuck mid-transfer, to be killed)
CORRUPT_ENV = "FMSTORE_TEST_REPLICA_CORRUPT"
STALL_ENV = "FMSTORE_TEST_REPLICA_STALL"

_CHUNK, _BLOB_END, _RECORD, _END, _ABORT = 1, 2, 3, 4, 5

log = logging.getLogger("fmstore.checkpoint")
_lock = threading.Lock()
_groups: dict[int, Any] = {}


def group_for(pg: Any) -> Any:
    """A gloo group of ``pg``'s ranks for replica traffic, made once per group (a
    collective of the world on first use: every rank calls it, from the training thread)."""
    import torch.distributed as dist

    with _lock:
        if id(pg) not in _groups:
            ranks = dist.get_process_group_ranks(pg)
            _groups[id(pg)] = dist.new_group(ranks=ranks, backend="gloo")
        return _groups[id(pg)]


@dataclass(frozen=True)
class Part:
    """What the save plan lets one source send its holders: blob numbers ``first`` ..
    ``first + count - 1`` and at most ``most`` bytes in all (its items' bytes: an encoded
    chunk is never larger than its raw bytes).  ``most`` is None when the part holds
    non-tensor items, whose size no plan gives: its blob numbers still bound it."""

    first: int
    count: int
    most: int | None

    def refuses(self, blob: int, end: int) -> str:
        """Why a chunk of blob ``blob`` taking the part to ``end`` bytes is outside it."""
        if not self.first <= blob < self.first + self.count:
            last = self.first + self.count - 1
            return f"names blob {blob}, outside its planned blobs {self.first}..{last}"
        if self.most is not None and end > self.most:
            return f"takes its part to {end} bytes, more than the {self.most} its plan holds"
        return ""


@dataclass
class Received:
    """What one source sent a holder: each blob's size and its chunks' (offset, length,
    CRC32C) in order, the source's rank record, and why the stream failed ('' if not)."""

    blobs: dict[str, tuple[int, list[tuple[int, int, int]]]] = field(default_factory=dict)
    record: bytes | None = None
    error: str = ""


def _head(*xs: int) -> Any:
    import torch

    return torch.tensor(list(xs), dtype=torch.int64)


def _payload(data: Any) -> Any:
    import torch

    mv = memoryview(data).cast("B")
    if mv.readonly:  # encoded chunks are bytes; torch wants writable memory
        mv = memoryview(bytearray(mv))
    return torch.frombuffer(mv, dtype=torch.uint8)


class Stream:
    """One rank's replica traffic of one save: sends to ``holders``, receives from
    ``sources`` into ``store`` (``.replicas/KEY`` of the tier) under ``generation``."""

    def __init__(
        self,
        group: Any,
        rank: int,
        node: str,
        holders: Sequence[int],
        sources: Sequence[int],
        store: Store,
        generation: str,
        chunk_size: int,
        parts: Mapping[int, Part],
    ) -> None:
        self.group, self.rank, self.node = group, rank, node
        self.holders, self.sources = tuple(holders), tuple(sources)
        #: each source's planned part (a source the plan gives none may send nothing)
        self.parts = {s: parts.get(s, Part(0, 0, 0)) for s in self.sources}
        self.store, self.generation, self.chunk_size = store, generation, chunk_size
        self._gate = asyncio.Semaphore(SLOTS)
        self._loop = asyncio.get_running_loop()
        self._out: queue.Queue[tuple[Any, Any] | None] = queue.Queue()
        self.send_error = ""
        self._free: queue.Queue[Any] = queue.Queue()
        self._made = 0
        self._made_lock = threading.Lock()
        self.received: dict[int, Received] = {s: Received() for s in sources}
        #: when each phase of this rank's side ended (``time.perf_counter``): ``opened``,
        #: ``own_write`` (its blobs and record durable), ``sent`` (every send completed),
        #: ``committed`` (the commit and the manifest's copy done), ``received`` (every
        #: replica it holds durable), ``counted`` (records and manifest written)
        self.times: dict[str, float] = {"opened": time.perf_counter()}
        self._commits: dict[int, list[tuple[str, cf.Future[None]]]] = {s: [] for s in sources}
        self._discarded: set[int] = set()
        self._corrupt = os.environ.get(CORRUPT_ENV, "") == str(rank)
        stall = os.environ.get(STALL_ENV, "")
        self._stall = stall.partition(":")[2] if stall.partition(":")[0] == node else ""
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="replica-send")
        self._receivers = [
            threading.Thread(target=self._recv_loop, args=(s,), daemon=True, name="replica-recv")
            for s in self.sources
        ]
        self._sender.start()
        for t in self._receivers:
            t.start()

    # ---- sending ------------------------------------------------------------------------

    async def chunk(self, blob: int, offset: int, data: Any, crc: int) -> None:
        """Queue one chunk written at ``offset`` of blob number ``blob`` (``data`` stays
        untouched until it is sent: at most :data:`SLOTS` chunks wait)."""
        if self._corrupt:
            self._corrupt = False
            bad = bytearray(memoryview(data).cast("B"))
            bad[len(bad) // 2] ^= 0xFF
            data = bad
        await self._gate.acquire()
        self._out.put((_head(_CHUNK, blob, offset, len(memoryview(data).cast("B")), crc), data))

    async def blob_end(self, blob: int, size: int) -> None:
        await self._gate.acquire()
        self._out.put((_head(_BLOB_END, blob, size, 0, 0), None))

    async def record(self, data: bytes) -> None:
        await self._gate.acquire()
        self._out.put((_head(_RECORD, 0, 0, len(data), 0), data))

    def finish_sends(self, ok: bool) -> str:
        """End this rank's stream (``ok`` False: tell the holders its write failed) and wait
        until every send completed; why a send failed, or ''."""
        self.times["own_write"] = time.perf_counter()
        self._out.put((_head(_END if ok else _ABORT, 0, 0, 0, 0), None))
        self._out.put(None)
        self._sender.join()
        self.times["sent"] = time.perf_counter()
        return self.send_error

    def _release(self) -> None:
        self._loop.call_soon_threadsafe(self._gate.release)

    def _send_loop(self) -> None:
        import torch.distributed as dist

        inflight: collections.deque[list[Any]] = collections.deque()
        sent = 0
        while (item := self._out.get()) is not None:
            if self.send_error:
                self._release()
                continue
            head, data = item
            try:
                works = []
                for h in self.holders:
                    works.append(dist.isend(head, group=self.group, group_dst=h))
                    if data is not None and len(memoryview(data).cast("B")):
                        works.append(dist.isend(_payload(data), group=self.group, group_dst=h))
                inflight.append(works)
                if len(inflight) >= SLOTS:
                    for w in inflight.popleft():
                        w.wait()
                    self._release()
            except Exception as e:  # the peer is gone: the save fails at its collectives
                self.send_error = f"rank {self.rank} could not send its replica: {e}"[:300]
                self._release()
            sent += 1
            if self._stall and sent == 1:
                for w in [w for ws in inflight for w in ws]:
                    w.wait()
                Path(f"{self._stall}-{self.rank}").write_text("sent")
                threading.Event().wait()  # test-only: stuck until the node is killed
        while inflight:
            try:
                for w in inflight.popleft():
                    w.wait()
            except Exception as e:
                self.send_error = self.send_error or f"rank {self.rank}: {e}"[:300]
            self._release()

    # ---- receiving ----------------------------------------------------------------------

    def _slot(self) -> Any:
        import torch

        with self._made_lock:
            if self._free.empty() and self._made < SLOTS:
                self._made += 1
                return torch.empty(self.chunk_size, dtype=torch.uint8)
        return self._free.get()

    def _recv_loop(self, src: int) -> None:
        import torch
        import torch.distributed as dist

        got = self.received[src]
        part = self.parts[src]
        writers: dict[int, tuple[BlobWriter, cf.Future[None] | None]] = {}
        sizes: dict[int, int] = {}
        total = 0  # bytes of this source received, every blob together
        head = torch.zeros(5, dtype=torch.int64)
        try:
            while True:
                dist.recv(head, group=self.group, group_src=src)
                kind, blob, off, n, crc = (int(x) for x in head)
                if kind in (_END, _ABORT):
                    if kind == _ABORT:
                        got.error = got.error or f"rank {src}'s own write failed"
                    break
                if kind == _RECORD:
                    if not 0 <= n <= RECORD_LIMIT:
                        raise ValueError(f"a rank record of {n} bytes (at most {RECORD_LIMIT})")
                    buf = torch.empty(n, dtype=torch.uint8)
                    if n:
                        dist.recv(buf, group=self.group, group_src=src)
                    got.record = buf.numpy().tobytes()
                    continue
                if kind not in (_CHUNK, _BLOB_END) or not 0 <= blob < MAX_BLOBS:
                    raise ValueError(f"a header of kind {kind} for blob {blob}")
                if blob not in sizes and len(sizes) >= MAX_BLOBS:
                    raise ValueError(f"more than {MAX_BLOBS} blobs")
                pos = sizes.setdefault(blob, 0)
                if kind == _BLOB_END:
                    if off != pos:
                        raise ValueError(f"blob {blob_name(blob)} of {off} bytes, {pos} sent")
                    if why := part.refuses(blob, total):
                        got.error = (
                            got.error or f"rank {src} sent rank {self.rank} a blob that {why}"
                        )
                    self._end_blob(src, writers, blob, pos)
                    continue
                if off != pos or not 0 < n <= self.chunk_size:
                    raise ValueError(
                        f"a chunk of {n} bytes at offset {off} of blob {blob_name(blob)} "
                        f"(expected offset {pos}, at most {self.chunk_size} bytes)"
                    )
                # A well-framed chunk outside the plan is drained, like a bad one: never written.
                if why := part.refuses(blob, total + n):
                    got.error = got.error or f"rank {src} sent rank {self.rank} a chunk that {why}"
                buf = self._slot()
                dist.recv(buf[:n], group=self.group, group_src=src)
                sizes[blob] = pos + n
                total += n
                view = memoryview(buf[:n].numpy())
                if got.error or crc32c(view) != crc:
                    got.error = got.error or (
                        f"rank {self.rank}: the chunk at offset {off} of rank {src}'s blob "
                        f"{blob_name(blob)} fails its CRC32C on arrival"
                    )
                    self._free.put(buf)  # drained, never written
                    continue
                got.blobs.setdefault(blob_name(blob), (0, []))[1].append((off, n, crc))
                self._write(writers, blob, buf, view)
        except Exception as e:
            # A header that cannot be framed: nothing more of this source is read.
            got.error = got.error or f"rank {src} sent rank {self.rank}: {e}"[:300]
        finally:
            for w, prev in writers.values():
                runtime.run(_abort(w, prev))
            if got.error:
                self.discard(src)

    def _write(self, writers: dict[int, Any], blob: int, buf: Any, view: memoryview) -> None:
        if blob not in writers:
            key = f"{self.generation}/{blob_name(blob)}"
            writers[blob] = (runtime.run(self.store.open_writer(key)), None)
        w, prev = writers[blob]
        fut = runtime.submit(_append(w, prev, view))
        fut.add_done_callback(lambda _f: self._free.put(buf))
        writers[blob] = (w, fut)

    def _end_blob(self, src: int, writers: dict[int, Any], blob: int, size: int) -> None:
        got = self.received[src]
        name = blob_name(blob)
        if got.error:
            return
        w, prev = writers.pop(blob, (None, None))
        if w is None:
            w = runtime.run(self.store.open_writer(f"{self.generation}/{name}"))
        # durable in the background, while the next chunks arrive
        self._commits[src].append((name, runtime.submit(_commit(w, prev))))
        got.blobs[name] = (size, got.blobs.get(name, (0, []))[1])

    def discard(self, src: int) -> None:
        """Remove at once the blobs of ``src`` this holder wrote (its stream failed, or what it
        received is not its part of the commit): nothing of it waits for the sweep."""
        if src in self._discarded:
            return
        self._discarded.add(src)
        # a blob whose commit failed is not there (its writer's abort removed the temp file)
        names = [f"{self.generation}/{n}" for n, fut in self._commits[src] if _committed(fut)]
        try:
            runtime.run(self.store.delete_many(names))
        except Exception as e:  # left for the sweep, as before
            log.warning("could not remove rank %d's replica blobs: %s", src, e)

    def wait_received(self) -> dict[int, Received]:
        """Every source's stream, once it ended and its blobs are durable here (a failed
        source's removed)."""
        for t in self._receivers:
            t.join()
        for src, commits in self._commits.items():
            for name, fut in commits:
                try:
                    fut.result()
                except Exception as e:
                    got = self.received[src]
                    got.error = (
                        got.error
                        or (
                            f"rank {self.rank} could not write rank {src}'s blob {name}: "
                            f"{type(e).__name__}: {e}"
                        )[:300]
                    )
            if self.received[src].error:
                self.discard(src)
        while not self._free.empty():  # the pool goes with the save
            self._free.get_nowait()
        self.times["received"] = time.perf_counter()
        return self.received


def _committed(fut: cf.Future[None]) -> bool:
    try:
        fut.result()
    except Exception:
        return False
    return True


async def _append(w: BlobWriter, prev: cf.Future[None] | None, view: memoryview) -> None:
    if prev is not None:
        await asyncio.wrap_future(prev)
    await w.write(view)


async def _commit(w: BlobWriter, prev: cf.Future[None] | None) -> None:
    try:
        if prev is not None:
            await asyncio.wrap_future(prev)
    except BaseException:
        await w.abort()
        raise
    await w.commit()


async def _abort(w: BlobWriter, prev: cf.Future[None] | None) -> None:
    if prev is not None:
        await asyncio.gather(asyncio.wrap_future(prev), return_exceptions=True)
    await w.abort()


# ---- the Writer's side ------------------------------------------------------------------


def setting(writer: Any) -> tuple[int, str | None]:
    """The replicas ``writer``'s rank would stream (its tier's ``replicas``; 0 when it has
    no replica group: a save in DCP's checkpoint process, whose replicas are then sent
    after the commit, read back from the tier) and its node's failure domain ("?" where
    its config names an invalid one: no stream, and the commit's check says why)."""
    from ...errors import ConfigError
    from .replicas import _setting

    if writer.replica_group is None:
        return 0, None
    try:
        return _setting(writer.uri, writer.store_options.get("config"))
    except ConfigError:
        return 0, "?"


def agreed(infos: Sequence[Any], nodes: Sequence[str]) -> tuple[int, tuple[str | None, ...]]:
    """The replicas every rank streams and each rank's failure domain, from the local plans'
    ``infos`` of ranks on ``nodes``: the one ``replicas`` all ranks reported and domains
    every node's ranks agree on, else ``(0, ())`` (nothing streamed: the disagreement is
    raised after the commit, :func:`.replicas.replicate`).  Each info is a peer's: checked."""
    from .replicas import holders_of

    got = {getattr(i, "replicas", 0) for i in infos}
    k = got.pop() if len(got) == 1 else 0
    if type(k) is not int or not 0 < k <= MAX_REPLICAS:
        return 0, ()
    said = tuple(getattr(i, "domain", None) for i in infos)
    try:
        holders_of(nodes, k, said)
    except ValueError:
        return 0, ()
    return k, said  # type: ignore[return-value]  # each checked by holders_of


def parts_held(
    nodes: Sequence[str],
    k: int,
    domains: Sequence[str | None],
    parts: Sequence[tuple[int, int, int | None]],
) -> list[tuple[tuple[int, int, int, int | None], ...]]:
    """For each rank, the planned parts (``(rank, first blob, blobs, bytes)``, from each
    rank's ``parts``) of the ranks it holds a replica of when the save streams ``k``
    replicas over ``nodes``: at planning, by the coordinator, so each holder can refuse
    what its sources send outside their plan."""
    from .replicas import holders_of

    placement = holders_of(nodes, k, domains) if k and nodes else None
    held: list[list[tuple[int, int, int, int | None]]] = [[] for _ in parts]
    for src, hs in sorted((placement or {}).items()):  # one pass: ranks x k, not ranks^2
        for h in hs:
            held[h].append((src, *parts[src]))
    return [tuple(x) for x in held]


async def around(writer: Any, rp: Any, write: Any) -> Any:
    """Run ``write`` (the rank's own write of plan ``rp``) with its replica stream open
    (``writer.replica_stream``; None when this save streams none), then end the stream:
    every send done before the staged memory may be reused."""
    from ...stores import open_store
    from .replicas import holders_of, open_replicas, replica_uri, sources_of

    writer.replica_stream = None
    placement = holders_of(rp.nodes, rp.replicas, rp.domains) if rp.replicas and rp.nodes else None
    if placement is None or writer.replica_group is None:
        return await write
    so = writer.store_options
    where = replica_uri(writer.uri, so.get("config"))
    refused = ""
    try:
        store = open_replicas(where, so, create=bool(sources_of(placement, rp.rank)))
    except Exception as e:  # what is sent here is still received (drained, never written)
        refused = f"rank {rp.rank} cannot hold replicas: {type(e).__name__}: {e}"[:300]
        store = open_store(where, **so)
    stream = writer.replica_stream = Stream(
        writer.replica_group,
        rp.rank,
        rp.nodes[rp.rank],
        placement[rp.rank],
        sources_of(placement, rp.rank),
        store,
        rp.generation,
        writer.options.chunk_size,
        {s: Part(first, count, most) for s, first, count, most in rp.parts},
    )
    for got in stream.received.values():
        got.error = got.error or refused
    try:
        out = await write
    except BaseException:
        await runtime.to_io(stream.finish_sends, False)
        raise
    await runtime.to_io(stream.finish_sends, True)
    return out


async def send_blob(
    stream: Stream | None, blob: int, data: Any, spans: Sequence[tuple[int, int]], crcs: Any
) -> None:
    """A blob written from memory in one ``put``: its chunks to the holders, beside it."""
    if stream is None:
        return
    for (lo, hi), crc in zip(spans, crcs, strict=True):
        await stream.chunk(blob, lo, data[lo:hi], crc)
    await stream.blob_end(blob, len(data))
