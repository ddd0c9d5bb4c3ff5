"""``Writer``: fmstore as DCP's ``StorageWriter``, on every store.

Call order (from ``torch.distributed.checkpoint.save``; "all" means every rank):

0. (all) ``reset(checkpoint_id)`` when the caller passes a ``checkpoint_id``;
   ``storage_meta()``
1. (all) ``set_up_storage_writer(is_coordinator, rank=...)``
2. (all) ``prepare_local_plan(plan)``: adds the rank's node id and its items as planned
   before DCP's deduplication
3. (coordinator) ``prepare_global_plan(plans)``: picks a fresh *generation* (a sub-prefix
   for this save's blobs) and gives every rank its number and the world size; refuses to
   replace a committed checkpoint unless ``overwrite=True``.  On a node-local tier
   (``scope = "node"``) with ranks on several nodes, every value DCP deduplicated onto a
   rank of another node is also given to a rank of each node whose ranks hold it, so each
   node's part holds what its ranks need (see ``docs/distributed.md``)
4. (all) ``write_data(plan, planner)``: every item is cut into ``chunk_size`` chunks, each
   checksummed (and encoded, when compressing) in the CPU pool.  An item stored raw of at
   least ``direct_min`` bytes is a blob of its own, written with one ``put`` straight from
   the tensor's memory (on S3 a multipart upload whose parts are views of the tensor: the
   bytes are never copied); the other items are packed into up to ``streams`` blobs written
   as streams, with at most ``max_inflight`` bytes of encoded data held.  At most
   ``streams`` blobs of a rank are in flight at once.  On a node-local tier of several
   nodes the rank then writes its rank record (blob names and sizes) after its blobs are
   durable.  Returns one ``WriteResult`` per item, once every blob is committed
5. (coordinator) ``finish(metadata, results)``: DCP calls it only when every rank's
   ``write_data`` succeeded; it checks anyway that every rank answered for every item of its
   plan and that every blob is present with its size (one listing of the generation), and
   only then writes ``manifest.json`` (the commit).  A missing rank or blob raises and
   nothing is committed.  On a node-local tier of several nodes it can list only its own
   node's blobs; the other ranks' blobs are vouched for by their reports, sent after their
   blobs and rank records were fsynced; the manifest then lists one part per node, and
   :func:`fmstore.checkpoint.dcp.save` copies it to every node.

Guarantees: a checkpoint is visible only once complete; ``overwrite=True`` replaces a
committed one atomically (the old generation is deleted after the new manifest is in place);
the leftovers of a failed save (a generation no manifest names) are garbage for ``gc``.

A ``Writer`` pickles to its URI and options (DCP's process-based ``async_save`` sends it to
a checkpoint process); the store is reopened there.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ... import runtime
from ...errors import AlreadyExists, CorruptData, FmstoreError, NotFound, short_repr
from ...format.checksum import crc32c
from ...format.codecs import choose_codec, encode
from ...format.dtypes import dtype_name
from ...format.manifest import ChunkEntry
from ...limits import ByteBudget
from ...protocol.records import is_node_id, writer_node
from ...stores import PutOptions, Store, open_store, split_tier
from ..commit import commit_manifest, read_bounded_manifest
from ..layout import blob_name, new_generation
from . import plancache, replica_stream, staging
from .items import item_bytes, offset_of, part_bytes, split, tensor_bytes
from .manifest import MANIFEST_KEY, DcpBlob, DcpItem, DcpManifest, DcpPart
from .nodes import LocalInfo, RankRecord, local_copies, node_id, rank_record_key, tier_scope

__all__ = ["WriteOptions", "Writer"]

T = TypeVar("T")


@dataclass(frozen=True)
class WriteOptions:
    """How a :class:`Writer` lays out and sends bytes.

    ``compression``: ``"none"`` (default: DCP checkpoints are written at disk speed),
    ``"auto"``, ``"zstd"`` or ``"bytegroup+zstd"``, per chunk; chunks that do not shrink stay
    raw.  ``chunk_size``: bytes per checksummed chunk (also the granularity of partial reads
    on load).  ``streams``: blobs each rank writes concurrently.  ``direct_min``: items
    stored raw of at least this many bytes get a blob of their own, written from the
    tensor's memory with no copy (smaller ones are packed into shared blobs).
    ``max_inflight``: encoded bytes a rank holds at once.  ``overwrite``: replace a
    committed checkpoint at the URI.  ``allow_pickle``: store planner data JSON cannot
    represent as pickle.
    """

    compression: str = "none"
    chunk_size: int = 8 << 20
    streams: int = 4
    direct_min: int = 4 << 20
    max_inflight: int = 256 << 20
    overwrite: bool = False
    allow_pickle: bool = False

    def __post_init__(self) -> None:
        if self.chunk_size < 4096:
            raise ValueError("chunk_size must be at least 4096 bytes")
        if self.streams < 1:
            raise ValueError("streams must be at least 1")
        if self.max_inflight < self.chunk_size:
            raise ValueError("max_inflight must be at least chunk_size")
        choose_codec(self.compression, torch.float32)  # validates the name


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank in ``SavePlan.storage_data``."""

    generation: str
    rank: int
    world_size: int
    streams: int
    #: the rank's blobs are numbered ``blob_base`` .. ``blob_base + blob_count - 1`` (its
    #: item count plus ``streams``), so names are unique without the ranks talking
    blob_base: int = 0
    blob_count: int = 0
    #: each rank's node, when the tier is node-local and the ranks span several nodes
    nodes: tuple[str, ...] = ()
    save_id: str = ""
    #: replicas streamed while writing (:mod:`.replica_stream`), 0: none
    replicas: int = 0
    #: each rank's failure domain when it streams replicas (:func:`.replica_stream.agreed`)
    domains: tuple[str | None, ...] = ()
    #: the planned part of each rank this one holds a replica of: ``(rank, blob_base,
    #: blob_count, bytes or None)`` (:class:`.replica_stream.Part`)
    parts: tuple[tuple[int, int, int, int | None], ...] = ()


@dataclass(frozen=True)
class _ItemResult:
    """``WriteResult.storage_data``: an item's record and its blob's final size."""

    item: DcpItem
    blob: str
    blob_size: int
    rank: int


@dataclass
class _BlobOut:
    no: int
    name: str
    items: list[WriteItem] = field(default_factory=list)
    direct: bool = False
    size: int = 0


async def _all_or_cancel(aws: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Like ``gather``, but the first failure cancels (and awaits) the rest, then raises."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Writer(StorageWriter):
    """Writes a DCP checkpoint to ``uri`` (a path, ``file://``, ``s3://``, ``memory://``, a
    tier name) through an fmstore Store.

    ``Writer(uri, compression="auto")`` sets :class:`WriteOptions` fields by keyword;
    ``store_options`` go to :func:`fmstore.stores.open_store` (endpoint, credentials, ...).
    ``planner``: the save's planner, needed when it caches plans (``enable_plan_caching``,
    :mod:`.plancache`); :func:`fmstore.checkpoint.dcp.save` / ``async_save`` set it.
    """

    def __init__(
        self,
        uri: str | os.PathLike[str],
        options: WriteOptions | None = None,
        *,
        store_options: dict[str, Any] | None = None,
        planner: Any = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.planner = planner
        self.uri = os.fspath(uri)
        self.options = replace(options or WriteOptions(), **overrides)
        self.store_options = dict(store_options or {})
        self._store: Store | None = None
        self.is_coordinator = False
        self.rank = 0
        self.save_id = str(uuid.uuid4())
        self._plans: list[SavePlan] | None = None
        #: each rank's node as the ranks reported it (whatever the tier's scope), for the
        #: coordinator's hint when it misses another node's blobs
        self._rank_nodes: tuple[str, ...] = ()
        #: set by fmstore.checkpoint.dcp.save / async_save, which copy the committed
        #: manifest to every node; a bare Writer refuses a node-local tier of several nodes
        self.distributes = False
        #: replica traffic's group (set by fdcp.save / async_save) and this save's stream
        self.replica_group: Any = None
        self.replica_stream: replica_stream.Stream | None = None

    # ---- pickling (process-based async_save) ------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_store"] = d["replica_group"] = d["replica_stream"] = None
        return d

    # ---- StorageWriter ----------------------------------------------------------------

    @property
    def checkpoint_id(self) -> str:
        return self.uri

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self.uri, **self.store_options)
        return self._store

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.uri:
            self.uri = os.fspath(checkpoint_id)
            self._store = None
        self.save_id = str(uuid.uuid4())
        self._plans = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any URI :func:`~fmstore.stores.open_store` can open (nothing is contacted)."""
        try:
            from ...stores import split_tier

            split_tier(os.fspath(checkpoint_id))
        except (FmstoreError, TypeError):
            return False
        return bool(os.fspath(checkpoint_id))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.uri, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        if is_coordinator:
            plancache.watch(self.planner)
        if kwargs.get("use_collectives", True) is False:
            raise FmstoreError(
                "fmstore's DCP Writer needs use_collectives=True: the coordinator commits "
                "only after every rank's writes succeeded"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan, digest = plancache.local_plan(plan, self.planner)
        info = LocalInfo(node_id(), tuple(plan.items), *replica_stream.setting(self))
        return replace(plan, storage_data=replace(info, digest=digest))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The plans in force: plan caching leaves empty entries for the ranks it reuses.
        plans = plancache.in_force(plans, self.planner)
        if not self.options.overwrite and runtime.run(self.store.exists(MANIFEST_KEY)):
            raise AlreadyExists(
                "a checkpoint is already committed here; pass overwrite=True to replace it",
                tier=self.store.tier,
                key=MANIFEST_KEY,
            )
        generation = new_generation()
        streams = self.options.streams
        nodes = self._node_local(plans)
        k, doms = (
            replica_stream.agreed([p.storage_data for p in plans], nodes) if nodes else (0, ())
        )
        if nodes:
            plans = local_copies(plans, nodes)
        counts = [len(p.items) + streams for p in plans]
        bases = [0, *itertools.accumulate(counts)][:-1]
        held = replica_stream.parts_held(
            nodes, k, doms, [(b, c, part_bytes(p.items)) for b, c, p in zip(bases, counts, plans)]
        )
        out = []
        for i, p in enumerate(plans):
            rp = _RankPlan(
                generation, i, len(plans), streams, bases[i], counts[i], nodes, self.save_id, k,
                doms, held[i],
            )  # fmt: skip
            out.append(replace(p, storage_data=rp))
        self._plans = out
        return out

    def _node_local(self, plans: list[SavePlan]) -> tuple[str, ...]:
        """Each rank's node, when this save writes one part per node (a node-local tier,
        ranks on several nodes); ``()`` otherwise."""
        infos = [p.storage_data for p in plans]
        if not all(isinstance(i, LocalInfo) for i in infos):
            return ()
        nodes = tuple(i.node for i in infos)  # type: ignore[union-attr]
        if bad := next((n for n in nodes if not is_node_id(n)), None):
            raise CorruptData(f"a rank of this save reports {short_repr(bad)}, not a node id")
        self._rank_nodes = nodes
        if len(set(nodes)) < 2 or tier_scope(self.uri, self.store_options.get("config")) != "node":
            return ()
        where = f'{self.uri} is on a node-local tier (scope = "node") and this job spans nodes {", ".join(sorted(set(nodes))[:4])}'
        if not self.distributes:
            raise FmstoreError(
                f"{where}: a bare dcp.save(storage_writer=Writer(...)) would commit a manifest "
                "only the coordinator's node can read; save with "
                "fmstore.checkpoint.dcp.save(state, uri) or async_save(state, uri), which "
                "copy the committed manifest to every node",
                tier=self.store.tier,
                key=MANIFEST_KEY,
            )
        if self.options.overwrite:
            raise FmstoreError(
                f"{where}: overwrite=True is not supported there (a node's old part could "
                "outlive the new commit); save each step under its own prefix",
                tier=self.store.tier,
                key=MANIFEST_KEY,
            )
        return nodes

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rp = plan.storage_data
        if not isinstance(rp, _RankPlan):
            raise FmstoreError(
                "the save plan carries no fmstore storage data: was it made by another "
                "StorageWriter, or cached by the planner?"
            )
        if plancache.written(rp.generation):
            raise FmstoreError(
                "this save plan's generation was already written: a plan cached by the "
                "planner reached the Writer without this save's storage data"
            )
        plancache.note_written(rp.generation)
        fut: Future[list[WriteResult]] = Future()
        leases = staging.claim_leases(planner)
        try:
            write = self._write_rank(plan.items, planner, rp)
            results = runtime.run(replica_stream.around(self, rp, write))
        except BaseException as e:
            fut.set_exception(e)  # type: ignore[arg-type]
        else:
            fut.set_result(results)
        finally:
            # The rank's bytes are durable (or the save failed): staging buffers may be reused.
            staging.release_leases(leases)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        runtime.run(self._finish(metadata, results))

    # ---- the write pipeline ------------------------------------------------------------

    async def _write_rank(
        self, items: list[WriteItem], planner: SavePlanner, rp: _RankPlan
    ) -> list[WriteResult]:
        store = self.store
        budget = ByteBudget(self.options.max_inflight)
        gate = asyncio.Semaphore(rp.streams)
        direct = [wi for wi in items if self._is_direct(wi)]
        packed = [wi for wi in items if not self._is_direct(wi)]
        # Largest first, so the longest uploads start early.
        direct.sort(key=item_bytes, reverse=True)
        b0 = rp.blob_base
        blobs = [
            _BlobOut(b0 + i, blob_name(b0 + i), [wi], direct=True) for i, wi in enumerate(direct)
        ]
        n = len(blobs)
        blobs += [
            _BlobOut(b0 + n + i, blob_name(b0 + n + i), b)
            for i, b in enumerate(split(packed, rp.streams))
        ]

        async def one(b: _BlobOut) -> list[tuple[WriteItem, DcpItem]]:
            async with gate:
                if b.direct:
                    return await self._write_direct(store, rp, b, planner)
                return await self._write_blob(store, rp, b, planner, budget)

        if len(blobs) > rp.blob_count:
            raise FmstoreError(
                f"rank {rp.rank} has {len(items)} items to write, more than its plan held at "
                "global planning (was the plan changed after prepare_global_plan?)"
            )
        per_blob = await _all_or_cancel([one(b) for b in blobs])
        if rp.nodes:
            # The rank's part of its node: written (fsynced) after its blobs, before it
            # reports, so a part a report vouches for is on disk with its record.
            rec = RankRecord(
                rp.generation,
                rp.save_id,
                rp.rank,
                rp.nodes[rp.rank],
                tuple((b.name, b.size) for b in blobs),
                nodes=rp.nodes,
            )
            await store.put(
                rank_record_key(rp.generation, rp.rank), rec.dumps(), PutOptions(mode="create")
            )
            if self.replica_stream is not None:
                await self.replica_stream.record(rec.dumps())
        results: list[WriteResult] = []
        for b, recs in zip(blobs, per_blob, strict=True):
            for wi, item in recs:
                results.append(
                    WriteResult(
                        index=wi.index,
                        size_in_bytes=item.stored_bytes,
                        storage_data=_ItemResult(item, b.name, b.size, rp.rank),
                    )
                )
        return results

    def _is_direct(self, wi: WriteItem) -> bool:
        """Whether ``wi`` is written as a blob of its own, straight from its memory."""
        if wi.type == WriteItemType.BYTE_IO or wi.tensor_data is None:
            return False
        codec = choose_codec(self.options.compression, wi.tensor_data.properties.dtype)
        return codec == "raw" and item_bytes(wi) >= self.options.direct_min

    async def _write_direct(
        self, store: Store, rp: _RankPlan, blob: _BlobOut, planner: SavePlanner
    ) -> list[tuple[WriteItem, DcpItem]]:
        """One raw item, one ``put`` of its bytes as they lie in memory (no copy)."""
        wi = blob.items[0]
        data, kind, dt, shape = await runtime.to_cpu(self._resolve, planner, wi)
        n = len(data)
        size = self.options.chunk_size
        spans = [(o, min(o + size, n)) for o in range(0, n, size)]
        crcs = await runtime.to_cpu(lambda: [crc32c(data[lo:hi]) for lo, hi in spans])
        put = store.put(f"{rp.generation}/{blob.name}", data)
        rs = replica_stream.send_blob(self.replica_stream, blob.no, data, spans, crcs)
        await _all_or_cancel([put, rs])
        blob.size = n
        chunks = tuple(
            ChunkEntry(0, lo, hi - lo, lo, hi - lo, "raw", crc, 1)
            for (lo, hi), crc in zip(spans, crcs, strict=True)
        )
        return [(wi, DcpItem(wi.index.fqn, offset_of(wi), kind, dt, shape, n, chunks))]

    async def _write_blob(
        self,
        store: Store,
        rp: _RankPlan,
        blob: _BlobOut,
        planner: SavePlanner,
        budget: ByteBudget,
    ) -> list[tuple[WriteItem, DcpItem]]:
        """One blob: items in order, chunks encoded ahead (bounded), written in order."""
        opts = self.options
        key = f"{rp.generation}/{blob.name}"
        queue: asyncio.Queue[tuple[asyncio.Future[tuple[str, Any, int]], int, int] | None] = (
            asyncio.Queue()
        )
        records: list[tuple[WriteItem, DcpItem]] = []

        async def produce() -> None:
            try:
                for wi in blob.items:
                    data, kind, dt, shape = await runtime.to_cpu(self._resolve, planner, wi)
                    codec = "raw"
                    group = 1
                    if kind == "tensor":
                        tdt = wi.tensor_data.properties.dtype  # type: ignore[union-attr]
                        codec = choose_codec(opts.compression, tdt)
                        group = tdt.itemsize if codec == "bytegroup+zstd" else 1
                    elif opts.compression not in ("none", "raw"):
                        codec = "zstd"
                    n = len(data)
                    spans = [(o, min(o + opts.chunk_size, n)) for o in range(0, n, opts.chunk_size)]
                    recs: list[tuple[int, int, asyncio.Future[tuple[str, Any, int]]]] = []
                    for lo, hi in spans:
                        held = await budget.acquire(hi - lo)
                        task = asyncio.ensure_future(
                            runtime.to_cpu(_encode_chunk, codec, data[lo:hi], group)
                        )
                        recs.append((lo, hi, task))
                        await queue.put((task, hi - lo, held))
                    records.append(
                        (wi, DcpItem(wi.index.fqn, offset_of(wi), kind, dt, shape, n, ()))
                    )
                    pending_chunks.append(recs)
                await queue.put(None)
            except BaseException:
                await queue.put(None)
                raise

        pending_chunks: list[list[tuple[int, int, asyncio.Future[tuple[str, Any, int]]]]] = []
        writer = await store.open_writer(key)
        pos = 0
        try:
            producer = asyncio.ensure_future(produce())
            written: list[ChunkEntry] = []
            while True:
                entry = await queue.get()
                if entry is None:
                    break
                task, n, held = entry
                codec, stored, crc = await task
                await writer.write(stored)
                if self.replica_stream is not None:
                    await self.replica_stream.chunk(blob.no, pos, stored, crc)
                written.append(ChunkEntry(0, pos, len(stored), 0, n, codec, crc, 1))
                pos += len(stored)
                await budget.release(held)
            await producer  # re-raises a resolve/encode failure
            await writer.commit()
        except BaseException:
            await writer.abort()
            raise
        blob.size = pos
        if self.replica_stream is not None:
            await self.replica_stream.blob_end(blob.no, pos)
        # Attach chunk entries (in write order) to their items.
        out: list[tuple[WriteItem, DcpItem]] = []
        k = 0
        for (wi, it), recs in zip(records, pending_chunks, strict=True):
            chunks = []
            for lo, hi, task in recs:
                w = written[k]
                k += 1
                codec, _stored, _crc = task.result()
                group = 1
                if codec == "bytegroup+zstd":
                    group = wi.tensor_data.properties.dtype.itemsize  # type: ignore[union-attr]
                chunks.append(
                    ChunkEntry(0, w.offset, w.length, lo, hi - lo, w.codec, w.crc32c, group)
                )
            out.append((wi, replace(it, chunks=tuple(chunks))))
        return out

    @staticmethod
    def _resolve(
        planner: SavePlanner, wi: WriteItem
    ) -> tuple[memoryview, str, str, tuple[int, ...]]:
        data = planner.resolve_data(wi)
        if wi.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"{wi.index.fqn}: planner gave {type(data).__name__} for BYTE_IO")
            return memoryview(data.getbuffer()).cast("B"), "bytes", "", ()
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"{wi.index.fqn}: planner gave {type(data).__name__} for a tensor")
        td = wi.tensor_data
        assert td is not None
        name = dtype_name(td.properties.dtype)
        if name is None:
            raise TypeError(f"{wi.index.fqn}: dtype {td.properties.dtype} is unknown to fmstore")
        if data.dtype != td.properties.dtype or tuple(data.shape) != tuple(td.chunk.sizes):
            raise ValueError(
                f"{wi.index.fqn}: planner resolved a {data.dtype} {tuple(data.shape)} tensor for "
                f"a {td.properties.dtype} {tuple(td.chunk.sizes)} write item"
            )
        return tensor_bytes(data), "tensor", name, tuple(int(s) for s in td.chunk.sizes)

    # ---- the commit -------------------------------------------------------------------

    async def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self.store
        plans = self._plans
        if plans is None:
            raise FmstoreError("finish() called on a Writer that did not plan this save")
        rp0 = plans[0].storage_data
        assert isinstance(rp0, _RankPlan)
        if len(results) != len(plans):
            raise FmstoreError(
                f"{len(results)} of {len(plans)} ranks reported their writes; not committing",
                tier=store.tier,
                key=MANIFEST_KEY,
            )
        items: list[DcpItem] = []
        blobs: list[DcpBlob] = []
        blob_ids: dict[str, int] = {}
        for rank, (plan, res) in enumerate(zip(plans, results, strict=True)):
            want = {wi.index for wi in plan.items}
            got: set[Any] = set()
            for wr in res:
                sd = wr.storage_data
                if not isinstance(sd, _ItemResult) or sd.rank != rank:
                    raise FmstoreError(
                        f"rank {rank} reported a write result fmstore did not make; not committing",
                        tier=store.tier,
                        key=MANIFEST_KEY,
                    )
                got.add(wr.index)
                if sd.blob not in blob_ids:
                    blob_ids[sd.blob] = len(blobs)
                    blobs.append(DcpBlob(sd.blob, sd.blob_size, rank))
                items.append(sd.item.with_blob(blob_ids[sd.blob]))
            if got != want:
                missing = sorted(i.fqn for i in want - got)
                raise FmstoreError(
                    f"rank {rank} did not write {len(want - got)} item(s) of its plan "
                    f"(e.g. {missing[:3]}); not committing",
                    tier=store.tier,
                    key=MANIFEST_KEY,
                )
        gen = rp0.generation
        nodes = rp0.nodes
        parts = [
            DcpPart(node, tuple(r for r, n in enumerate(nodes) if n == node))
            for node in dict.fromkeys(nodes)
        ]

        # One listing of the generation instead of a HEAD per blob (ranks x streams of them).
        # On a node-local tier this node sees its own part only: the other ranks' blobs
        # are vouched for by their reports, sent once their blobs and records were durable.
        have = {m.key: m.size async for m in store.list(f"{gen}/") if not m.is_dir}
        for b in blobs:
            if nodes and nodes[b.rank] != nodes[0]:
                continue
            key = f"{gen}/{b.name}"
            size = have.get(key)
            if size is None:
                raise NotFound(
                    f"rank {b.rank}'s blob is missing; not committing{self._scope_hint(b.rank)}",
                    tier=store.tier,
                    key=key,
                )
            if size != b.size:
                raise CorruptData(
                    f"rank {b.rank}'s blob has {size} bytes, expected {b.size}; not committing",
                    tier=store.tier,
                    key=key,
                )
        # A copy: with plan caching, ``metadata`` is the planner's cached object.
        metadata = replace(metadata, storage_meta=self.storage_meta())
        manifest = DcpManifest.from_metadata(
            metadata,
            generation=gen,
            world_size=len(plans),
            items=items,
            blobs=blobs,
            allow_pickle=self.options.allow_pickle,
            writer=f"fmstore (torch {torch.__version__}){writer_node()}",
            parts=parts,
        )
        manifest.validate(MANIFEST_KEY)
        old_gen = await self._old_generation(store) if self.options.overwrite else None
        # create unless the caller asked to overwrite: a save never replaces another by accident
        await commit_manifest(
            store, manifest.dumps(), "replace" if self.options.overwrite else "create"
        )
        if old_gen and old_gen != gen:
            # Readers that opened the old manifest may still be reading; they see NotFound
            # after this, never mixed bytes.
            keys = await store.list_keys(f"{old_gen}/")
            await store.delete_many(keys)

    def _scope_hint(self, rank: int) -> str:
        """Why a blob of ``rank`` may be missing here, when that rank ran on another node
        than the coordinator: differing nodes on a shared tier are Lustre's normal case,
        so this is only said once a blob is missed, and never refuses a save."""
        nodes = self._rank_nodes
        if not nodes or rank >= len(nodes) or nodes[rank] == nodes[0]:
            return ""
        name = split_tier(self.uri)[0]
        where = f"[tiers.{name}]" if name else "the tier"
        return (
            f" (rank {rank} ran on node {nodes[rank]}, the coordinator on {nodes[0]}: if this "
            f'tier is node-local storage, set scope = "node" in {where})'
        )

    @staticmethod
    async def _old_generation(store: Store) -> str | None:
        """The generation the committed manifest (of either format) names, if any."""
        from ..gc import _generation_of

        try:
            data = await read_bounded_manifest(store)
        except NotFound:
            return None
        try:
            return _generation_of(data)
        except FmstoreError:
            return None


def _encode_chunk(codec: str, data: memoryview, group: int) -> tuple[str, Any, int]:
    used, stored = encode(codec, data, group)
    return used, stored, crc32c(stored)
