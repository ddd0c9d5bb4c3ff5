"""The checkpoint mover: copy, verify and delete whole checkpoints between tiers.

A checkpoint is a prefix holding data blobs and one ``manifest.json`` (see
:mod:`fmstore.format.manifest`).  :func:`copy_checkpoint` plans the copy from the source's
manifest (its blobs, each with the CRC32C its chunks imply) and hands the plan to the copy
engine of :mod:`fmstore.tiering.transfer` (the one ``fmstore stage`` uses: parallel, bounded,
resumable through its journal, bandwidth-limited); only after every blob is copied and
verified does it write the manifest on the destination, with the same bytes: the same
commit convention on every tier.

Guarantees:

* a destination never holds a manifest whose blobs are not all there and verified, so a
  copy killed at any moment is either not a checkpoint yet or a complete one;
* re-running a copy after a crash does not rewrite blobs the journal (or the destination's
  recorded checksums) already shows as done;
* :func:`delete_checkpoint` removes the manifest first (the copy stops being a checkpoint
  at once), then the blobs, so a crash half-way leaves garbage, never a torn checkpoint;
  it is idempotent;
* every check compares each chunk's bytes with the CRC32C the manifest recorded, so a copy
  made from a corrupt source fails instead of spreading the damage.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..checkpoint.verify import VerifyResult, blob_checksums, read_committed, verify_checkpoint
from ..errors import CorruptData, FmstoreError, NotFound, StoreUnavailable, VersionError
from ..format.checksum import crc32c
from ..format.manifest import MANIFEST_KEY
from ..stores.base import PutOptions, Store
from .journal import Journal
from .parts import export_part, in_parts
from .transfer import CopyItem, Failure, TransferOptions, copy_items

if TYPE_CHECKING:
    from ..checkpoint.verify import AnyCommitted

#: How checkpoints are copied between tiers unless the config says otherwise (``[daemon]``
#: concurrency, bwlimit and verify_destination: :func:`fmstore.tiering.daemon.settings_from_config`).
#: Blobs up to ``multipart_threshold`` go as one object, bigger ones (checkpoint blobs are
#: up to 256 MiB) in resumable parts of ``part_size``, so a killed copy redoes at most the
#: parts in flight.  ``verify``: check every blob on the destination before committing,
#: by the store's own checksum where it keeps one, else by reading it back (the engine
#: already checks the bytes it read against the manifest on the way); see
#: :func:`copy_checkpoint`.
CHECKPOINT_COPY = TransferOptions(
    concurrency=16,
    part_size=16 << 20,
    multipart_threshold=64 << 20,
    max_inflight_bytes=1 << 30,
    verify=True,
)


@dataclass
class CopyResult:
    manifest: AnyCommitted
    manifest_crc32c: int
    bytes_copied: int
    bytes_skipped: int
    seconds: float
    already_there: bool = False
    #: The check of the destination before the commit (None with ``verify`` off): how
    #: many blobs the store's checksum, the written bytes' checksum or a read-back vouched for.
    check: VerifyResult | None = None
    #: A checkpoint in node parts (:mod:`.parts`): the nodes whose parts are not on the
    #: destination yet; empty once the copy there is committed.
    waiting_for: tuple[str, ...] = ()


async def copy_checkpoint(
    src: Store,
    dst: Store,
    *,
    options: TransferOptions = CHECKPOINT_COPY,
    journal_path: str | None = None,
    node: str | None = None,
    shared_source: bool = False,
) -> CopyResult:
    """Copy the checkpoint at ``src``'s root to ``dst``'s root; see the module guarantees.

    A sharded checkpoint in node parts is copied whole from a shared tier
    (``shared_source``: every part is there); from a node-local tier only node ``node``'s
    part is (:func:`fmstore.tiering.parts.export_part`: the copy commits once every node's
    part is there).  Without either it is refused as a format this copy cannot read.

    Raises :class:`NotFound` (no checkpoint at ``src``), :class:`CorruptData` (the source
    fails its checksums: the copy is not committed), :class:`TierFull`,
    :class:`StoreUnavailable` (after the engine's retries).  The journal at ``journal_path``
    makes a killed copy resume without rewriting finished blobs or parts.
    """
    t0 = time.monotonic()
    # Either format: a single-process checkpoint or one written by the DCP ``Writer``
    # (blobs, sizes and chunk checksums are described alike by both).
    data, manifest = await read_committed(src)
    if in_parts(manifest) and not shared_source:
        if node is not None:
            return await export_part(src, dst, node, options=options, journal_path=journal_path)
        # This node holds its own part only, and no node was named to export it: copied
        # whole it would find the other nodes' blobs missing.  Reported as unreadable
        # here, never as missing or corrupt.
        raise VersionError(
            f"{src.url} is a sharded checkpoint in node parts (docs/distributed.md); "
            "only a node's own part can be exported from a node-local tier",
            tier=src.tier,
            key=MANIFEST_KEY,
        )
    mcrc = crc32c(data)
    try:
        existing = await dst.get(MANIFEST_KEY)
    except NotFound:
        existing = None
    if existing is not None and crc32c(existing) == mcrc:
        # Committed on the destination already (a run killed after the commit): re-check
        # the blobs so "already there" never means "half there".
        there = await verify_checkpoint(dst, manifest=manifest, store_checksums=True)
        if there.ok:
            return CopyResult(
                manifest, mcrc, 0, manifest.stored_bytes, 0.0, already_there=True, check=there
            )
        # The destination's blobs are damaged: remove the copy (manifest first) and copy
        # again from scratch; the engine would otherwise trust the checksums it recorded
        # on the damaged blobs and skip them.
        await delete_checkpoint(dst)
    elif existing is not None:
        # A different checkpoint under the same name (a crashed overwrite, a re-used step):
        # it is replaced atomically by the manifest written at the end.
        pass

    crcs = blob_checksums(manifest)
    sizes = [b.size for b in manifest.blobs]
    items = [
        CopyItem(
            src_key=manifest.blob_key(i),
            dst_key=manifest.blob_key(i),
            size=size,
            crc32c=crcs[i],
        )
        for i, size in enumerate(sizes)
    ]
    journal = await Journal.open(journal_path, fsync=True, dest=dst.url) if journal_path else None
    try:
        report = await copy_items(
            src,
            dst,
            items,
            # The destination is verified below, chunk by chunk, before the commit.
            replace(options, verify=False),
            journal=journal,
        )
    finally:
        if journal is not None:
            with contextlib.suppress(Exception):
                await journal.close()
    if report.failures:
        _raise_for(report.failures, src, dst)
    check = None
    if options.verify:
        # What this proves, blob by blob (each against the CRC32C its manifest chunks give):
        # * S3: the server checked every PUT and part against the CRC32C we sent (taken from
        #   the bytes read, which matched the manifest) and refused any mismatch; its
        #   HEAD checksum now equals the manifest's, so the object at the key holds those
        #   bytes as far as the server can tell (no GET of the data).
        # * POSIX: the CRC32C was taken of the very buffers written, then the destination
        #   was synced; a read-back would come from the page cache just written and prove
        #   nothing more, so only each blob's size is checked.
        # * Elsewhere (a server keeping no checksum, blobs skipped as already copied on a
        #   file system): the blob is read back and checked chunk by chunk.
        check = await verify_checkpoint(
            dst,
            manifest=manifest,
            store_checksums=True,
            written=report.written if dst.local_root is not None else None,
        )
        if not check.ok:
            # Find out whose fault it is: a bad source must not be copied again and again.
            src_check = await verify_checkpoint(src, manifest=manifest)
            if not src_check.ok:
                raise CorruptData(
                    "source copy fails its checksums: " + "; ".join(src_check.problems[:3]),
                    tier=src.tier,
                    key=src.url,
                )
            # Bad bytes landed on the destination: remove them so the next attempt does not
            # skip them as already copied.
            await delete_checkpoint(dst)
            raise CorruptData(
                "copy fails its checksums on the destination: " + "; ".join(check.problems[:3]),
                tier=dst.tier,
                key=dst.url,
            )
    # The commit: the manifest, byte for byte, written last.
    await dst.put(MANIFEST_KEY, data, PutOptions(content_crc32c=mcrc))
    p = report.progress
    return CopyResult(
        manifest,
        mcrc,
        p.bytes_copied,
        p.bytes_skipped + p.bytes_resumed,
        time.monotonic() - t0,
        check=check,
    )


def _raise_for(failures: Sequence[Failure], src: Store, dst: Store) -> None:
    """Raise the class of the first typed failure (never guessed from a message), naming
    the tier it came from; an untyped one (a bug, an unexpected OS error) is reported as
    the destination being unavailable."""
    text = "; ".join(f"{f.key}: {f.error}" for f in failures[:3])
    first = next((f.exc for f in failures if f.exc is not None), None)
    if isinstance(first, CorruptData):
        raise CorruptData(f"copy failed verification: {text}", tier=src.tier, key=src.url)
    if isinstance(first, NotFound) and first.tier != dst.tier:
        raise NotFound(f"copy failed, source blob missing: {text}", tier=src.tier, key=src.url)
    if first is not None:
        side = src if first.tier == src.tier and src.tier != dst.tier else dst
        raise type(first)(f"copy failed: {text}", tier=side.tier, key=side.url)
    raise StoreUnavailable(f"copy failed: {text}", tier=dst.tier, key=dst.url)


async def delete_checkpoint(store: Store) -> int:
    """Remove the checkpoint at ``store``'s root: manifest first, then everything under the
    prefix.  Idempotent; returns the bytes removed."""
    await store.delete(MANIFEST_KEY)
    removed = 0
    keys = []
    async for meta in store.list(""):
        if not meta.is_dir:
            keys.append(meta.key)
            removed += meta.size
    if keys:
        await store.delete_many(keys)
    return removed


async def has_checkpoint(store: Store) -> bool:
    """Whether a committed manifest is there (cheap: one stat)."""
    try:
        await store.stat(MANIFEST_KEY)
    except NotFound:
        return False
    except FmstoreError:
        raise
    return True
