"""The newer steps a single-node restore fell back from, out of the way of their redo.

When :meth:`~fmstore.tiering.managers.manager.CheckpointManager.restore` (no ``step``) restores step
S while a tier the manager writes to still holds a damaged copy of a newer step N, the
training loop's redo ``save(N)`` would meet that copy's manifest and fail with
:class:`~fmstore.errors.AlreadyExists`, in the background, from ``wait()`` and
``close()``.  So after such a restore every newer step directory on the write tier (and,
with ``[policies] on_full = "fallback"``, on the tiers a save may fall back to) is looked
at, and one is cleared out of the redo's way only when its copy is proven damaged there:

* its load by this restore failed its checksums or missed a blob (``corrupt`` /
  ``missing``), or
* its ``manifest.json`` does not parse (a torn manifest), or
* its catalog row is neither ``present`` nor a save or export under way (``writing``,
  ``exporting``): an earlier restore found it bad, or an earlier redo failed against it,
  so no restore tried it; and
  :func:`~fmstore.checkpoint.verify.verify_checkpoint` finds a problem in it now.

Nothing else moves: a step with no manifest (a save killed before its commit) does not
block the redo (the save writes a new generation beside it; the orphan sweep removes the
old one), a manifest of a newer fmstore (``VersionError``) or of a sharded checkpoint is not
this manager's to judge, and a copy that is committed and valid (one the restore passed
over for a read error, or a verify that finds nothing) stays, so its redo raises as before.

On a POSIX tier a damaged step is moved aside whole (:func:`.aside.move_aside`:
``TIER/.aside/TOKEN/ROOT/step_N``), recoverable until the orphan sweep removes it after
its grace period, as the sharded manager does.  On an object store it is deleted, manifest
first (:func:`~fmstore.tiering.exports.mover.delete_checkpoint`, the path retention and
``fmstore rm`` take), see :func:`_clear`.  Catalog rows go first in both cases: no new
export of the step starts, and an export of it still under way finds its source gone or
fails its verification (the copy is damaged): nothing waits for it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from ... import runtime
from ...checkpoint.verify import read_committed, verify_checkpoint
from ...errors import CorruptData, NotFound, VersionError
from ...format.manifest import Manifest
from ..exports.mover import delete_checkpoint
from ..inventory import aside
from ..inventory import catalog as cat
from ..inventory.catalog import Catalog
from ..policy.policies import Policies
from ..tiers import Tiers

log = logging.getLogger("fmstore.checkpoint")


@dataclass
class Cleared:
    """What :func:`clear_newer` did: per step, where it went and why."""

    moved: dict[int, list[str]] = field(default_factory=dict)  # step -> what was done
    problems: list[str] = field(default_factory=list)  # tiers that could not be looked at

    @property
    def steps(self) -> list[int]:
        return sorted(self.moved)


def write_tiers(policies: Policies) -> list[str]:
    """The tiers a save of this manager may write to: the write tier, and the tiers below
    it with ``on_full = "fallback"``."""
    ladder = list(policies.ladder)
    if policies.write_tier not in ladder:
        return [policies.write_tier]
    start = ladder.index(policies.write_tier)
    return ladder[start:] if policies.on_full == "fallback" else [policies.write_tier]


async def _damage(
    tiers: Tiers, catalog: Catalog, root: str, step: int, tier: str, found: str | None
) -> str | None:
    """Why the copy of ``step`` on ``tier`` is damaged and blocks its redo; None when it
    is not proven so (no manifest, a manifest this manager does not judge, a valid copy).
    A read error is raised (nothing is moved on it)."""
    ckpt = tiers.checkpoint(tier, root, step)
    try:
        _data, manifest = await read_committed(ckpt)
    except NotFound:
        return None  # never committed: does not block the redo
    except VersionError:
        return None  # a newer fmstore's: valid for all this one knows
    except CorruptData as e:
        return f"its manifest does not parse ({e})"
    if not isinstance(manifest, Manifest):
        return None  # a sharded checkpoint: not this manager's
    if found is not None:
        return found  # this restore's load failed its checksums or missed a blob
    row = catalog.copy(root, step, tier)
    if row is not None and row.state == cat.PRESENT:
        return None  # passed over for another reason (a read error): left as it is
    if row is not None and row.state in (cat.WRITING, cat.EXPORTING):
        return None  # a save or an export under way (maybe another process's): theirs
    res = await verify_checkpoint(ckpt, manifest)
    return None if res.ok else "; ".join(res.problems)[:500]


def _clear(
    tiers: Tiers,
    catalog: Catalog,
    root: str,
    tier: str,
    steps: list[int],
) -> str:
    """Take ``steps`` of ``root`` on ``tier`` out of the redo's way; says how."""
    # No new export of them starts (exports start from catalog rows), and the rows of
    # unfinished exports of them go too: their source is going.
    for s in steps:
        for row in catalog.copies(root, step=s):
            if row.tier == tier or row.state == cat.EXPORTING:
                catalog.forget_copy(root, s, row.tier)
    # Nothing waits for an export of them still under way: it finds its source gone, or
    # fails its verification (the copy is proven damaged), so it commits nothing.
    store = tiers.store(tier)
    if store.local_root is not None:
        where = aside.move_aside(store, tier, root, steps, now=tiers.env.now())
        return f"moved aside to {where}"
    # An object store has no rename: moving aside would copy every object to another prefix
    # (the step's size again, in requests and bytes) and nothing sweeps such a prefix on a
    # bucket later (the orphan sweep's ``aside`` kind is POSIX only).  The copy is proven
    # damaged (it cannot be restored as it is), so it is deleted the way retention and
    # ``fmstore rm`` delete a checkpoint: manifest first, so a crash half-way leaves blobs
    # no manifest names (the sweep's ``generation`` kind), never a torn checkpoint.  A
    # versioned bucket still holds the old objects.
    for s in steps:
        runtime.run(delete_checkpoint(tiers.checkpoint(tier, root, s)))
    return f"removed from {store.url} (manifest first)"


def clear_newer(
    tiers: Tiers,
    catalog: Catalog,
    policies: Policies,
    root: str,
    restored: int,
    found: Mapping[tuple[int, str], str],
) -> Cleared:
    """After a restore of ``restored`` that chose the step itself: every step newer than it
    whose copy on a write tier is proven damaged (``found``: (step, tier) -> why this
    restore's load failed there) is moved aside (POSIX) or deleted (object store).  A tier
    that cannot be looked at or cleared is reported in ``problems`` (the restore stands;
    the redo then fails as it would have, and the next restore tries again)."""
    out = Cleared()
    for tier in write_tiers(policies):
        try:
            dirs = runtime.run(tiers.step_dirs(tier, root))
            why: dict[int, str] = {}
            for s in (s for s in dirs if s > restored):
                w = runtime.run(_damage(tiers, catalog, root, s, tier, found.get((s, tier))))
                if w is not None:
                    why[s] = w
            if not why:
                continue
            how = _clear(tiers, catalog, root, tier, sorted(why))
        except Exception as e:  # reported by the caller; the restored state stands
            out.problems.append(f"{tier}: {type(e).__name__}: {e}")
            continue
        for s, w in why.items():
            out.moved.setdefault(s, []).append(f"{tier}: {w}; {how}")
    return out
