"""DCP's save-plan caching (``DefaultSavePlanner(enable_plan_caching=True)``) with fmstore's
``Writer``.

On a save whose state has the same structure as the last one, each rank sends DCP's
coordinator an empty plan marked unusable, and the coordinator's planner reuses its cached
global plan and metadata; it scatters an empty unusable plan back to a rank whose part did
not change, and that rank's ``finish_plan`` then returns the plan it cached at the last
save, *storage data included*.  Left as is, the Writer would see empty plans in
``prepare_global_plan`` (and check the writes against them in ``finish``) while every rank
writes its cached plan, under the previous save's generation and blob numbers.

:func:`in_force` puts the plan in force back at that point: the coordinator's planner holds
the global plan this save writes (``planner.global_plan``, the cached one when nothing
changed), so every empty entry is replaced by that rank's full plan (with the rank's fresh
node and replica settings, and the items it held before DCP's deduplication as recorded when
that plan was made), marked usable.  Every rank is then handed a full plan with this save's
generation (its ``finish_plan`` caches it in place of the old one), and ``finish`` checks the
writes against the plans written.  The ranks still send empty plans and the coordinator
skips the global planning: the saving is on the gather, which grows with the world size.

Two checks keep a cached plan from being written where it is not the rank's plan:

* DCP compares a rank's new local plan with its cached one by names, offsets and sizes, not
  dtypes: :func:`local_plan` sends the rank's whole plan when its :func:`digest` (dtypes
  included) differs from the cached one's, so a value whose dtype changed is planned again;
* every rank sends the digest of its whole local plan even when the plan is empty (DCP's
  planner drops the empty plans' storage data: :func:`watch` keeps the local plans it is
  given), and :func:`in_force` refuses (before anything is written) when it is not the
  digest of the plan the coordinator cached for that rank.  The two caches fall out of
  step when a save fails on the coordinator after its planner cached the new plans but
  before the ranks took theirs (a refusal to replace a committed checkpoint, a store error
  in ``prepare_global_plan``): the coordinator would then hand a rank the failed save's
  plan.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

from ...errors import FmstoreError
from .nodes import LocalInfo

__all__ = ["digest", "in_force", "local_plan", "note_written", "watch", "written"]

#: generations this process wrote (most recent last, bounded): a plan naming one again is a
#: stale cached plan, whichever Writer gets it
_written: dict[str, None] = {}
_KEEP = 4096


def digest(items: Sequence[WriteItem]) -> str:
    """What a plan writes, as a short hash: every item's type, index, and its tensor's
    dtype, size and chunk (where DCP's own comparison leaves the dtype out)."""
    h = hashlib.blake2b(digest_size=16)
    for wi in items:
        td = wi.tensor_data
        ix = wi.index
        t = (
            (td.properties.dtype, tuple(td.size), tuple(td.chunk.offsets), tuple(td.chunk.sizes))
            if td
            else None
        )
        h.update(repr((wi.type, ix.fqn, tuple(ix.offset or ()), ix.index, t)).encode())
    return h.hexdigest()


def local_plan(plan: SavePlan, planner: Any) -> tuple[SavePlan, str]:
    """The local plan a rank sends and the digest of its whole plan ("" when ``planner``
    does not cache plans, or when plan caching left ``plan`` empty and ``planner`` does not
    say what it holds)."""
    if plan.usable and not getattr(planner, "_enable_plan_caching", False):
        return plan, ""
    if plan.usable:
        return plan, digest(plan.items)
    full = getattr(planner, "plan", None)
    if not isinstance(full, SavePlan) or not full.usable:
        return plan, ""
    d = digest(full.items)
    key = getattr(planner, "_cached_plans_key", None)
    cached = SavePlanner._cached_save_plan.get(key) if isinstance(key, str) else None
    if cached is None or digest(cached.items) != d:
        return full, d  # not the plan DCP cached (a dtype changed): plan it again
    return plan, d


def watch(planner: Any) -> None:
    """Make the coordinator's ``planner`` keep the local plans its ``create_global_plan`` is
    given (as ``planner._fmstore_local_plans``), when it caches plans; :func:`in_force`
    takes the wrapper off again."""
    if not getattr(planner, "_enable_plan_caching", False) or "_fmstore_watched" in vars(planner):
        return
    create = planner.create_global_plan

    def create_global_plan(all_plans: list[SavePlan]) -> Any:
        planner._fmstore_local_plans = list(all_plans)
        return create(all_plans)

    planner.create_global_plan = create_global_plan
    planner._fmstore_watched = True


def in_force(plans: list[SavePlan], planner: Any) -> list[SavePlan]:
    """``plans`` (DCP's global plan, maybe with empty unusable entries from plan caching)
    with every entry the full, usable plan of that rank for this save."""
    local: list[SavePlan] = []
    if planner is not None and "_fmstore_watched" in vars(planner):
        local = vars(planner).pop("_fmstore_local_plans", None) or []
        for name in ("create_global_plan", "_fmstore_watched"):
            vars(planner).pop(name, None)  # a planner that pickles as before
    if all(p.usable for p in plans):
        return plans
    full = getattr(planner, "global_plan", None) if planner is not None else None
    if not isinstance(full, list) or len(full) != len(plans) or len(local) != len(plans):
        raise FmstoreError(
            "this save's plans were cached by its planner (enable_plan_caching=True), but "
            "fmstore's Writer cannot see the cached plans: give it the planner too "
            "(Writer(uri, planner=p) with dcp.save(..., planner=p)), or save with "
            "fmstore.checkpoint.dcp.save / async_save(..., planner=p)"
        )
    out = []
    for p, f, lp in zip(plans, full, local, strict=True):
        if p.usable:
            out.append(p)
            continue
        if not isinstance(f, SavePlan) or not f.usable:
            raise FmstoreError("the planner's cached global plan has no plan for every rank")
        now, then = lp.storage_data, f.storage_data
        if not isinstance(now, LocalInfo) or not isinstance(then, LocalInfo):
            raise FmstoreError("a cached save plan carries no fmstore storage data")
        if not now.digest or now.digest != then.digest:
            raise FmstoreError(
                f"rank {len(out)} reuses its cached save plan, but the coordinator's planner "
                "cached another plan for it (a save failed after the coordinator planned "
                "it?); not writing.  Every later save of this structure with this planner "
                "class is refused alike: save with a planner that does not cache plans, or "
                "with a DefaultSavePlanner subclass of another name (DCP keys its cache by "
                "class name)"
            )
        out.append(replace(f, storage_data=replace(now, items=then.items), usable=True))
    return out


def written(generation: str) -> bool:
    return generation in _written


def note_written(generation: str) -> None:
    _written[generation] = None
    while len(_written) > _KEEP:
        del _written[next(iter(_written))]
