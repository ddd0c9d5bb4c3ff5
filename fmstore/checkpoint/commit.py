"""A checkpoint's commit: its manifest, written last, and read back bounded.

A prefix holds a checkpoint once its ``manifest.json`` is there (docs/architecture.md, "One
commit convention on every tier"); every writer of one, whatever copies or saves it, goes
through :func:`commit_manifest`.
"""

from __future__ import annotations

from typing import Literal

from ..errors import AlreadyExists
from ..format.manifest import MANIFEST_KEY
from ..stores.base import PutOptions, Store
from ..stores.bounded import manifest_limit, read_bounded

__all__ = ["CommitMode", "commit_manifest"]

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
        if (
            how == "create"
            or await read_bounded(store, MANIFEST_KEY, manifest_limit(), what="manifest") != data
        ):
            raise
