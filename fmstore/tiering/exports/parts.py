"""Exports of a checkpoint in node parts: each node copies its own part, the last one commits.

A sharded checkpoint of a job of several nodes on a node-local tier (``scope = "node"``)
has one part per node, and no node can read another's.  Each node's runner (its
``fmstore daemon`` or a training process's policy helper) exports its *own* part to a shared
tier with :func:`export_part`; the copy there becomes a checkpoint when every node's part
is there, verified.  The protocol goes through the destination store alone (records of
:mod:`fmstore.protocol.records`), step by step:

1. the node writes its export lease (``GEN/export-NODE.json``) and renews it while it works;
2. it copies its part's blobs (resumable through its journal) and verifies them, as every
   copy is verified (:func:`fmstore.tiering.exports.mover.copy_checkpoint`);
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
import functools
import os
import time
from typing import TYPE_CHECKING

from ...checkpoint.commit import commit_manifest, read_bounded_manifest
from ...checkpoint.verify import blob_checksums, read_committed, verify_checkpoint
from ...errors import AlreadyExists, CorruptData, FmstoreError, NotFound
from ...format.checksum import crc32c
from ...format.manifest import MANIFEST_KEY
from ...protocol.decisions import commit_holds, may_remove_part, record_holds
from ...protocol.env import Env
from ...protocol.records import (
    LEASE_RE,
    PART_RECORD_RE,
    ExportLease,
    PartRecord,
    lease_key,
    manifest_sha256,
    part_record_key,
)
from ...stores.base import Store
from ...stores.bounded import LEASE_LIMIT, RECORD_LIMIT, decode_json, read_bounded
from ..copy.blobcopy import CopyResult, copy_blobs
from ..copy.transfer import TransferOptions
from . import retire

if TYPE_CHECKING:
    from ...checkpoint.dcp.manifest import DcpManifest

__all__ = ["delete_own_part", "export_part", "in_parts", "lease_renewals", "part_records"]


def in_parts(manifest: object) -> bool:
    """Whether ``manifest`` is a DCP checkpoint saved in one part per node."""
    from ...format.manifest import Manifest

    if isinstance(manifest, Manifest):
        return False
    from ...checkpoint.dcp.manifest import DcpManifest  # torch is loaded already

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
    """This node's export lease on ``store``, renewed in the background while held (every
    ``env.lease_renew`` seconds; its clock and process id are ``env``'s)."""

    def __init__(self, store: Store, generation: str, node: str, env: Env) -> None:
        self.store = store
        self.key = lease_key(generation, node)
        self.node = node
        self.env = env
        self.renewed = 0.0  # this node's clock at the start of the last renewal written
        self._task: asyncio.Task[None] | None = None

    async def put(self) -> None:
        now = self.env.now()
        await self.store.put(self.key, ExportLease(self.node, self.env.process(), now).dumps())
        self.renewed = max(self.renewed, now)

    async def __aenter__(self) -> _Lease:
        await self.put()
        self._task = asyncio.create_task(self._renew())
        return self

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.env.lease_renew)
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
    env: Env,
    journal_path: str | None = None,
) -> CopyResult:
    """Export node ``node``'s part of the checkpoint at ``src``'s root (this node's copy on
    a node-local tier) to ``dst``'s root (a shared tier); see the module doc.  ``env``: the
    protocol's clock, process and lease settings (the lease this export holds, the records
    it writes, the leases it judges).

    Returns a :class:`~fmstore.tiering.exports.mover.CopyResult` whose ``waiting_for`` names the
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
        existing: bytes | None = await read_bounded_manifest(dst)
    except NotFound:
        existing = None
    # A commit of a step a restore abandoned (its generation retired) is deleted, manifest
    # first, once no exporter of it may be alive (:mod:`.retire`); never overwritten.
    renewals = functools.partial(lease_renewals, env=env)
    in_way = None if existing is None else await retire.clear_retired(dst, existing, renewals, env)
    if (existing == data and in_way is not None) or (
        existing is None and await retire.retired(dst, gen)
    ):
        return CopyResult(full, mcrc, 0, 0, time.monotonic() - t0, retired=True)
    if existing is not None and existing != data:
        if in_way is None:
            raise CorruptData(
                "another checkpoint is committed under this name (its manifest differs from "
                "the save's); remove it to export this one",
                tier=dst.tier,
                key=f"{dst.url}/{MANIFEST_KEY}",
            )
        if in_way:
            return CopyResult(full, mcrc, 0, 0, time.monotonic() - t0, waiting_for=tuple(in_way))
        existing = None
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
    async with _Lease(dst, gen, node, env) as lease:
        mine = await _own_record(dst, full, node, sha)
        check = None
        copied = skipped = 0
        if mine and not set(await _holding_records(dst, full, data)) - {node}:
            # The commit is next and counts this node's part on its record's word: check
            # the part itself first (a record vouches for nothing by who wrote it).
            there = await verify_checkpoint(dst, manifest=view, store_checksums=True)
            if there.ok:
                check = there
            else:  # the record first (no commit counts the part), then the bad bytes
                await dst.delete(part_record_key(gen, node))
                await _drop_bad(dst, view, journal_path)
                mine = False
        if not mine:
            try:
                check, copied, skipped = await copy_blobs(
                    src,
                    dst,
                    view,
                    options,
                    journal_path,
                    on_bad_copy=lambda: _drop_bad(dst, view, journal_path),
                )
            except NotFound as e:
                # The part moved away under the copy: a restore that fell back moves a
                # step aside only after retiring its generation here, so that is what
                # happened (the source now holds the redo, or nothing); not a lost part.
                if e.tier == dst.tier or not await retire.retired(dst, gen):
                    raise
                return CopyResult(full, mcrc, 0, 0, time.monotonic() - t0, retired=True)
            crcs = blob_checksums(view)
            rec = PartRecord(
                node=node,
                ranks=tuple(full.part_of(node).ranks),  # type: ignore[union-attr]
                generation=gen,
                manifest_sha256=sha,
                blobs=tuple((b.name, b.size, crcs[i]) for i, b in enumerate(view.blobs)),
                written=env.now(),
            )
            await dst.put(part_record_key(gen, node), rec.dumps())
        else:
            skipped = view.stored_bytes
        try:
            waiting = await commit_if_complete(dst, full, data, lease)
        except retire.Retired:
            # A restore abandoned this save's step: not committed (or no longer), and the
            # part here is an uncommitted generation's, left to the sweep.
            return CopyResult(
                full, mcrc, copied, skipped, time.monotonic() - t0, check=check, retired=True
            )
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


async def _own_record(dst: Store, manifest: DcpManifest, node: str, sha: str) -> bool:
    """Whether node ``node``'s part record at ``dst`` holds: it names this manifest and
    lists exactly this node's blobs, each there with its size
    (:func:`fmstore.protocol.decisions.record_holds`; one listing).  A record that lists
    other blobs, or none, was not written by this node's export, whoever it names."""
    key = part_record_key(manifest.generation, node)
    try:
        raw = await read_bounded(dst, key, RECORD_LIMIT, what="part record")
        rec = PartRecord.loads(raw, where=f"{dst.url}/{key}")
    except (NotFound, CorruptData):
        return False
    if rec.manifest_sha256 != sha:
        return False
    sizes = await _listing(dst, manifest.generation)
    return record_holds(rec.blobs, _part_blobs(manifest, node), sizes)


async def _drop_bad(dst: Store, view: DcpManifest, journal_path: str | None) -> None:
    # Only this node's blobs: the other nodes' parts are theirs (and a commit may need
    # them); and the journal, which would have the next copy skip them as done.
    await _delete_blobs(dst, view)
    if journal_path:
        with contextlib.suppress(OSError):
            os.unlink(journal_path)


async def commit_if_complete(
    dst: Store, manifest: DcpManifest, data: bytes, lease: _Lease
) -> list[str]:
    """Write the manifest (``data``) at ``dst``'s root when every part of it has a part
    record there that holds (:func:`_holding_records`); returns the nodes still missing
    (empty: committed now or before).

    The committer renews its ``lease`` before it lists the records, and writes the
    manifest only while that renewal keeps every node from removing a part it listed
    (:func:`fmstore.protocol.decisions.commit_holds`, with the lease's ``env``; the argument
    is in ``docs/distributed.md``, "Supersede and commit")."""
    env = lease.env
    renewals = functools.partial(lease_renewals, env=env)
    await lease.put()
    missing = await _holding_records(dst, manifest, data)
    if missing:
        return missing
    # The fence against a restore that abandoned this step (:mod:`.retire`): no commit of a
    # retired generation, and none of a new one while a retired one's exporter may write.
    if await retire.retired(dst, manifest.generation):
        raise retire.Retired(manifest.generation)
    if blocked := await retire.retired_exporters(dst, manifest.generation, renewals, env):
        return blocked
    if not commit_holds(lease.renewed, now=env.now(), ttl=env.lease_ttl, skew=env.clock_skew):
        # Listed too long ago: a node may have taken its part out since, trusting this
        # lease expired.  Not committed; the next attempt (any node's) lists afresh.
        return [p.node for p in manifest.parts]
    try:
        # same-or-fail: every node commits the same agreed bytes, so finding them there
        # means committed already; another checkpoint under this name is never overwritten
        await commit_manifest(dst, data, "same-or-fail", crc=crc32c(data))
    except AlreadyExists:
        # another checkpoint's manifest is there: the commit of a step a restore
        # abandoned is cleared out of the way (:mod:`.retire`), anything else refused
        there = await read_bounded_manifest(dst)
        in_way = await retire.clear_retired(dst, there, renewals, env)
        if in_way is None:
            raise CorruptData(
                "another checkpoint was committed under this name meanwhile",
                tier=dst.tier,
                key=f"{dst.url}/{MANIFEST_KEY}",
            ) from None
        return in_way or [p.node for p in manifest.parts]  # the next attempt commits
    # Looked for again after the write: a restore that retired the generation meanwhile
    # may have read no manifest, so the commit is taken back here.
    if await retire.retired(dst, manifest.generation):
        await retire.retire_own_commit(dst, data, lease, env)
        raise retire.Retired(manifest.generation)
    return []


async def _holding_records(dst: Store, manifest: DcpManifest, data: bytes) -> list[str]:
    """The nodes of ``manifest`` whose part no record at ``dst`` vouches for: a record
    counts by its content (:func:`fmstore.protocol.decisions.record_holds`: exactly the
    part's blobs, sizes and checksums as the manifest implies them, each there with its
    size), never by the node it names."""
    sha = manifest_sha256(data)
    records = await part_records(dst, manifest.generation)
    sizes = await _listing(dst, manifest.generation)
    missing = []
    for p in manifest.parts:
        r = records.get(p.node)
        if (
            r is None
            or r.manifest_sha256 != sha
            or not record_holds(r.blobs, _part_blobs(manifest, p.node), sizes)
        ):
            missing.append(p.node)
    return missing


def _part_blobs(manifest: DcpManifest, node: str) -> list[tuple[str, int, int | None]]:
    """Node ``node``'s blobs as its part record must list them (name, size, CRC32C)."""
    view = manifest.part_view(node)
    if view is None:
        return []
    crcs = blob_checksums(view)
    return [(b.name, b.size, crcs[i]) for i, b in enumerate(view.blobs)]


async def _listing(dst: Store, gen: str) -> dict[str, int]:
    try:
        return {
            m.key.rsplit("/", 1)[-1]: m.size async for m in dst.list(gen + "/", recursive=False)
        }
    except NotFound:
        return {}


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


async def delete_own_part(dst: Store, node: str, src: Store | None = None, *, env: Env) -> bool:
    """Remove node ``node``'s part of an uncommitted export at ``dst``'s root (a superseded
    export): its part record first (no commit counts it any more), then its blobs and its
    lease.  The other nodes' parts are never touched: a node that still exports may need
    them, and the sweep removes them once no exporter is alive.  Which blobs are this
    node's comes from its part record, else from the source's manifest (``src``); with
    neither, nothing is removed (False) and the sweep takes it later.

    Another node may have committed the copy since this node last looked (it found every
    part record, this node's included), or may be about to (its export lease may still be
    alive): then nothing is removed (False), before or after the part record goes (the
    record is put back), as the sweep looks again once no lease is alive.  ``env``: the
    clock and lease settings the leases are judged by."""
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
        # The record first, then the leases, then the manifest (docs/distributed.md,
        # "Supersede and commit"): a committer that listed this record renewed its lease
        # before, so it is read here, and it writes the manifest only while that lease
        # still looks alive to this node.
        await dst.delete(rec_key)
        leases = await lease_renewals(dst, gen, env=env)
        now = env.now()  # before the manifest is looked for: a lease dead at ``now`` had
        # its committer's write land (if at all) before this moment, so it is seen below
        committed = await dst.exists(MANIFEST_KEY)
        if not may_remove_part(
            node, leases, committed=committed, now=now, ttl=env.lease_ttl, skew=env.clock_skew
        ):
            # A commit counted this part, or may still: the part stays, as it was.
            if rec_data is not None:
                await dst.put(rec_key, rec_data)
            return done
        await dst.delete_many([*names, lease_key(gen, node)])
        done = True
    return done


async def lease_renewals(dst: Store, gen: str, *, env: Env) -> dict[str, float]:
    """Node -> last renewal of each export lease of ``gen`` at ``dst``; a lease that does
    not parse counts from its file's modification time (or as renewed now, ``env``'s clock,
    without one), so that nothing anyone wrote there shortens a live exporter's lease."""
    out: dict[str, float] = {}
    try:
        metas = [m async for m in dst.list(gen + "/", recursive=False)]
    except NotFound:
        return out
    for meta in metas:
        found = LEASE_RE.match(meta.key.rsplit("/", 1)[-1])
        if meta.is_dir or found is None:
            continue
        try:
            raw = await read_bounded(dst, meta.key, LEASE_LIMIT, what="export lease")
            lease = ExportLease.loads(raw, where=f"{dst.url}/{meta.key}")
            out[found.group(1)] = lease.renewed
        except NotFound:
            continue
        except CorruptData:
            out[found.group(1)] = meta.mtime if meta.mtime is not None else env.now()
    return out


async def remove_uncommitted(
    dst: Store,
    src: Store,
    *,
    node: str | None = None,
    env: Env | None = None,
    shared_source: bool = False,
) -> bool:
    """What a superseded export removes from ``dst``: from a node-local source holding a
    checkpoint in node parts, this node's part only (:func:`delete_own_part` with ``env``,
    True); for anything else False (the caller removes the whole uncommitted copy)."""
    if node is None or shared_source:
        return False
    if env is None:
        raise TypeError("removing a node's own part needs the protocol's env")
    try:
        _data, manifest = await read_committed(src)
    except FmstoreError:
        manifest = None
    if manifest is not None and not in_parts(manifest):
        return False
    if manifest is None and not await part_records_anywhere(dst):
        return False
    await delete_own_part(dst, node, src, env=env)
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

    of: int | None = None
    gen: str | None = None
    committed = False
    with contextlib.suppress(NotFound, CorruptData, ValueError, KeyError, TypeError):
        d = decode_json(await read_bounded_manifest(store))
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
