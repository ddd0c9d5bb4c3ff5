"""Exports of a checkpoint in node parts: each node copies its own part, the last one commits.

A sharded checkpoint of a job of several nodes on a node-local tier (``scope = "node"``)
has one part per node, and no node can read another's.  Each node's runner (its
``fmstore daemon`` or a training process's policy helper) exports its *own* part to a shared
tier with :func:`export_part`; the copy there becomes a checkpoint when every node's part
is there, verified.  The protocol goes through the destination store alone (records of
:mod:`fmstore.checkpoint.partrecords`), step by step:

1. the node writes its export lease (``GEN/export-NODE.json``) and renews it while it works;
2. it copies its part's blobs (resumable through its journal) and verifies them, as every
   copy is verified (:func:`fmstore.tiering.mover.copy_checkpoint`);
3. it writes its part record (``GEN/part-NODE.json``): ranks, blobs with sizes and CRC32Cs,
   the SHA-256 of the global manifest;
4. it reads the part records of the generation: when every part of the manifest has one
   naming the same manifest, it writes the manifest, the save's exact bytes, create-only
   (a node racing it writes the same bytes, so even a store that cannot refuse a second
   write ends with one manifest); else it reports the nodes it waits for, and every later
   attempt (of its next step, on any node) checks again;
5. after the commit, the committer removes the leases.

A crash after any step leaves what the next attempt of any node finishes: its part's blobs
resume from the journal (step 2), a part record without a commit is found complete by the
next node that looks (step 4).  A reader never sees a manifest whose parts are not all
there: part records are written after their blobs are verified, the manifest after every
record.  ``docs/distributed.md`` has the table of what each crash leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import TYPE_CHECKING

from ..checkpoint.partrecords import (
    LEASE_RE,
    LEASE_RENEW,
    PART_RECORD_RE,
    ExportLease,
    PartRecord,
    lease_key,
    manifest_sha256,
    part_record_key,
)
from ..checkpoint.verify import (
    blob_checksums,
    read_committed,
    verify_checkpoint,
)
from ..errors import AlreadyExists, CorruptData, FmstoreError, NotFound
from ..format.checksum import crc32c
from ..format.manifest import MANIFEST_KEY
from ..stores.base import PutOptions, Store
from ..stores.bounded import RECORD_LIMIT, manifest_limit, read_bounded
from .blobcopy import CopyResult, copy_blobs
from .transfer import TransferOptions

if TYPE_CHECKING:
    from ..checkpoint.dcp.manifest import DcpManifest

__all__ = ["delete_own_part", "export_part", "in_parts", "part_records"]


def in_parts(manifest: object) -> bool:
    """Whether ``manifest`` is a DCP checkpoint saved in one part per node."""
    from ..format.manifest import Manifest

    if isinstance(manifest, Manifest):
        return False
    from ..checkpoint.dcp.manifest import DcpManifest  # torch is loaded already

    return isinstance(manifest, DcpManifest) and bool(manifest.parts)


async def part_records(store: Store, generation: str) -> dict[str, PartRecord]:
    """The part records of ``generation`` under ``store``'s root, by node (an unreadable
    one is left out: it vouches for nothing)."""
    out: dict[str, PartRecord] = {}
    try:
        metas = [m async for m in store.list(generation + "/", recursive=False)]
    except NotFound:
        return out
    for meta in metas:
        name = PART_RECORD_RE.fullmatch(meta.key.rsplit("/", 1)[-1])
        if meta.is_dir or not name:
            continue
        with contextlib.suppress(NotFound, CorruptData):
            raw = await read_bounded(store, meta.key, RECORD_LIMIT, what="part record")
            rec = PartRecord.loads(raw, where=f"{store.url}/{meta.key}")
            if rec.node == name.group(1):  # a record speaks for the node it is named for
                out[rec.node] = rec
    return out


class _Lease:
    """This node's export lease on ``store``, renewed in the background while held."""

    def __init__(self, store: Store, generation: str, node: str) -> None:
        self.store = store
        self.key = lease_key(generation, node)
        self.node = node
        self._task: asyncio.Task[None] | None = None

    async def put(self) -> None:
        lease = ExportLease(self.node, os.getpid(), time.time())
        await self.store.put(self.key, lease.dumps())

    async def __aenter__(self) -> _Lease:
        await self.put()
        self._task = asyncio.create_task(self._renew())
        return self

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(LEASE_RENEW)
            with contextlib.suppress(FmstoreError):
                await self.put()

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def export_part(
    src: Store,
    dst: Store,
    node: str,
    *,
    options: TransferOptions,
    journal_path: str | None = None,
) -> CopyResult:
    """Export node ``node``'s part of the checkpoint at ``src``'s root (this node's copy on
    a node-local tier) to ``dst``'s root (a shared tier); see the module doc.

    Returns a :class:`~fmstore.tiering.mover.CopyResult` whose ``waiting_for`` names the
    nodes whose parts are not on ``dst`` yet (empty: committed).  Raises
    :class:`NotFound` (no checkpoint at ``src``, or no part of this node in it),
    :class:`CorruptData` (this node's part fails its checksums on ``src``, or a different
    checkpoint is committed at ``dst``), and what the copy engine raises.
    """
    t0 = time.monotonic()
    data, manifest = await read_committed(src)
    assert in_parts(manifest)
    full: DcpManifest = manifest  # type: ignore[assignment]
    view = full.part_view(node)
    if view is None:
        nodes = ", ".join(p.node for p in full.parts)
        raise NotFound(
            f"node {node} holds no part of this checkpoint (its parts are on {nodes})",
            tier=src.tier,
            key=src.url,
        )
    mcrc = crc32c(data)
    sha = manifest_sha256(data)
    gen = full.generation
    try:
        existing: bytes | None = await read_bounded(
            dst, MANIFEST_KEY, manifest_limit(), what="manifest"
        )
    except NotFound:
        existing = None
    if existing is not None and existing != data:
        raise CorruptData(
            "another checkpoint is committed under this name (its manifest differs from the "
            "save's); remove it to export this one",
            tier=dst.tier,
            key=f"{dst.url}/{MANIFEST_KEY}",
        )
    if existing is not None:
        # Committed (by this node or another): our part must really be there.
        there = await verify_checkpoint(dst, manifest=view, store_checksums=True)
        if there.ok:
            return CopyResult(
                full, mcrc, 0, view.stored_bytes, 0.0, already_there=True, check=there
            )
        # Our part is damaged on a committed copy: uncommit it (the manifest first: the
        # copy is no checkpoint while a part is bad), then copy the part again below; the
        # other parts' records still stand, so the commit is made again at once.
        await dst.delete(MANIFEST_KEY)
        await _delete_blobs(dst, view)
    async with _Lease(dst, gen, node):
        mine = await _own_record(dst, gen, node, sha)
        check = None
        copied = skipped = 0
        if mine is None:
            check, copied, skipped = await copy_blobs(
                src,
                dst,
                view,
                options,
                journal_path,
                on_bad_copy=lambda: _drop_bad(dst, view, journal_path),
            )
            crcs = blob_checksums(view)
            rec = PartRecord(
                node=node,
                ranks=tuple(full.part_of(node).ranks),  # type: ignore[union-attr]
                generation=gen,
                manifest_sha256=sha,
                blobs=tuple((b.name, b.size, crcs[i]) for i, b in enumerate(view.blobs)),
            )
            await dst.put(part_record_key(gen, node), rec.dumps())
        else:
            skipped = view.stored_bytes
        waiting = await commit_if_complete(dst, full, data)
    if not waiting:
        await _drop_leases(dst, gen)
    return CopyResult(
        full,
        mcrc,
        copied,
        skipped,
        time.monotonic() - t0,
        check=check,
        waiting_for=tuple(waiting),
    )


async def _own_record(dst: Store, gen: str, node: str, sha: str) -> PartRecord | None:
    try:
        raw = await read_bounded(dst, part_record_key(gen, node), RECORD_LIMIT, what="part record")
    except NotFound:
        return None
    try:
        rec = PartRecord.loads(raw, where=f"{dst.url}/{part_record_key(gen, node)}")
    except CorruptData:
        return None
    if rec.manifest_sha256 != sha:
        return None
    # The record vouches for blobs written before it; a sweep removes records before
    # blobs, so a record still there means its blobs are.  Check their sizes (one listing).
    sizes = {}
    async for meta in dst.list(gen + "/", recursive=False):
        sizes[meta.key.rsplit("/", 1)[-1]] = meta.size
    if any(sizes.get(name) != size for name, size, _ in rec.blobs):
        return None
    return rec


async def _drop_bad(dst: Store, view: DcpManifest, journal_path: str | None) -> None:
    # Only this node's blobs: the other nodes' parts are theirs (and a commit may need
    # them); and the journal, which would have the next copy skip them as done.
    await _delete_blobs(dst, view)
    if journal_path:
        with contextlib.suppress(OSError):
            os.unlink(journal_path)


async def commit_if_complete(dst: Store, manifest: DcpManifest, data: bytes) -> list[str]:
    """Write the manifest (``data``) at ``dst``'s root when every part of it has a part
    record there naming it; returns the nodes still missing (empty: committed now or
    before)."""
    sha = manifest_sha256(data)
    records = await part_records(dst, manifest.generation)
    missing = [
        p.node
        for p in manifest.parts
        if (r := records.get(p.node)) is None or r.manifest_sha256 != sha
    ]
    if missing:
        return missing
    try:
        await dst.put(MANIFEST_KEY, data, PutOptions(mode="create", content_crc32c=crc32c(data)))
    except AlreadyExists:
        if await read_bounded(dst, MANIFEST_KEY, manifest_limit(), what="manifest") != data:
            raise CorruptData(
                "another checkpoint was committed under this name meanwhile",
                tier=dst.tier,
                key=f"{dst.url}/{MANIFEST_KEY}",
            ) from None
    return []


async def _delete_blobs(dst: Store, view: DcpManifest) -> None:
    await dst.delete_many([view.blob_key(i) for i in range(len(view.blobs))])


async def _drop_leases(dst: Store, gen: str) -> None:
    with contextlib.suppress(FmstoreError):
        keys = [
            m.key
            async for m in dst.list(gen + "/", recursive=False)
            if LEASE_RE.fullmatch(m.key.rsplit("/", 1)[-1])
        ]
        await dst.delete_many(keys)


async def delete_own_part(dst: Store, node: str, src: Store | None = None) -> bool:
    """Remove node ``node``'s part of an uncommitted export at ``dst``'s root (a superseded
    export): its part record first (no commit counts it any more), then its blobs and its
    lease.  The other nodes' parts are never touched: a node that still exports may need
    them, and the sweep removes them once no exporter is alive.  Which blobs are this
    node's comes from its part record, else from the source's manifest (``src``); with
    neither, nothing is removed (False) and the sweep takes it later.

    Another node may have committed the copy since this node last looked (it found every
    part record, this node's included): then nothing is removed (False), before or after
    the part record goes (the record is put back), as the sweep looks again."""
    if await dst.exists(MANIFEST_KEY):
        return False  # committed by another node: this part belongs to the checkpoint
    manifest: DcpManifest | None = None
    if src is not None:
        with contextlib.suppress(FmstoreError):
            _data, m = await read_committed(src)
            if in_parts(m):
                manifest = m  # type: ignore[assignment]
    gens: list[str] = []
    if manifest is not None:
        gens.append(manifest.generation)
    else:
        with contextlib.suppress(NotFound):
            async for meta in dst.list("", recursive=False):
                if meta.is_dir:
                    gens.append(meta.key.rstrip("/"))
    done = False
    for gen in gens:
        rec_key = part_record_key(gen, node)
        rec_data: bytes | None = None
        try:
            rec_data = await read_bounded(dst, rec_key, RECORD_LIMIT, what="part record")
            rec = PartRecord.loads(rec_data, where=f"{dst.url}/{rec_key}")
            names = [f"{gen}/{n}" for n, _, _ in rec.blobs]
        except (NotFound, CorruptData):
            view = manifest.part_view(node) if manifest is not None else None
            if view is None:
                continue
            names = [view.blob_key(i) for i in range(len(view.blobs))]
        await dst.delete(rec_key)
        if await dst.exists(MANIFEST_KEY):  # a commit counted this part meanwhile
            if rec_data is not None:
                await dst.put(rec_key, rec_data)
            return done
        await dst.delete_many([*names, lease_key(gen, node)])
        done = True
    return done


def this_node() -> str:
    """This node's id (``$FMSTORE_NODE_ID``, else the host name; see
    :func:`fmstore.checkpoint.dcp.nodes.node_id`)."""
    from ..checkpoint.dcp.nodes import node_id

    return node_id()


async def remove_uncommitted(
    dst: Store, src: Store, *, node: str | None = None, shared_source: bool = False
) -> bool:
    """What a superseded export removes from ``dst``: from a node-local source holding a
    checkpoint in node parts, this node's part only (:func:`delete_own_part`, True); for
    anything else False (the caller removes the whole uncommitted copy)."""
    if node is None or shared_source:
        return False
    try:
        _data, manifest = await read_committed(src)
    except FmstoreError:
        manifest = None
    if manifest is not None and not in_parts(manifest):
        return False
    if manifest is None and not await part_records_anywhere(dst):
        return False
    await delete_own_part(dst, node, src)
    return True


async def part_records_anywhere(dst: Store) -> bool:
    """Whether any generation at ``dst``'s root holds a part record."""
    with contextlib.suppress(NotFound):
        async for meta in dst.list("", recursive=True):
            if PART_RECORD_RE.fullmatch(meta.key.rsplit("/", 1)[-1]):
                return True
    return False


async def parts_on(store: Store) -> dict[str, object] | None:
    """Which nodes' parts of the sharded checkpoint at ``store``'s root (a shared tier) are
    there, from the destination's part records: ``{"present": [nodes], "of": N or None,
    "committed": bool}``; None when no generation there holds a part record.  ``of`` comes
    from the manifest where one is committed (else it is not known from here).  No torch."""
    import json

    of: int | None = None
    gen: str | None = None
    committed = False
    with contextlib.suppress(NotFound, CorruptData, ValueError, KeyError, TypeError):
        d = json.loads(await read_bounded(store, MANIFEST_KEY, manifest_limit(), what="manifest"))
        gen, committed = str(d["generation"]), True
        of = len(d.get("parts") or []) or None
    gens = [gen] if gen else []
    if not gens:
        with contextlib.suppress(NotFound):
            names = [m.key.rstrip("/") async for m in store.list("", recursive=False) if m.is_dir]
            gens = sorted(names, reverse=True)
    for g in gens:
        records = await part_records(store, g)
        if records:
            return {"present": sorted(records), "of": of, "committed": committed}
    return None
