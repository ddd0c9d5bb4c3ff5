"""Copying the blobs a checkpoint's manifest names, then checking them on the destination.

What a whole checkpoint's copy (:mod:`.mover`) and the export of one node's part of a
sharded one (:mod:`.parts`) share: the blobs are planned from the manifest (each with the
CRC32C its chunks imply), handed to the copy engine of :mod:`.transfer` (resumable through
its journal), and checked on the destination before anything commits them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ...checkpoint.verify import VerifyResult, blob_checksums, verify_checkpoint
from ...errors import CorruptData, NotFound, StoreUnavailable
from ...stores.base import Store
from .journal import Journal
from .transfer import CopyItem, Failure, TransferOptions, copy_items

if TYPE_CHECKING:
    from ...checkpoint.verify import AnyCommitted

__all__ = ["CopyResult", "copy_blobs", "raise_for"]


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
    #: A checkpoint in node parts whose generation a restore retired (it abandoned the
    #: step, :mod:`.retire`): not committed on the destination, and never will be.
    retired: bool = False


async def copy_blobs(
    src: Store,
    dst: Store,
    manifest: AnyCommitted,
    options: TransferOptions,
    journal_path: str | None,
    *,
    on_bad_copy: Callable[[], Awaitable[object]],
) -> tuple[VerifyResult | None, int, int]:
    """Copy every blob ``manifest`` names from ``src`` to ``dst`` and, with
    ``options.verify``, check them there; returns (the check, bytes copied, bytes skipped
    or resumed).  Nothing is committed here.

    Raises the copy engine's failures by class (:func:`raise_for`), and
    :class:`CorruptData` when the check fails: naming the source when its own copy fails
    its checksums, else after ``on_bad_copy()`` removed the bad bytes from the
    destination (so the next attempt does not skip them as already copied)."""
    crcs = blob_checksums(manifest)
    sizes = [b.size for b in manifest.blobs]
    items = [
        CopyItem(
            src_key=manifest.blob_key(i), dst_key=manifest.blob_key(i), size=size, crc32c=crcs[i]
        )
        for i, size in enumerate(sizes)
    ]
    journal = await Journal.open(journal_path, fsync=True, dest=dst.url) if journal_path else None
    try:
        report = await copy_items(
            src,
            dst,
            items,
            # The destination is verified below, chunk by chunk, before any commit.
            replace(options, verify=False),
            journal=journal,
        )
    finally:
        if journal is not None:
            with contextlib.suppress(Exception):
                await journal.close()
    if report.failures:
        raise_for(report.failures, src, dst)
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
            await on_bad_copy()
            raise CorruptData(
                "copy fails its checksums on the destination: " + "; ".join(check.problems[:3]),
                tier=dst.tier,
                key=dst.url,
            )
    p = report.progress
    return check, p.bytes_copied, p.bytes_skipped + p.bytes_resumed


def raise_for(failures: Sequence[Failure], src: Store, dst: Store) -> None:
    """Raise the class of the first typed failure (never guessed from a message), naming
    the tier it came from; an untyped one (a bug, an unexpected OS error) is reported as
    the destination being unavailable."""
    # Each failure by its key under the checkpoint and its own message: the location is
    # said once, by the error raised here (a typed error's text repeats its tier and key).
    text = "; ".join(f"{f.key}: {f.exc.message if f.exc else f.error}" for f in failures[:3])
    first = next((f.exc for f in failures if f.exc is not None), None)
    if isinstance(first, CorruptData):
        raise CorruptData(f"copy failed verification: {text}", tier=src.tier, key=src.url)
    if isinstance(first, NotFound) and first.tier != dst.tier:
        raise NotFound(f"copy failed, source blob missing: {text}", tier=src.tier, key=src.url)
    if first is not None:
        side = src if first.tier == src.tier and src.tier != dst.tier else dst
        raise type(first)(f"copy failed: {text}", tier=side.tier, key=side.url)
    raise StoreUnavailable(f"copy failed: {text}", tier=dst.tier, key=dst.url)
