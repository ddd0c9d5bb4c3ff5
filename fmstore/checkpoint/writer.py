"""Writing a planned checkpoint: encode chunks in the CPU pool, write blobs in parallel with
bounded bytes in flight, then commit by writing ``manifest.json`` last.

Call order of :func:`write_checkpoint`:

1. refuse early when a manifest exists and ``overwrite`` is False;
2. every blob of the plan is written under a fresh generation prefix (``gXXXX-YYYY/``):
   chunks are checksummed and encoded concurrently, a blob of one chunk is one ``put``, a
   larger blob is one streamed writer (multipart on S3);
3. once every blob is acknowledged the manifest is put (``create`` mode unless
   ``overwrite``): that single atomic put is the commit;
4. after an overwrite, the previous generation's blobs are deleted (readers that raced with
   the switch re-read the manifest, see reader.py).

On any failure before the commit the blobs written so far are deleted (best effort; what a
crash leaves behind is removed by :func:`fmstore.checkpoint.gc`) and the error is raised:
nothing becomes visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass

from .. import __version__, runtime
from ..errors import AlreadyExists, CorruptData, NotFound
from ..format.checksum import crc32c
from ..format.codecs import encode
from ..format.manifest import MANIFEST_KEY, BlobEntry, ChunkEntry, Manifest, StorageEntry
from ..limits import ByteBudget
from ..protocol.records import writer_node
from ..stores.base import Buffer, Store
from .commit import commit_manifest
from .layout import new_generation
from .planner import ALIGN, SavePlan


@dataclass(frozen=True)
class WriteOptions:
    """``io_concurrency``: blobs written at once; ``max_inflight``: bytes of encoded chunks
    held in memory at once (raw chunks are views of the source and cost nothing)."""

    overwrite: bool = False
    io_concurrency: int = 8
    max_inflight: int = 1 << 30


def _encode_chunk(codec: str, data: memoryview, group: int) -> tuple[str, Buffer, int]:
    used, stored = encode(codec, data, group)
    return used, stored, crc32c(stored)


async def write_checkpoint(
    store: Store, plan: SavePlan, views: list[memoryview], options: WriteOptions = WriteOptions()
) -> Manifest:
    """Write ``plan`` with storage bytes ``views[i]``; returns the committed manifest."""
    old_gen: str | None = None
    if await store.exists(MANIFEST_KEY):
        if not options.overwrite:
            raise AlreadyExists(
                "a checkpoint already exists here; pass overwrite=True to replace it",
                tier=store.tier,
                key=MANIFEST_KEY,
            )
        old_gen = await _current_generation(store)
    gen = new_generation()
    budget = ByteBudget(max(1, options.max_inflight))
    blob_gate = asyncio.Semaphore(max(1, options.io_concurrency))
    entries: dict[int, ChunkEntry] = {}
    sizes: list[int] = [0] * len(plan.blobs)

    async def encode_one(ci: int) -> tuple[str, Buffer, int, int]:
        c = plan.chunks[ci]
        held = await budget.acquire(c.raw if c.codec != "raw" else 0)
        try:
            data = views[c.storage][c.raw_offset : c.raw_offset + c.raw]
            used, stored, crc = await runtime.to_cpu(_encode_chunk, c.codec, data, c.group)
        except BaseException:
            await budget.release(held)
            raise
        return used, stored, crc, held

    async def write_raw_blob(
        key: str, chunks: tuple[int, ...], tasks: list[asyncio.Task[tuple[str, Buffer, int, int]]]
    ) -> int:
        """A blob of raw chunks (views of the tensors, only checksummed) goes to the writer
        in one call, as pieces: an object store sends whole parts straight from the
        tensors' memory, many at once, however small the tensors are."""
        pieces: list[Buffer] = []
        pos = 0
        for ci, task in zip(chunks, tasks, strict=True):
            used, stored, crc, held = await task
            await budget.release(held)
            pad = -pos % ALIGN
            if pad:
                pieces.append(bytes(pad))
                pos += pad
            pieces.append(stored)
            c = plan.chunks[ci]
            entries[ci] = ChunkEntry(
                c.blob, pos, len(stored), c.raw_offset, c.raw, used, crc, c.group
            )
            pos += len(stored)
        async with await store.open_writer(key) as writer:
            await writer.write(pieces)
        return pos

    async def write_blob(bi: int) -> None:
        blob = plan.blobs[bi]
        key = f"{gen}/{blob.name}"
        async with blob_gate:
            tasks = [asyncio.ensure_future(encode_one(ci)) for ci in blob.chunks]
            try:
                if len(tasks) == 1:
                    used, stored, crc, held = await tasks[0]
                    try:
                        await store.put(key, stored)
                    finally:
                        await budget.release(held)
                    c = plan.chunks[blob.chunks[0]]
                    entries[blob.chunks[0]] = ChunkEntry(
                        bi, 0, len(stored), c.raw_offset, c.raw, used, crc, c.group
                    )
                    sizes[bi] = len(stored)
                    return
                if all(plan.chunks[ci].codec == "raw" for ci in blob.chunks):
                    sizes[bi] = await write_raw_blob(key, blob.chunks, tasks)
                    return
                writer = await store.open_writer(key)
                async with writer:
                    pos = 0
                    for ci, task in zip(blob.chunks, tasks, strict=True):
                        used, stored, crc, held = await task
                        try:
                            pad = -pos % ALIGN
                            if pad:
                                await writer.write(bytes(pad))
                                pos += pad
                            await writer.write(stored)
                        finally:
                            await budget.release(held)
                        c = plan.chunks[ci]
                        entries[ci] = ChunkEntry(
                            bi, pos, len(stored), c.raw_offset, c.raw, used, crc, c.group
                        )
                        pos += len(stored)
                sizes[bi] = pos
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    try:
        results = await asyncio.gather(
            *(write_blob(i) for i in range(len(plan.blobs))), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        by_storage: list[list[ChunkEntry]] = [[] for _ in plan.storages]
        for ci, c in enumerate(plan.chunks):
            by_storage[c.storage].append(entries[ci])
        storages = [
            StorageEntry(nbytes=sp.nbytes, device=sp.device, chunks=tuple(by_storage[si]))
            for si, sp in enumerate(plan.storages)
        ]
        manifest = Manifest(
            generation=gen,
            tree=plan.tree,
            tensors=plan.tensors,
            storages=tuple(storages),
            blobs=tuple(BlobEntry(b.name, sizes[i]) for i, b in enumerate(plan.blobs)),
            created=time.time(),
            writer=f"fmstore {__version__}{writer_node()}",
            pickled=plan.pickled,
        )
        # create unless the caller asked to overwrite: a save never replaces another by accident
        await commit_manifest(store, manifest.dumps(), "replace" if options.overwrite else "create")
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.shield(_delete_generation(store, gen))
        raise
    if old_gen and old_gen != gen:
        with contextlib.suppress(Exception):
            await _delete_generation(store, old_gen)
    return manifest


async def _current_generation(store: Store) -> str | None:
    from .commit import read_manifest

    try:
        return (await read_manifest(store)).generation
    except (NotFound, CorruptData):
        return None


async def _delete_generation(store: Store, gen: str) -> None:
    keys = await store.list_keys(gen + "/")
    await store.delete_many(keys)
    local = store.local_path(f"{gen}/x")
    if local is not None:
        # A write that failed before its first blob landed leaves an empty directory that
        # no delete prunes; object stores have no directories.
        path = os.path.dirname(local)
        with contextlib.suppress(OSError):
            await runtime.to_io(os.rmdir, path)
