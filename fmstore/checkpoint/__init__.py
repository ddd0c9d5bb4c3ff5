"""Checkpoints: ``save`` / ``load`` / ``async_save`` as a ``torch.save`` replacement.

Layers: :mod:`.tree` (state tree <-> JSON), :mod:`.planner` (what to write, pure),
:mod:`.snapshot` (bytes of the storages, staging), :mod:`.writer` (blobs, then the manifest:
the commit), :mod:`.reader` (ranged, checked, parallel reads), :mod:`.loading` (tensors,
lazy mapping), :mod:`.gc` (leftovers of crashed saves).  The format is in ``docs/format.md``.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Eager: these need no torch, and ``gc`` must be the function, not the submodule that
# importing ``fmstore.checkpoint.gc`` would otherwise leave under that name.
from .commit import read_manifest
from .gc import GcReport, agc, find_checkpoints, gc

if TYPE_CHECKING:
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
    from .loading import LazyDict

#: Where each name that loads torch lives, imported on first use: the tiering daemon and
#: the CLI import :mod:`.layout`, :mod:`.gc` or :mod:`.verify` and need no torch.
_HOMES = {
    **dict.fromkeys(
        (
            "SaveHandle",
            "aload",
            "asave",
            "async_save",
            "load",
            "prepare_async_save",
            "read_manifest_sync",
            "save",
            "wait_for_saves",
        ),
        "api",
    ),
    "LazyDict": "loading",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


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
