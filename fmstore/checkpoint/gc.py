"""Garbage collection: remove what crashed or superseded saves left behind.

Under a root, an object ``P/GEN/NNNNNN.bin`` (generation and blob names as in
:mod:`.layout`) belongs to the checkpoint at prefix ``P`` only while ``P/manifest.json``
names ``GEN``.  Everything else of that shape is garbage: blobs of a save that never
committed (no manifest at ``P``), and generations an overwrite superseded.  Other objects
are never touched; a manifest that does not parse keeps its prefix untouched.  POSIX temp
files of interrupted writes are removed too.

A generation holding a rank record (``rank-NNNNNN.json``) that no manifest names is a
*pending* part of a sharded checkpoint on a node-local tier: its save may have committed on
another node, whose manifest has not reached this one yet.  It is never garbage here,
however old; only a restore's collective decides about it (``docs/distributed.md``).

``older_than`` protects saves still running: a generation is removed only when it was
started, and last written, at least that many seconds ago.  Never run gc with a small
``older_than`` while a save under the same root may be in progress.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from .. import runtime
from ..format.manifest import MANIFEST_KEY, Manifest
from ..stores import open_store
from ..stores.base import Store
from .layout import BLOB_RE, GENERATION_RE, RANK_RECORD_RE, generation_age


@dataclass
class GcReport:
    checkpoints: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    removed_bytes: int = 0
    young: list[str] = field(default_factory=list)
    #: pending parts (``P/GEN``) of sharded checkpoints on a node-local tier: kept
    pending: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    temp_files: int = 0
    dry_run: bool = False


_Gens = dict[tuple[str, str], list[tuple[str, int, float | None]]]


async def _scan(store: Store) -> tuple[dict[str, str | None], _Gens, set[tuple[str, str]]]:
    manifests: dict[str, str | None] = {}
    gens: _Gens = {}
    pending: set[tuple[str, str]] = set()
    async for m in store.list("", recursive=True):
        if m.is_dir:
            continue
        parts = m.key.split("/")
        if parts[-1] == MANIFEST_KEY:
            manifests["/".join(parts[:-1])] = None
        elif len(parts) >= 2 and BLOB_RE.match(parts[-1]) and GENERATION_RE.match(parts[-2]):
            gens.setdefault(("/".join(parts[:-2]), parts[-2]), []).append((m.key, m.size, m.mtime))
        elif len(parts) >= 2 and RANK_RECORD_RE.match(parts[-1]) and GENERATION_RE.match(parts[-2]):
            pending.add(("/".join(parts[:-2]), parts[-2]))
    for prefix in manifests:
        key = f"{prefix}/{MANIFEST_KEY}" if prefix else MANIFEST_KEY
        try:
            manifests[prefix] = _generation_of(await store.get(key))
        except Exception:
            manifests[prefix] = "?"  # unreadable: keep everything under it
    return manifests, gens, pending


def _generation_of(data: bytes) -> str:
    """The generation a manifest names: single-process or multi-rank (DCP) checkpoint."""
    from .dcp.manifest import DCP_FORMAT_NAME, DcpManifest, sniff_format

    if sniff_format(data) == DCP_FORMAT_NAME:
        return DcpManifest.loads(data).generation
    return Manifest.loads(data).generation


async def find_checkpoints_async(store: Store) -> list[str]:
    manifests, _, _ = await _scan(store)
    return sorted(p for p, g in manifests.items() if g not in (None, "?"))


def find_checkpoints(root: str | Store) -> list[str]:
    """Prefixes (relative to ``root``) of the committed checkpoints under ``root``."""

    async def go() -> list[str]:
        store = root if isinstance(root, Store) else open_store(os.fspath(root))
        try:
            return await find_checkpoints_async(store)
        finally:
            if not isinstance(root, Store):
                await store.close()

    return runtime.run(go())


async def agc(root: str | Store, *, older_than: float = 3600.0, dry_run: bool = False) -> GcReport:
    """Async twin of :func:`gc`."""
    store = root if isinstance(root, Store) else open_store(os.fspath(root))
    try:
        return await _gc(store, older_than, dry_run)
    finally:
        if not isinstance(root, Store):
            await store.close()


@dataclass(frozen=True)
class Generation:
    """A generation no manifest names: its prefix (``P/GEN``), objects, bytes and age (the
    younger of its start and its last write)."""

    where: str
    keys: list[str]
    size: int
    age: float


async def orphan_generations(
    store: Store, pending_out: list[str] | None = None
) -> tuple[list[Generation], list[str], list[str]]:
    """Every generation under ``store`` that no manifest names, and the prefixes of the
    committed checkpoints and of the unreadable manifests (whose generations are kept).
    Pending parts (a rank record, no manifest naming them) are never in the list; their
    ``P/GEN`` are appended to ``pending_out``."""
    manifests, gens, pending = await _scan(store)
    now = time.time()
    out: list[Generation] = []
    for (prefix, gen), objs in sorted(gens.items()):
        current = manifests.get(prefix)
        if current == gen or current == "?":
            continue
        if (prefix, gen) in pending:
            if pending_out is not None:
                pending_out.append(f"{prefix}/{gen}" if prefix else gen)
            continue
        mtimes = [t for _, _, t in objs if t is not None]
        age = (
            min(generation_age(gen, now), now - max(mtimes)) if mtimes else generation_age(gen, now)
        )
        where = f"{prefix}/{gen}" if prefix else gen
        out.append(Generation(where, [k for k, _, _ in objs], sum(n for _, n, _ in objs), age))
    committed = sorted(p for p, g in manifests.items() if g not in (None, "?"))
    unreadable = sorted(p for p, g in manifests.items() if g == "?")
    return out, committed, unreadable


async def _gc(store: Store, older_than: float, dry_run: bool) -> GcReport:
    rep = GcReport(dry_run=dry_run)
    gens, rep.checkpoints, rep.unreadable = await orphan_generations(store, rep.pending)
    doomed: list[str] = []
    for g in gens:
        if g.age < older_than:
            rep.young.append(g.where)
            continue
        doomed += g.keys
        rep.removed_bytes += g.size
    rep.removed = doomed
    if not dry_run:
        await store.delete_many(doomed)
        rep.temp_files = await store.cleanup_temp(older_than)
    return rep


def gc(root: str | Store, *, older_than: float = 3600.0, dry_run: bool = False) -> GcReport:
    """Remove leftovers of crashed or superseded saves under ``root``; see the module doc.

    Returns what was (or, with ``dry_run``, would be) removed and the committed checkpoints
    found.  Committed checkpoints are never touched.
    """
    return runtime.run(agc(root, older_than=older_than, dry_run=dry_run))
