"""How a read of chunks is grouped into requests: pure helpers of :mod:`.reader`."""

from __future__ import annotations

from typing import TypeVar

from ...format.manifest import ChunkEntry
from ...stores import Store
from .manifest import DcpItem, DcpManifest

__all__ = ["coalesce", "direct_runs", "has_local_files"]

T = TypeVar("T")


def has_local_files(store: Store, manifest: DcpManifest) -> bool:
    """Whether the blobs are files on a local (POSIX) file system."""
    return store.local_root is not None and bool(manifest.blobs)


def direct_runs(jobs: list[tuple[T, ChunkEntry]], max_run: int) -> list[tuple[T, list[ChunkEntry]]]:
    """Merge chunks that follow each other both in their blob and in their target's memory
    into runs of at most ``max_run`` bytes (0: every chunk on its own)."""
    runs: list[tuple[T, list[ChunkEntry]]] = []
    for t, c in sorted(jobs, key=lambda j: (j[1].blob, j[1].offset)):
        if runs:
            rt, run = runs[-1]
            last = run[-1]
            if (
                rt is t
                and last.blob == c.blob
                and last.offset + last.length == c.offset
                and last.raw_offset + last.raw == c.raw_offset
                and c.offset + c.length - run[0].offset <= max_run
            ):
                run.append(c)
                continue
        runs.append((t, [c]))
    return runs


def coalesce(
    keys: list[tuple[int, int]],
    chunk_of: dict[tuple[int, int], tuple[ChunkEntry, DcpItem]],
    gap: int,
    max_request: int,
) -> list[list[tuple[int, int]]]:
    """Group chunk keys (sorted by blob, offset) into ranged requests."""
    groups: list[list[tuple[int, int]]] = []
    for k in keys:
        c = chunk_of[k][0]
        if groups:
            g = groups[-1]
            first, last = chunk_of[g[0]][0], chunk_of[g[-1]][0]
            if (
                g[0][0] == k[0]
                and c.offset - (last.offset + last.length) <= gap
                and c.offset + c.length - first.offset <= max_request
            ):
                g.append(k)
                continue
        groups.append([k])
    return groups
