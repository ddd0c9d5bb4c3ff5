"""Checkpoints: ``save`` / ``load`` / ``async_save`` as a ``torch.save`` replacement.

Layers: :mod:`.tree` (state tree <-> JSON), :mod:`.planner` (what to write, pure),
:mod:`.snapshot` (bytes of the storages, staging), :mod:`.writer` (blobs, then the manifest:
the commit), :mod:`.reader` (ranged, checked, parallel reads), :mod:`.loading` (tensors,
lazy mapping), :mod:`.gc` (leftovers of crashed saves).  The format is in ``docs/format.md``.
"""

from __future__ import annotations

from .api import (
    SaveHandle,
    aload,
    asave,
    async_save,
    load,
    prepare_async_save,
    read_manifest_sync,
    save,
    wait_for_saves,
)
from .gc import GcReport, agc, find_checkpoints, gc
from .loading import LazyDict
from .reader import read_manifest

__all__ = [
    "GcReport",
    "LazyDict",
    "SaveHandle",
    "agc",
    "aload",
    "asave",
    "async_save",
    "find_checkpoints",
    "gc",
    "load",
    "prepare_async_save",
    "read_manifest",
    "read_manifest_sync",
    "save",
    "wait_for_saves",
]
