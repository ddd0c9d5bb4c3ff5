"""A checkpoint's commit: its manifest, written last, and read back bounded.

A prefix holds a checkpoint once its ``manifest.json`` is there (docs/architecture.md, "One
commit convention on every tier"); every writer of one, whatever copies or saves it, goes
through :func:`commit_manifest`, and every read of one through :func:`read_bounded_manifest`
(the bytes, errors as :func:`~fmstore.stores.bounded.read_bounded` raises them) or
:func:`manifest_bytes` (the same, said as "no checkpoint here" / "not a valid checkpoint").

Both formats' manifests are read and written alike; parsing a DCP one needs torch, so
:func:`~fmstore.checkpoint.verify.read_committed` (either format) stays above this module.
"""

from __future__ import annotations

from typing import Literal

from ..errors import AlreadyExists, CorruptData, NotFound
from ..format.manifest import MANIFEST_KEY, Manifest
from ..stores.base import PutOptions, Store
from ..stores.bounded import manifest_limit, read_bounded

__all__ = [
    "CommitMode",
    "commit_manifest",
    "manifest_bytes",
    "read_bounded_manifest",
    "read_manifest",
    "read_manifest_bytes",
]

#: How :func:`commit_manifest` treats a manifest already at the key.
CommitMode = Literal["create", "same-or-fail", "replace"]


async def commit_manifest(
    store: Store, data: bytes, how: CommitMode, *, crc: int | None = None
) -> None:
    """Write ``data`` as the manifest at ``store``'s root: the commit.

    ``how``: ``"create"`` raises :class:`AlreadyExists` when a manifest is there;
    ``"same-or-fail"`` does too unless that manifest holds exactly these bytes (read back
    bounded: committed already, nothing is written); ``"replace"`` overwrites any manifest
    there.  ``crc``: the CRC32C of ``data`` when the caller has it, for the store to check
    (:attr:`~fmstore.stores.types.PutOptions.content_crc32c`)."""
    if how == "replace":
        await store.put(MANIFEST_KEY, data, PutOptions(content_crc32c=crc))
        return
    try:
        await store.put(MANIFEST_KEY, data, PutOptions(mode="create", content_crc32c=crc))
    except AlreadyExists:
        if how == "create" or await read_bounded_manifest(store) != data:
            raise


async def read_bounded_manifest(store: Store, key: str = MANIFEST_KEY) -> bytes:
    """The bytes of the manifest at ``key`` of ``store``, read bounded by
    :func:`~fmstore.stores.bounded.manifest_limit`; NotFound and CorruptData as
    :func:`~fmstore.stores.bounded.read_bounded` raises them."""
    return await read_bounded(store, key, manifest_limit(), what="manifest")


async def manifest_bytes(store: Store) -> bytes:
    """The bytes of the committed manifest at ``store``'s root, of either format; NotFound
    (saying so) when the prefix holds no checkpoint."""
    try:
        return await read_bounded_manifest(store)
    except NotFound:
        raise NotFound(
            f"no checkpoint at {store.url} (no {MANIFEST_KEY})", tier=store.tier, key=MANIFEST_KEY
        ) from None
    except CorruptData as e:  # refused as read (too big, not JSON text): said as the parse says it
        raise CorruptData(f"not a valid checkpoint: {e.message}", tier=e.tier, key=e.key) from None


async def read_manifest_bytes(store: Store) -> tuple[bytes, Manifest]:
    """The committed manifest of the checkpoint at ``store``'s root, with its bytes (their
    CRC32C is what the catalog records); NotFound when the prefix holds no checkpoint,
    CorruptData when the manifest does not parse."""
    data = await manifest_bytes(store)
    return data, Manifest.loads(data, where=store.url)


async def read_manifest(store: Store) -> Manifest:
    """The committed manifest; NotFound when the prefix holds no checkpoint."""
    return (await read_manifest_bytes(store))[1]
