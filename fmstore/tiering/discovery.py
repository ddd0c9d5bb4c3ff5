"""Rebuild the catalog from what the tiers hold: a new node, a lost or corrupt catalog.

The catalog is a record of the tiers, never the only truth (see
:mod:`fmstore.tiering.catalog`), so everything it must know can be found again: a
checkpoint is a ``ROOT/step_SSSSSSSSSSSS/manifest.json`` on some tier.  :func:`rediscover`
is the one scan that ``CheckpointManager`` (its own root), ``fmstore daemon`` (every root
of every tier, at start-up) and ``fmstore ckpt list`` use.

What it records: each committed copy the catalog does not know (or knows as ``deleted``,
``released`` or ``missing``) becomes ``present``; a checkpoint new to the catalog is
recorded with the earliest commit time found on any tier as its creation time, steps in
ascending order (a sharded checkpoint's: the creation time its global manifest records, the
same on every node).  Known copies are left alone, so running it again changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .. import keys as _keys
from ..checkpoint.layout import parse_step
from ..errors import FmstoreError, NotFound
from ..stores.bounded import manifest_limit, read_bounded
from . import catalog as cat
from .catalog import Catalog
from .tiers import Tiers

#: How deep below a tier's root run roots are looked for (``team/project/run`` is 3).
MAX_ROOT_DEPTH = 6


@dataclass
class Rediscovered:
    """What a scan found: checkpoints and copies it added to the catalog, the roots it
    looked at, and tiers it could not read (skipped, retried by the next scan)."""

    roots: list[str] = field(default_factory=list)
    checkpoints: int = 0
    copies: int = 0
    unreachable: dict[str, str] = field(default_factory=dict)


async def find_roots(tiers: Tiers, tier: str, *, max_depth: int = MAX_ROOT_DEPTH) -> set[str]:
    """Run roots on ``tier``: prefixes with at least one ``step_…`` directory below them,
    looked for breadth first down to ``max_depth`` levels (never inside a step)."""
    store = tiers.store(tier)
    roots: set[str] = set()
    level = [""]
    for _ in range(max_depth + 1):
        nxt: list[str] = []
        for prefix in level:
            try:
                async for meta in store.list(prefix, recursive=False):
                    if not meta.is_dir:
                        continue
                    name = meta.key[len(prefix) :].rstrip("/")
                    if parse_step(name) is not None:
                        roots.add(prefix.rstrip("/"))
                    elif name and not name.startswith("."):
                        nxt.append(_keys.validate_prefix(prefix + name))
            except NotFound:
                continue
        level = nxt
        if not level:
            break
    roots.discard("")  # a step directly at a tier's root has no run root: not ours
    return roots


async def rediscover(
    catalog: Catalog,
    tiers: Tiers,
    ladder: Iterable[str],
    roots: Iterable[str] | None = None,
) -> Rediscovered:
    """Record in ``catalog`` every committed checkpoint of ``roots`` (default: every root
    found on any tier of ``ladder``) that it does not know as present."""
    ladder = list(ladder)
    rep = Rediscovered()
    want = set(roots) if roots is not None else None
    found: dict[tuple[str, int], dict[str, float | None]] = {}
    for tier in ladder:
        try:
            tier_roots = want if want is not None else await find_roots(tiers, tier)
            for root in sorted(tier_roots):
                for step, mtime in (await tiers.committed_on(tier, root)).items():
                    found.setdefault((root, step), {})[tier] = mtime
        except FmstoreError as e:  # unreachable, or refusing us: the others still count
            rep.unreachable[tier] = str(e)
    rep.roots = sorted(want if want is not None else {r for r, _ in found})
    now = catalog.now()
    for (root, step), on in sorted(found.items()):
        if catalog.checkpoint(root, step) is None:
            times = [t for t in on.values() if t is not None]
            created = await _saved_at(tiers, next(iter(on)), root, step)
            if created is None:
                created = min(times) if times else now
            catalog.record_checkpoint(root, step, created=created)
            rep.checkpoints += 1
        for tier in ladder:
            if tier not in on:
                continue
            cp = catalog.copy(root, step, tier)
            if cp is None or cp.state in (cat.DELETED, cat.RELEASED, cat.MISSING, cat.SUPERSEDED):
                catalog.set_copy(root, step, tier, cat.PRESENT)
                rep.copies += 1
    return rep


async def _saved_at(tiers: Tiers, tier: str, root: str, step: int) -> float | None:
    """The creation time a sharded (DCP) checkpoint's global manifest records: the same on
    every node and tier, where a manifest's modification time is not (each node writes its
    copy, each export commits its own), so that rules by age decide alike on every node.
    None for a single-process checkpoint (its commit time is used) or on any error."""
    import json

    from ..format.manifest import DCP_FORMAT_NAME, MANIFEST_KEY

    try:
        store = tiers.checkpoint(tier, root, step)
        data = await read_bounded(store, MANIFEST_KEY, manifest_limit(), what="manifest")
        if DCP_FORMAT_NAME.encode() not in data:
            return None
        d = json.loads(data)
        created = d.get("created") if isinstance(d, dict) else None
        return float(created) if isinstance(created, int | float) and created > 0 else None
    except (FmstoreError, ValueError, RecursionError):
        return None
