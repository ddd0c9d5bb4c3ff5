"""Rebuild the catalog from what the tiers hold: a new node, a lost or corrupt catalog.

The catalog is a record of the tiers, never the only truth (see
:mod:`fmstore.tiering.inventory.catalog`), so everything it must know can be found again: a
checkpoint is a ``ROOT/step_SSSSSSSSSSSS/manifest.json`` on some tier (or under the name
the root's declared step pattern gives).  :func:`rediscover`
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

What it finds and does not count is reported (:class:`Rediscovered`'s ``notes``, bounded):
manifests that do not validate, and checkpoints under names fmstore does not count
(:mod:`.foreign`: a native DCP directory, torchtitan's ``step-4``, ...).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ...errors import FmstoreError
from ...format.manifest import DCP_FORMAT_NAME
from ..tiers import CommittedCopy, Tiers
from . import catalog as cat
from .catalog import Catalog, Copy
from .foreign import NotCounted, look

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
    #: What was found and not counted, by the prefix it lies under, bounded: manifests
    #: that do not validate (not fmstore's, damaged, a newer fmstore's, missing blobs) and
    #: checkpoints under names fmstore does not count; apart (``notes.future``), the steps
    #: whose manifests were created in the future (:mod:`.skew`: a clock is off).
    notes: NotCounted = field(default_factory=NotCounted)

    @property
    def not_counted(self) -> dict[str, str]:
        """URL -> why, for each entry listed in :attr:`notes`."""
        return self.notes.flat()

    @property
    def not_counted_more(self) -> dict[str, int]:
        """Prefix -> how many more entries it holds that are not counted, nor listed."""
        return dict(self.notes.more)


async def find_roots(
    tiers: Tiers,
    tier: str,
    *,
    max_depth: int = MAX_ROOT_DEPTH,
    notes: NotCounted | None = None,
) -> set[str]:
    """Run roots on ``tier``: prefixes with at least one step directory below them
    (``step_…``, or named by the root's declared pattern), looked for breadth first down to
    ``max_depth`` levels (never inside a step, nor inside a checkpoint fmstore does not
    count: those are noted in ``notes``, see :func:`.foreign.look`), and every root with a
    declared step pattern."""
    store = tiers.store(tier)
    roots: set[str] = set(tiers.patterns)
    level = [""]
    for _ in range(max_depth + 1):
        nxt: list[str] = []
        for prefix in level:
            seen = await look(store, tier, prefix, tiers.patterns, notes)
            if seen.steps:
                roots.add(prefix.rstrip("/"))
            nxt.extend(f"{prefix}{name}/" for name in seen.dirs)
        level = nxt
        if not level:
            break
    roots.discard("")  # a step directly at a tier's root has no run root: not ours
    return roots


async def survey(tiers: Tiers, ladder: Iterable[str]) -> tuple[NotCounted, dict[str, str]]:
    """What every tier of ``ladder`` holds that fmstore does not count (by name and by
    listing only: no manifest is read, nothing recorded), and the tiers it could not read."""
    notes, unreachable = NotCounted(), {}
    for tier in ladder:
        try:
            await find_roots(tiers, tier, notes=notes)
        except FmstoreError as e:
            unreachable[tier] = str(e)
    return notes, unreachable


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
            tier_roots = (
                want if want is not None else await find_roots(tiers, tier, notes=rep.notes)
            )
            for root in sorted(tier_roots):
                known = _validated_before(catalog, root, tier)
                # a root find_roots found: what its listing shows is noted already
                for step, copy in (
                    await tiers.committed_facts(
                        tier, root, known, rep.notes, listing=want is not None
                    )
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
