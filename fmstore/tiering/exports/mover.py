"""The checkpoint mover: copy, verify and delete whole checkpoints between tiers.

A checkpoint is a prefix holding data blobs and one ``manifest.json`` (see
:mod:`fmstore.format.manifest`).  :func:`copy_checkpoint` plans the copy from the source's
manifest (its blobs, each with the CRC32C its chunks imply) and hands the plan to the copy
engine of :mod:`fmstore.tiering.copy.transfer` (the one ``fmstore stage`` uses: parallel, bounded,
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

import time
from typing import TYPE_CHECKING

from ...checkpoint.commit import commit_manifest, read_bounded_manifest
from ...checkpoint.verify import read_committed, verify_checkpoint
from ...errors import FmstoreError, NotFound, VersionError
from ...format.checksum import crc32c
from ...format.manifest import MANIFEST_KEY
from ...protocol.env import Env
from ...stores.base import Store
from ..copy.blobcopy import CopyResult, copy_blobs
from ..copy.transfer import TransferOptions
from .parts import export_part, in_parts

if TYPE_CHECKING:
    pass

#: How checkpoints are copied between tiers unless the config says otherwise (``[daemon]``
#: concurrency, bwlimit and verify_destination: :func:`fmstore.tiering.service.daemon.settings_from_config`).
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


async def copy_checkpoint(
    src: Store,
    dst: Store,
    *,
    options: TransferOptions = CHECKPOINT_COPY,
    journal_path: str | None = None,
    node: str | None = None,
    env: Env | None = None,
    shared_source: bool = False,
) -> CopyResult:
    """Copy the checkpoint at ``src``'s root to ``dst``'s root; see the module guarantees.

    A sharded checkpoint in node parts is copied whole from a shared tier
    (``shared_source``: every part is there); from a node-local tier only node ``node``'s
    part is (:func:`fmstore.tiering.exports.parts.export_part` under ``env``, the protocol's
    clock and settings: the copy commits once every node's part is there).  Without either it is refused as a format this copy cannot read.

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
            if env is None:
                raise TypeError("exporting a node's part needs the protocol's env")
            return await export_part(
                src, dst, node, options=options, env=env, journal_path=journal_path
            )
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
        existing = await read_bounded_manifest(dst)
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

    check, copied, skipped = await copy_blobs(
        src, dst, manifest, options, journal_path, on_bad_copy=lambda: delete_checkpoint(dst)
    )
    # The commit: the manifest, byte for byte, written last.  Replace: a different
    # checkpoint under this name (see above) is superseded by the copy.
    await commit_manifest(dst, data, "replace", crc=mcrc)
    return CopyResult(manifest, mcrc, copied, skipped, time.monotonic() - t0, check=check)


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
