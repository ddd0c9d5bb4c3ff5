"""Checking every chunk of a checkpoint against its CRC32C without decoding it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from .. import runtime
from ..errors import FmstoreError
from ..format.checksum import crc32c
from ..format.manifest import Manifest
from ..stores.base import Store


@dataclass(frozen=True)
class BadChunk:
    tensor: str
    blob: str
    offset: int
    reason: str


async def verify_checkpoint(
    store: Store,
    manifest: Manifest,
    *,
    progress: Callable[[int], None] | None = None,
    concurrency: int = 16,
) -> list[BadChunk]:
    """Read every chunk and compare its checksum; returns the bad ones (empty: all good).
    ``progress(n)`` is called with the stored bytes of each chunk checked."""
    names: dict[int, str] = {}
    for t in manifest.tensors:
        names.setdefault(t.storage, t.name)
    gate = asyncio.Semaphore(concurrency)
    bad: list[BadChunk] = []

    async def one(si: int, ci: int) -> None:
        c = manifest.storages[si].chunks[ci]
        key = manifest.blob_key(c.blob)
        async with gate:
            try:
                data = await store.get_range(key, c.offset, c.offset + c.length)
                got = await runtime.to_cpu(crc32c, data)
                if got != c.crc32c:
                    bad.append(
                        BadChunk(
                            names.get(si, f"<storage {si}>"), key, c.offset, "checksum mismatch"
                        )
                    )
            except FmstoreError as e:
                bad.append(BadChunk(names.get(si, f"<storage {si}>"), key, c.offset, e.message))
        if progress is not None:
            progress(c.length)

    await asyncio.gather(
        *(one(si, ci) for si, s in enumerate(manifest.storages) for ci in range(len(s.chunks)))
    )
    return sorted(bad, key=lambda b: (b.blob, b.offset))
