"""Helpers around DCP checkpoints: inspection, verification and conversion to a whole
(unsharded) state dict.  (``save`` / ``async_save`` / ``load`` are in :mod:`.collective`.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ... import runtime
from ...errors import CorruptData, FmstoreError, NotFound
from ...stores import Store
from ..commit import read_bounded_manifest
from ..verify import VerifyResult
from ..verify import verify_checkpoint as verify_store
from .manifest import DCP_FORMAT_NAME, MANIFEST_KEY, DcpManifest, sniff_format
from .native import NativeCheckpoint, has_native_metadata, read_native
from .reader import Reader, read_manifest

__all__ = [
    "inspect_checkpoint",
    "is_dcp_checkpoint",
    "load_full_state_dict",
    "to_torch_save",
    "verify_checkpoint",
]


def _open(uri: str, store_options: dict[str, Any]) -> Store:
    """The store at ``uri`` for reading (a missing local directory is NotFound, not made)."""
    return Reader(uri, store_options=store_options).store


def is_dcp_checkpoint(uri: str, **store_options: Any) -> bool:
    """Whether ``uri`` holds a committed DCP checkpoint: fmstore's (``manifest.json`` of
    format ``fmstore-dcp``) or one written by torch's ``FileSystemWriter`` (``.metadata``
    and no ``manifest.json``)."""

    async def go() -> bool:
        try:
            store = _open(uri, store_options)
        except NotFound:
            return False
        try:
            data = await read_bounded_manifest(store)
        except NotFound:
            return await has_native_metadata(store)
        finally:
            await store.close()
        return sniff_format(data) == DCP_FORMAT_NAME

    return runtime.run(go())


@dataclass(frozen=True)
class EntryInfo:
    """One state-dict entry of a DCP checkpoint, summed over its saved shards."""

    fqn: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    shards: int
    nbytes: int
    stored: int
    codecs: tuple[str, ...]


async def _read_any(store: Store) -> DcpManifest | NativeCheckpoint:
    """fmstore's manifest, or without one the metadata of torch's own layout."""
    try:
        return await read_manifest(store)
    except NotFound:
        if not await has_native_metadata(store):
            raise
        return await read_native(store)


def inspect_checkpoint(
    uri: str, **store_options: Any
) -> tuple[DcpManifest | NativeCheckpoint, list[EntryInfo]]:
    """The manifest (or a native checkpoint's metadata) and one row per state-dict entry
    (tensors and other values)."""

    async def go() -> DcpManifest | NativeCheckpoint:
        store = _open(uri, store_options)
        try:
            return await _read_any(store)
        finally:
            await store.close()

    m = runtime.run(go())
    if isinstance(m, NativeCheckpoint):
        return m, _native_rows(m)
    rows: dict[str, dict[str, Any]] = {}
    for it in m.items:
        r = rows.setdefault(it.fqn, {"shards": 0, "nbytes": 0, "stored": 0, "codecs": set()})
        r["shards"] += 1
        r["nbytes"] += it.nbytes
        r["stored"] += it.stored_bytes
        r["codecs"].update(c.codec for c in it.chunks)
    out = []
    for fqn, md in m.state_dict_metadata.items():
        r = rows.get(fqn, {"shards": 0, "nbytes": 0, "stored": 0, "codecs": set()})
        out.append(
            EntryInfo(
                fqn=fqn,
                kind=md["type"],
                dtype=md.get("dtype", ""),
                shape=tuple(md.get("size", ())),
                shards=r["shards"],
                nbytes=r["nbytes"],
                stored=r["stored"],
                codecs=tuple(sorted(r["codecs"])),
            )
        )
    return m, out


def _native_rows(ck: NativeCheckpoint) -> list[EntryInfo]:
    rows: dict[str, list[Any]] = {}
    for it in ck.items:
        r = rows.setdefault(it.fqn, [0, 0, 0])
        r[0] += 1
        r[1] += it.nbytes
        r[2] += it.length
    out = []
    for fqn, md in ck.metadata.state_dict_metadata.items():
        shards, nbytes, stored = rows.get(fqn, [0, 0, 0])
        tensor = isinstance(md, TensorStorageMetadata)
        out.append(
            EntryInfo(
                fqn=fqn,
                kind="tensor" if tensor else "bytes",
                dtype=str(md.properties.dtype).removeprefix("torch.") if tensor else "",  # type: ignore[union-attr]
                shape=tuple(md.size) if tensor else (),  # type: ignore[union-attr]
                shards=shards,
                nbytes=nbytes,
                stored=stored,
                codecs=("torch.save",),
            )
        )
    return out


def verify_checkpoint(
    uri: str,
    *,
    progress: Callable[[int], None] | None = None,
    concurrency: int = 8,
    **store_options: Any,
) -> VerifyResult:
    """Read every chunk of every blob and check its CRC32C (the check of
    :func:`fmstore.checkpoint.verify.verify_checkpoint`, on a URI); ``progress(nbytes)``
    after each run of chunks.  Missing or short blobs count as bad, never raise."""

    async def go() -> VerifyResult:
        store = _open(uri, store_options)
        try:
            m = await _read_any(store)
            return await verify_store(store, m, progress=progress, concurrency=concurrency)
        finally:
            await store.close()

    return runtime.run(go())


def load_full_state_dict(
    uri: str | Store,
    *,
    allow_pickle: bool = False,
    verify: bool = True,
    device: torch.device | str | None = None,
    **store_options: Any,
) -> dict[str, Any]:
    """The whole state dict of a DCP checkpoint (fmstore's layout or torch's own) in this
    process, unsharded, on CPU (or with its tensors allocated on ``device`` and filled
    there: through the Reader's ring of pinned bounce buffers for fmstore's layout).
    ``uri`` may be an open store (it is not closed)."""
    # The same private helpers torch's own dcp_to_torch_save uses.
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    if isinstance(uri, Store):
        reader = Reader(uri.url, allow_pickle=allow_pickle, verify=verify)
        reader._store = uri
        uri = uri.url
    else:
        reader = Reader(uri, store_options=store_options, allow_pickle=allow_pickle, verify=verify)
    # Read (and check) the manifest here: DCP folds a failed read_metadata into an
    # AssertionError that no longer says what was wrong.
    reader.read_metadata()
    try:
        _load_state_dict(
            sd,
            storage_reader=reader,
            planner=_onto(device)(),
            no_dist=True,
        )
    except CheckpointException as e:
        # One process, one rank: its fmstore error is the error (DCP wraps it for ranks).
        # Anything else failed in DCP's planner on metadata read from the checkpoint.
        for exc, _trace in e.failures.values():
            if isinstance(exc, FmstoreError):
                raise exc from None
        why = "; ".join(f"{type(x).__name__}: {x}" for x, _t in e.failures.values())
        raise CorruptData(
            f"checkpoint {uri} does not load: its metadata is unusable ({why[:300]})",
            key=MANIFEST_KEY,
        ) from None
    return sd


def _onto(device: torch.device | str | None) -> Any:
    """torch's planner that rebuilds a whole state dict from the metadata, with its tensors
    allocated on ``device`` (torch's own allocates them on the CPU)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        _EmptyStateDictLoadPlanner,
    )
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if device is None:
        return _EmptyStateDictLoadPlanner

    class OntoDevice(_EmptyStateDictLoadPlanner):  # type: ignore[misc]
        def set_up_planner(
            self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
        ) -> None:
            assert not state_dict and metadata is not None
            for k, v in metadata.state_dict_metadata.items():
                if isinstance(v, TensorStorageMetadata):
                    v = torch.empty(v.size, dtype=v.properties.dtype, device=device)
                if metadata.planner_data is not None and k in metadata.planner_data:
                    set_element(state_dict, metadata.planner_data[k], v)
                else:
                    state_dict[k] = v
            DefaultLoadPlanner.set_up_planner(self, state_dict, metadata, is_coordinator)

    return OntoDevice


def to_torch_save(uri: str, path: str, **store_options: Any) -> None:
    """Write a DCP checkpoint as one ``torch.save`` file (like ``dcp_to_torch_save``)."""
    torch.save(load_full_state_dict(uri, **store_options), path)
