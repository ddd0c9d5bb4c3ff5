"""Rebuild the catalog from what the tiers hold: a new node, a lost or corrupt catalog.

The catalog is a record of the tiers, never the only truth (see
:mod:`fmstore.tiering.catalog`), so everything it must know can be found again: a
checkpoint is a ``ROOT/step_SSSSSSSSSSSS/manifest.json`` on some tier.  :func:`rediscover`
is the one scan that ``CheckpointManager`` (its own root), ``fmstore daemon`` (every root
of every tier, at start-up) and ``fmstore ckpt list`` use.

What it records: each committed copy the catalog does not know, or knows in a state a
validated manifest contradicts (``writing``: a save that committed but died before
recording it; ``deleted``, ``released``, ``missing``, ``superseded``), becomes ``present``
(:func:`record_found`, the one repair the daemon's reconcile step makes too); a checkpoint
new to the catalog is
recorded with the earliest commit time found on any tier as its creation time, steps in
ascending order (a sharded checkpoint's: the creation time its global manifest records, the
same on every node).  Known copies are left alone, so running it again changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .. import keys as _keys
from ..checkpoint.layout import parse_step
from ..errors import FmstoreError, NotFound
from ..format.manifest import DCP_FORMAT_NAME
from . import catalog as cat
from .catalog import Catalog, Copy
from .tiers import CommittedCopy, Tiers

#: Copy states that a validated manifest on the tier proves stale.  Not ``exporting``,
#: ``deleting`` or ``corrupt``: their owner (an export, a removal, a verify) decides them.
STALE = (cat.WRITING, cat.DELETED, cat.RELEASED, cat.MISSING, cat.SUPERSEDED)

log = logging.getLogger("fmstore.tiering")

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
    #: Manifests found but not counted as commits (URL -> why): not fmstore's, damaged,
    #: a newer fmstore's, created in the future, or missing blobs.
    not_counted: dict[str, str] = field(default_factory=dict)


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
    found: dict[tuple[str, int], dict[str, CommittedCopy]] = {}
    for tier in ladder:
        try:
            tier_roots = want if want is not None else await find_roots(tiers, tier)
            for root in sorted(tier_roots):
                known = _validated_before(catalog, root, tier)
                for step, copy in (
                    await tiers.committed_facts(tier, root, known, rep.not_counted)
                ).items():
                    found.setdefault((root, step), {})[tier] = copy
        except FmstoreError as e:  # unreachable, or refusing us: the others still count
            rep.unreachable[tier] = str(e)
    rep.roots = sorted(want if want is not None else {r for r, _ in found})
    now = catalog.now()
    for (root, step), on in sorted(found.items()):
        if catalog.checkpoint(root, step) is None:
            times = [c.mtime for c in on.values() if c.mtime is not None]
            first = next(iter(on.values())).facts
            # A sharded checkpoint's global manifest records its creation time, the same
            # on every node and tier, where a manifest's modification time is not (each
            # node writes its copy, each export commits its own): rules by age then
            # decide alike on every node.
            created: float | None = first.created if first.format == DCP_FORMAT_NAME else None
            if not created:
                created = min(times) if times else now
            catalog.record_checkpoint(
                root,
                step,
                created=created,
                bytes=first.stored_bytes,
                manifest_crc32c=first.crc32c,
            )
            rep.checkpoints += 1
        for tier in ladder:
            if tier in on and record_found(catalog, root, step, tier, on[tier]):
                rep.copies += 1
    return rep


def record_found(catalog: Catalog, root: str, step: int, tier: str, copy: CommittedCopy) -> bool:
    """Record that ``(root, step)`` is committed on ``tier`` (``copy``: its validated
    manifest there): a missing or :data:`STALE` row becomes ``present``, others are left
    alone.  A checkpoint recorded before its manifest existed (a save's first row) gets the
    manifest's size and checksum.  Returns whether the row changed."""
    cp = catalog.copy(root, step, tier)
    if cp is not None and cp.state not in STALE:
        return False
    ck = catalog.checkpoint(root, step)
    if ck is not None and ck.manifest_crc32c is None:
        catalog.record_checkpoint(
            root, step, bytes=copy.facts.stored_bytes, manifest_crc32c=copy.facts.crc32c
        )
    changed = catalog.set_copy(
        root, step, tier, cat.PRESENT, bytes=copy.facts.stored_bytes, expect=[None, *STALE]
    )
    if changed and cp is not None and cp.state == cat.WRITING:
        log.info(
            "step %d of %r on %s was committed but recorded as writing: now present",
            step,
            root,
            tier,
            extra={"event": "repaired", "fields": {"root": root, "step": step, "tier": tier}},
        )
    return changed


async def repair_writing(catalog: Catalog, tiers: Tiers) -> list[Copy]:
    """Every copy the catalog has as ``writing`` whose manifest validates on its tier (a
    save or copy that committed, then died before recording it), recorded ``present``
    (:func:`record_found`); the rows repaired.  One read per such row; a read error is
    raised."""
    repaired = []
    for cp in catalog.copies(states=[cat.WRITING]):
        found = await tiers.committed_copy(cp.tier, cp.root, cp.step)
        if found is not None and record_found(catalog, cp.root, cp.step, cp.tier, found):
            repaired.append(cp)
    return repaired


def _validated_before(catalog: Catalog, root: str, tier: str) -> Callable[[int, int], bool]:
    """Whether the catalog knows the copy of ``(root, step)`` on ``tier`` as present with a
    manifest of this checksum: validated (or written) before, so a rescan need not list its
    blobs again."""

    def known(step: int, crc: int) -> bool:
        ck = catalog.checkpoint(root, step)
        cp = catalog.copy(root, step, tier)
        return (
            ck is not None
            and ck.manifest_crc32c == crc
            and cp is not None
            and cp.state == cat.PRESENT
        )

    return known
