"""``Reader``: fmstore as DCP's ``StorageReader``, on every store.

Call order (from ``torch.distributed.checkpoint.load``):

0. (all) ``reset(checkpoint_id)`` when the caller passes one
1. (all) ``read_metadata()``: ``manifest.json`` -> DCP ``Metadata``
2. (all) ``set_up_storage_reader(metadata, is_coordinator)``
3. (all) ``prepare_local_plan`` / (coordinator) ``prepare_global_plan``: unchanged plans
4. (all) ``read_data(plan, planner)``

``read_data`` fetches only the chunks that hold the bytes the rank's plan asks for (a
resharded load reads a slice of each saved shard), merges neighbouring chunks of one blob
into one ranged request (``coalesce`` bytes of gap at most, ``max_request`` bytes per
request), runs the requests concurrently with at most ``max_inflight`` bytes held, checks
every chunk's CRC32C, and decodes straight into the destination tensor where its bytes are
one contiguous run of it (large raw chunks are read into it with no copy at all: on object
stores one request per chunk, all in parallel; on local files one sequential read per run of
neighbouring chunks, which the kernel's readahead streams).  A chunk
that fails its checksum raises :class:`~fmstore.errors.CorruptData` naming the tensor, the
blob and the store.
"""

from __future__ import annotations

import asyncio
import io
import math
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ... import runtime
from ...errors import CorruptData, FmstoreError, NotFound
from ...format.checksum import crc32c
from ...format.codecs import decode_into
from ...format.dtypes import dtype_from_name
from ...format.manifest import ChunkEntry
from ...limits import ByteBudget
from ...protocol.routing import PART
from ...stores import Location, Store, open_store
from ..commit import read_bounded_manifest
from ..devring import RingLoad, cpu_routed, open_ring, run_all
from ..zipguard import check_torch_zip, load_refusal
from .manifest import MANIFEST_KEY, DcpItem, DcpManifest
from .native import NativeCheckpoint, NativeItem, has_native_metadata, read_native, read_native_data
from .peers import Part as _Part
from .peers import Peers, read_routed
from .readruns import coalesce, direct_runs, has_local_files

__all__ = ["ReadOptions", "Reader", "read_manifest"]


@dataclass(frozen=True)
class ReadOptions:
    """``coalesce``: merge chunks of one blob separated by at most this many bytes into one
    request; ``max_request``: bytes per merged request; ``max_inflight``: fetched bytes held
    at once; ``direct_min``: raw chunks at least this large are read straight into the
    destination tensor, on stores without local files only those of at least
    ``object_direct_min`` too (each is a request of its own there: smaller ones are merged
    into ranged requests, which keeps a restore's GETs within an S3 prefix's rate,
    ``docs/scale.md``); ``verify``: check CRC32C of every chunk (default on);
    ``allow_pickle``: accept planner data stored as pickle, and hand ``BYTE_IO`` values to
    the planner as saved (torch's planners unpickle them with ``weights_only=False``: code
    in them runs); off, they are decoded with ``weights_only=True`` first."""

    coalesce: int = 1 << 20
    max_request: int = 64 << 20
    max_inflight: int = 512 << 20
    direct_min: int = 1 << 20
    object_direct_min: int = 2 << 20
    verify: bool = True
    allow_pickle: bool = False


async def read_manifest(store: Store) -> DcpManifest:
    """The committed manifest of the DCP checkpoint in ``store``."""
    try:
        data = await read_bounded_manifest(store)
    except NotFound:
        raise NotFound(
            "no committed checkpoint here (manifest.json is missing)",
            tier=store.tier,
            key=MANIFEST_KEY,
        ) from None
    return DcpManifest.loads(data, where=f"{store.url}/{MANIFEST_KEY}")


@dataclass
class _Target:
    """One read item: where its bytes go."""

    req: ReadItem
    item: DcpItem
    lo: int  # first raw byte of the item this read needs
    hi: int  # one past the last
    dest: torch.Tensor | None  # the destination tensor (None for BYTE_IO)
    direct: memoryview | None  # dest's bytes when they equal the item's [lo, hi)
    buf: bytearray | None = None  # staging for [lo, hi) otherwise
    #: dest's bytes on its device when they equal [lo, hi): filled through a ring
    dev: torch.Tensor | None = None
    #: a box that is not one run of its device destination, contiguous on the device
    box: torch.Tensor | None = None
    #: read from another node or this node's replicas (:mod:`.peers`), not this part
    routed: bool = False


class Reader(StorageReader):
    """Reads a DCP checkpoint written by :class:`~fmstore.checkpoint.dcp.Writer` at ``uri``.

    ``Reader(uri, allow_pickle=True)`` (any :class:`ReadOptions` field by keyword) is the
    opt-in for checkpoints you trust that hold non-tensor values other than plain ones.
    """

    def __init__(
        self,
        uri: str | os.PathLike[str],
        options: ReadOptions | None = None,
        *,
        store_options: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.uri = os.fspath(uri)
        self.options = replace(options or ReadOptions(), **overrides)
        self.store_options = dict(store_options or {})
        self._store: Store | None = None
        self.manifest: DcpManifest | None = None
        self.native: NativeCheckpoint | None = None  # a checkpoint of torch's FileSystemWriter
        self.storage_data: dict[Any, Any] = {}
        self.load_id = str(uuid.uuid4())
        self.is_coordinator = False
        #: ranks whose blobs this node holds (a checkpoint in parts), None: all of them
        self.local_ranks: set[int] | None = None
        #: set by the collective restore when some blobs are read from other nodes (or
        #: this node's replicas): the routes, see :mod:`.peers`
        self.peers: Peers | None = None
        #: set by the collective restore: the manifest its check read and parsed (the same
        #: bytes on every rank), so this rank does not read and parse it a second time
        self.checked: DcpManifest | None = None

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_store"] = None
        d["peers"] = None  # the process group stays in this process
        return d

    @property
    def checkpoint_id(self) -> str:
        return self.uri

    @property
    def store(self) -> Store:
        if self._store is None:
            loc = Location.parse(self.uri, self.store_options.get("config"))
            if loc.local_root is not None and not os.path.isdir(loc.local_root):
                # Opening a POSIX store creates its directory; a load must not leave one.
                raise NotFound(
                    f"no checkpoint at {loc.described()}: no such directory", key=MANIFEST_KEY
                )
            self._store = open_store(self.uri, **self.store_options)
        return self._store

    # ---- StorageReader ----------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.uri:
            self.uri = os.fspath(checkpoint_id)
            self._store = None
            self.checked = None
        self.manifest = None
        self.native = None
        self.storage_data = {}
        self.load_id = str(uuid.uuid4())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        from .writer import Writer

        return Writer.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise NotFound("fmstore DCP checkpoints have no rank-local metadata", key=MANIFEST_KEY)
        try:
            if self.peers is not None:
                self.manifest = self.peers.manifest
            elif self.checked is not None:
                self.manifest = self.checked
            else:
                self.manifest = runtime.run(read_manifest(self.store))
        except NotFound:
            self.native = runtime.run(self._read_native())
            if self.native is None:
                raise
            md = self.native.to_metadata()
        else:
            md = self.manifest.to_metadata(
                allow_pickle=self.options.allow_pickle, ranks=self._part_ranks(self.manifest)
            )
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.is_coordinator = is_coordinator
        sd = metadata.storage_data
        if isinstance(sd, dict) and sd and all(isinstance(v, NativeItem) for v in sd.values()):
            self.storage_data = sd
            if self.native is None:
                self.native = runtime.run(self._read_native())
            return
        if not isinstance(sd, dict) or not all(isinstance(v, DcpItem) for v in sd.values()):
            raise FmstoreError("metadata was not read by fmstore's Reader")
        self.storage_data = sd
        if self.manifest is None:
            # Metadata read elsewhere (another Reader instance): load the blob table too.
            self.manifest = runtime.run(read_manifest(self.store))
            self._part_ranks(self.manifest)

    def _part_ranks(self, m: DcpManifest) -> set[int] | None:
        """On a node-local tier, the ranks whose part is on this node (the only blobs this
        node can read); None for a checkpoint in one part or on a shared tier."""
        from .nodes import node_id, tier_scope

        if not m.parts or tier_scope(self.uri, self.store_options.get("config")) != "node":
            # In one part, or every part on a shared tier (a copy of the whole checkpoint).
            self.local_ranks = None
            return None

        if self.peers is not None:
            # Routed: the saved ranks whose blobs this rank reads on its own node (its
            # part, its replicas) are preferred where DCP's plan has a choice of copies.
            self.local_ranks = self.peers.routes.local(self.peers.rank)
            return self.local_ranks
        part = m.part_of(node_id())
        if part is None:
            raise NotFound(
                f"this node ({node_id()}) holds no part of the checkpoint at {self.uri}: it "
                f"was saved by nodes {', '.join(p.node for p in m.parts)}",
                tier=self.store.tier,
                key=MANIFEST_KEY,
            )
        self.local_ranks = set(part.ranks)
        return self.local_ranks

    async def _read_native(self) -> NativeCheckpoint | None:
        """The native (torch ``FileSystemWriter``) checkpoint here, or None without one."""
        if not await has_native_metadata(self.store):
            return None
        return await read_native(self.store, allow_pickle=self.options.allow_pickle)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()
        if self.native is not None:
            try:
                read_native_data(
                    self.store,
                    plan,
                    planner,
                    self.storage_data,
                    lambda it, data: self._byte_io(it.fqn, data),
                    verify=self.options.verify,
                )
            except BaseException as e:
                fut.set_exception(e)  # type: ignore[arg-type]
            else:
                fut.set_result(None)
            return fut
        try:
            if self.peers is not None:  # some blobs on other nodes: a collective
                targets = read_routed(self, lambda: [self._target(r, planner) for r in plan.items])
            else:
                targets = [self._target(req, planner) for req in plan.items]
                runtime.run(self._read(targets))
            for t in targets:
                if t.dest is None:
                    assert t.buf is not None
                    planner.load_bytes(t.req, self._byte_io(t.item.fqn, bytes(t.buf)))
                else:
                    if t.box is not None:
                        t.dest.copy_(t.box)
                    elif t.direct is None and t.dev is None and t.dest.device.type == "cpu":
                        _copy_box(t)
                    elif t.routed and t.direct is None:
                        _copy_box(t)  # staged on the host, into its device
                    planner.commit_tensor(t.req, t.dest)
        except BaseException as e:
            fut.set_exception(e)  # type: ignore[arg-type]
        else:
            fut.set_result(None)
        return fut

    def _byte_io(self, fqn: str, data: bytes) -> io.BytesIO:
        """A ``BYTE_IO`` value for the planner.  torch's planners ``torch.load`` it with
        ``weights_only=False``, which runs whatever the pickle says: unless the caller passed
        ``allow_pickle=True``, the value is decoded here with ``weights_only=True`` (plain
        containers, numbers, strings, tensors) and handed on re-serialized, so the planner
        only ever unpickles bytes fmstore wrote from a safe object.  Either way its zip
        members are checked first (:func:`~fmstore.checkpoint.zipguard.check_torch_zip`:
        torch inflates a compressed member whole before any size is checked)."""
        st = self._store  # None: every item came from other nodes, none opened here
        where = self.uri if st is None else st.url
        tier = None if st is None else st.tier
        check_torch_zip(data, name=f"{fqn[:200]!r} in {where}", tier=tier, key=MANIFEST_KEY)
        if self.options.allow_pickle:
            return io.BytesIO(data)
        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            why = load_refusal(e)
            raise CorruptData(
                f"{fqn!r} in {where} is not a plain value (tensors, numbers, "
                f"strings, containers) and fmstore does not unpickle it: {why}; pass "
                "allow_pickle=True to the Reader if you trust this checkpoint",
                tier=tier,
                key=MANIFEST_KEY,
            ) from None
        out = io.BytesIO()
        torch.save(obj, out)
        out.seek(0)
        return out

    # ---- planning a read ----------------------------------------------------------------

    def _target(self, req: ReadItem, planner: LoadPlanner) -> _Target:
        item = self.storage_data.get(req.storage_index)
        if item is None:
            raise CorruptData(
                f"checkpoint has no data for {req.storage_index.fqn!r} "
                f"(offset {tuple(req.storage_index.offset or ())})",
                tier=self.store.tier,
                key=MANIFEST_KEY,
            )
        routed = False
        if self.local_ranks is not None and item.chunks:
            assert self.manifest is not None
            rank = self.manifest.blobs[item.chunks[0].blob].rank
            if self.peers is not None:
                routed = self.peers.source(rank) != (self.peers.rank, PART)
            elif rank not in self.local_ranks:
                raise NotFound(
                    f"{item.fqn!r} (offset {list(item.offset or ())}) is in the part of node "
                    f"{self.manifest.node_of_rank(rank)} (rank {rank}), not on this node: the "
                    "job's ranks or nodes changed since the save; restore from a shared tier",
                    tier=self.store.tier,
                    key=MANIFEST_KEY,
                )
        if req.type == LoadItemType.BYTE_IO:
            return _Target(
                req, item, 0, item.nbytes, None, None, bytearray(item.nbytes), routed=routed
            )
        dtype = dtype_from_name(item.dtype)
        dest = planner.resolve_tensor(req).detach()
        if tuple(dest.shape) != tuple(req.lengths):
            raise FmstoreError(
                f"{item.fqn}: destination has shape {tuple(dest.shape)}, plan asks {tuple(req.lengths)}"
            )
        if len(req.storage_offsets) != len(item.shape) or len(req.lengths) != len(item.shape):
            raise CorruptData(
                f"{item.fqn!r}: the plan's box has {len(req.lengths)} dimensions, the saved "
                f"item {len(item.shape)}",
                tier=self.store.tier,
                key=MANIFEST_KEY,
            )
        lo, hi, contiguous = _box_span(item.shape, req.storage_offsets, req.lengths, dtype.itemsize)
        if any(o < 0 or o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, item.shape)):
            raise CorruptData(
                f"{item.fqn!r}: the plan reads box offsets {list(req.storage_offsets)} sizes "
                f"{list(req.lengths)} outside the saved shape {list(item.shape)}",
                tier=self.store.tier,
                key=MANIFEST_KEY,
            )
        direct = None
        plain = contiguous and dest.dtype == dtype and dest.is_contiguous() and dest.numel() > 0
        ringed = dest.device.type != "cpu" or cpu_routed()
        if routed:
            # From another node or store: into host memory, then into the destination.
            plain = plain and not ringed
            ringed = False
        if plain and not ringed:
            arr: Any = dest.reshape(-1).view(torch.uint8).numpy()
            direct = memoryview(arr)
        t = _Target(req, item, lo, hi, dest, direct, routed=routed)
        if plain and ringed:
            t.dev = dest.reshape(-1).view(torch.uint8)
        elif direct is None:
            t.buf = bytearray(hi - lo)
        return t

    # ---- fetching ----------------------------------------------------------------------

    async def _read(self, targets: list[_Target]) -> None:
        assert self.manifest is not None
        manifest = self.manifest
        opts = self.options
        store = self.store
        # Which chunks each target needs, and which part of each chunk it takes.
        needs: dict[tuple[int, int], list[_Part]] = {}
        chunk_of: dict[tuple[int, int], tuple[ChunkEntry, DcpItem]] = {}
        direct_jobs: list[tuple[_Target, ChunkEntry]] = []
        ring_jobs: list[tuple[_Target, ChunkEntry]] = []
        rings: dict[str, RingLoad] = {}
        local = has_local_files(store, manifest)
        # On an object store a chunk read on its own is a GET of its own: below
        # object_direct_min, chunks go through the merged, ranged requests instead.
        dmin = opts.direct_min if local else max(opts.direct_min, opts.object_direct_min)
        for t in targets:
            dest = t.dest
            on_ring = dest is not None and (dest.device.type != "cpu" or t.dev is not None)
            if on_ring and dest is not None and str(dest.device) not in rings:
                rings[str(dest.device)] = open_ring(dest.device)
        for ti, t in enumerate(targets):
            for c in t.item.chunks:
                a, b = max(t.lo, c.raw_offset), min(t.hi, c.raw_offset + c.raw)
                if a >= b:
                    continue
                whole = a == c.raw_offset and b == c.raw_offset + c.raw
                if t.direct is not None and c.codec == "raw" and whole and c.raw >= dmin:
                    direct_jobs.append((t, c))
                    continue
                if t.dev is not None and c.codec == "raw" and whole and (local or c.raw >= dmin):
                    ring_jobs.append((t, c))
                    continue
                key = (c.blob, c.offset)
                needs.setdefault(key, []).append(_Part(ti, a, b))
                chunk_of[key] = (c, t.item)
        budget = ByteBudget(opts.max_inflight)
        sem = asyncio.Semaphore(64)

        async def direct(t: _Target, run: list[ChunkEntry]) -> None:
            """Raw chunks, back to back in one blob and in ``t``'s memory: one read."""
            assert t.direct is not None
            first, last = run[0], run[-1]
            out = t.direct[first.raw_offset - t.lo : last.raw_offset - t.lo + last.raw]
            key = manifest.blob_key(first.blob)
            async with sem:
                await store.get_into(key, first.offset, out)
            if opts.verify:
                views = [t.direct[c.raw_offset - t.lo : c.raw_offset - t.lo + c.raw] for c in run]
                got = await runtime.to_cpu(lambda: [crc32c(v) for v in views])
                for c, crc in zip(run, got, strict=True):
                    if crc != c.crc32c:
                        raise self._corrupt(t.item, c, key)

        async def ringed(t: _Target, c: ChunkEntry) -> None:
            """A raw chunk onto its device through the ring, a slot at a time."""
            assert t.dev is not None and t.dest is not None
            ring = rings[str(t.dest.device)]
            key = manifest.blob_key(c.blob)
            crc = 0
            async with sem:
                for pos in range(0, c.raw, ring.slot_bytes):
                    n = min(ring.slot_bytes, c.raw - pos)
                    i = await ring.slot()
                    try:
                        piece = ring.view(i, n)
                        await store.get_into(key, c.offset + pos, piece)
                        if opts.verify:
                            crc = await runtime.to_cpu(crc32c, piece, crc)
                    except BaseException:
                        ring.give_back(i)
                        raise
                    out = c.raw_offset - t.lo + pos
                    await ring.submit(i, n, t.dev[out : out + n])
            if opts.verify and crc != c.crc32c:
                raise self._corrupt(t.item, c, key)

        async def fetch(group: list[tuple[int, int]]) -> None:
            chunks = [chunk_of[k] for k in group]
            blob = group[0][0]
            start = chunks[0][0].offset
            end = chunks[-1][0].offset + chunks[-1][0].length
            key = manifest.blob_key(blob)
            held = await budget.acquire(end - start)
            try:
                async with sem:
                    data = memoryview(await store.get_range(key, start, end))
                jobs = []
                for k, (c, item) in zip(group, chunks, strict=True):
                    stored = data[c.offset - start : c.offset - start + c.length]
                    if any(targets[p.target].dev is not None for p in needs[k]):
                        jobs.append(
                            self._deliver_ringed(targets, needs[k], c, item, stored, key, rings)
                        )
                    else:
                        jobs.append(
                            runtime.to_cpu(self._deliver, targets, needs[k], c, item, stored, key)
                        )
                await asyncio.gather(*jobs)
            finally:
                await budget.release(held)

        groups = coalesce(sorted(chunk_of), chunk_of, opts.coalesce, opts.max_request)
        # On local files a run of chunks is read sequentially in one call, so the kernel's
        # readahead streams it (measured ~1.6x faster cold than a concurrent read per chunk);
        # on object stores every chunk is its own request, all in parallel.
        gap = opts.max_request if local else 0
        runs = direct_runs(direct_jobs, gap)
        try:
            await run_all(
                [direct(t, r) for t, r in runs]
                + [fetch(g) for g in groups]
                + [ringed(t, c) for t, c in ring_jobs]
            )
            # Boxes that are not one run of their destination: assembled on the host, sent
            # through the ring into a contiguous copy on the device, then copied into place.
            for t in targets:
                if t.dest is not None and t.dev is None and t.dest.device.type != "cpu":
                    await self._box_to_device(t, rings[str(t.dest.device)])
        except BaseException:
            for ring in rings.values():
                await ring.abort()
            raise
        for ring in rings.values():
            await ring.finish()

    def _deliver(
        self,
        targets: list[_Target],
        parts: list[_Part],
        c: ChunkEntry,
        item: DcpItem,
        stored: memoryview,
        key: str,
    ) -> None:
        """Check and decode one chunk into every target that needs part of it (CPU pool)."""
        if self.options.verify and crc32c(stored) != c.crc32c:
            raise self._corrupt(item, c, key)
        # Decode straight into the destination when one target takes the whole chunk.
        if len(parts) == 1 and parts[0].a == c.raw_offset and parts[0].b == c.raw_offset + c.raw:
            t = targets[parts[0].target]
            out = _out_view(t, c.raw_offset, c.raw_offset + c.raw)
            try:
                decode_into(c.codec, stored, out, c.group)
            except CorruptData as e:
                raise self._corrupt(item, c, key, str(e)) from None
            return
        raw = memoryview(bytearray(c.raw))
        try:
            decode_into(c.codec, stored, raw, c.group)
        except CorruptData as e:
            raise self._corrupt(item, c, key, str(e)) from None
        for p in parts:
            t = targets[p.target]
            _out_view(t, p.a, p.b)[:] = raw[p.a - c.raw_offset : p.b - c.raw_offset]

    async def _deliver_ringed(
        self,
        targets: list[_Target],
        parts: list[_Part],
        c: ChunkEntry,
        item: DcpItem,
        stored: memoryview,
        key: str,
        rings: dict[str, RingLoad],
    ) -> None:
        """:meth:`_deliver` where a target is on a device: decoded on the CPU pool into a
        slot (when one target takes the whole chunk and it fits) or a temporary, and on."""
        if self.options.verify and await runtime.to_cpu(crc32c, stored) != c.crc32c:
            raise self._corrupt(item, c, key)
        t0 = targets[parts[0].target]
        if (
            len(parts) == 1
            and t0.dev is not None
            and (parts[0].a, parts[0].b) == (c.raw_offset, c.raw_offset + c.raw)
            and c.raw <= rings[str(t0.dest.device)].slot_bytes  # type: ignore[union-attr]
        ):
            ring = rings[str(t0.dest.device)]  # type: ignore[union-attr]
            i = await ring.slot()
            try:
                await runtime.to_cpu(decode_into, c.codec, stored, ring.view(i, c.raw), c.group)
            except BaseException as e:
                ring.give_back(i)
                if isinstance(e, CorruptData):
                    raise self._corrupt(item, c, key, str(e)) from None
                raise
            await ring.submit(i, c.raw, t0.dev[c.raw_offset - t0.lo : c.raw_offset - t0.lo + c.raw])
            return
        raw = memoryview(bytearray(c.raw))
        try:
            await runtime.to_cpu(decode_into, c.codec, stored, raw, c.group)
        except CorruptData as e:
            raise self._corrupt(item, c, key, str(e)) from None
        for p in parts:
            t = targets[p.target]
            piece = raw[p.a - c.raw_offset : p.b - c.raw_offset]
            if t.dev is not None:
                ring = rings[str(t.dest.device)]  # type: ignore[union-attr]
                await ring.copy_from(piece, t.dev[p.a - t.lo : p.b - t.lo])
            else:
                _out_view(t, p.a, p.b)[:] = piece

    async def _box_to_device(self, t: _Target, ring: RingLoad) -> None:
        """A box staged in ``t.buf`` into its device destination through the ring."""
        assert t.dest is not None
        if t.hi == t.lo:
            return
        host = _box_view(t).contiguous()
        tmp = torch.empty(host.shape, dtype=host.dtype, device=t.dest.device)
        arr: Any = host.view(-1).view(torch.uint8).numpy()
        await ring.copy_from(memoryview(arr), tmp.view(-1).view(torch.uint8))
        t.box = tmp

    def _corrupt(self, item: DcpItem, c: ChunkEntry, key: str, why: str = "") -> CorruptData:
        what = why or "checksum mismatch"
        return CorruptData(
            f"corrupt chunk of {item.fqn!r} (offset {list(item.offset or ())}, bytes "
            f"{c.offset}..{c.offset + c.length} of blob {key}) in {self.store.url}: {what}",
            tier=self.store.tier,
            key=key,
        )


def _out_view(t: _Target, a: int, b: int) -> memoryview:
    """Where item bytes [a, b) of target ``t`` go."""
    if t.direct is not None:
        return t.direct[a - t.lo : b - t.lo]
    assert t.buf is not None
    return memoryview(t.buf)[a - t.lo : b - t.lo]


def _box_span(
    shape: tuple[int, ...],
    offsets: Iterable[int],
    lengths: Iterable[int],
    itemsize: int,
) -> tuple[int, int, bool]:
    """Byte span ``[lo, hi)`` of a box inside a row-major tensor of ``shape``, and whether
    the box is exactly that span (contiguous)."""
    offs, lens = list(offsets), list(lengths)
    if not shape:
        return 0, itemsize, True
    if any(n == 0 for n in lens):
        return 0, 0, True
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    first = sum(o * s for o, s in zip(offs, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offs, lens, strides, strict=True))
    lo, hi = first * itemsize, (last + 1) * itemsize
    return lo, hi, (hi - lo) == math.prod(lens) * itemsize


def _copy_box(t: _Target) -> None:
    """Copy the box from the staged span into the destination (non-contiguous cases)."""
    assert t.dest is not None and t.buf is not None
    if t.hi == t.lo:
        return
    t.dest.copy_(_box_view(t))


def _box_view(t: _Target) -> torch.Tensor:
    """The box of ``t``'s plan, as a strided view of its staged span."""
    assert t.buf is not None
    item, req = t.item, t.req
    dtype = dtype_from_name(item.dtype)
    shape = item.shape
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    flat = torch.frombuffer(t.buf, dtype=torch.uint8).view(dtype)
    start = sum(o * s for o, s in zip(req.storage_offsets, strides, strict=True))
    base = t.lo // dtype.itemsize
    return flat.as_strided(tuple(req.lengths), tuple(strides), start - base)
