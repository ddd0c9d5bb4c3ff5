"""What a deletion by hand (``fmstore rm``) does to the checkpoints the catalog tracks.

``fmstore rm -r nvme:`` deletes whatever is on the tier, committed checkpoints included; the
catalog would go on calling them ``present`` (``ckpt list``, restores, retention and exports
all read it).  So before deleting, :func:`tracked_copies` finds the copies the catalog
tracks under the objects to go (for the confirmation and ``--dry-run``), and afterwards
:func:`record_removed` makes the catalog true again: a copy deleted whole is ``deleted``
(no policy re-creates it: it was deleted on purpose), a copy that lost only some of its
objects is ``missing`` (an export from another tier repairs it, as after a failed
restore).

A location names a tier when it is ``TIER:path`` or lies inside a tier's directory or
bucket prefix (``/local/nvme/runs`` is ``nvme:runs``).  Nothing is done without a catalog
(a node where no checkpoint manager or daemon ever ran), and nothing creates one.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ...config import Config, get_config
from ...stores import Location
from . import catalog as cat
from .foreign import step_key, step_patterns


@dataclass(frozen=True)
class TrackedCopy:
    """A copy the catalog tracks that a deletion reaches: ``whole`` when every object of
    it goes, ``only_copy`` when no other tier holds a complete copy of the checkpoint."""

    root: str
    step: int
    tier: str
    state: str
    whole: bool
    only_copy: bool

    def describe(self) -> str:
        what = "" if self.whole else ", some of its objects"
        last = "; the only copy" if self.only_copy else ""
        return f"{self.root} step {self.step} on {self.tier} ({self.state}{what}{last})"


def tier_prefix(url: str, config: Config) -> tuple[str, str] | None:
    """``(tier, prefix on the tier)`` for a location on a configured tier, else None."""
    loc = Location.parse(url, config)
    if loc.tier is not None:
        return loc.tier, loc.sub.strip("/")
    for name, t in config.tiers.items():
        tloc = Location.parse(t.url, config)
        if loc.local_root is not None and tloc.local_root is not None:
            here, base = os.path.realpath(loc.local_root), os.path.realpath(tloc.local_root)
        elif loc.local_root is None and tloc.local_root is None and loc.scheme == tloc.scheme:
            here, base = loc.base.rstrip("/"), tloc.base.rstrip("/")
        else:
            continue
        if here == base:
            return name, ""
        if here.startswith(base + "/"):
            return name, here[len(base) + 1 :].strip("/")
    return None


def _catalog(config: Config) -> cat.Catalog | None:
    if not os.path.exists(os.path.join(config.state_dir, cat.DB_NAME)):
        return None
    return cat.Catalog.for_state_dir(config.state_dir)


def tracked_copies(
    url: str, keys: Sequence[str], *, recursive: bool, config: Config | None = None
) -> list[TrackedCopy]:
    """The tracked copies that deleting ``keys`` (relative to ``url``; ``[""]`` for the
    object ``url`` itself) reaches.  ``recursive``: ``url`` is a prefix deleted whole."""
    config = config or get_config()
    where = tier_prefix(url, config)
    if where is None:
        return []
    tier, prefix = where
    catalog = _catalog(config)
    if catalog is None:
        return []
    try:
        full = sorted(f"{prefix}/{k}".strip("/") if k else prefix for k in keys)
        out: list[TrackedCopy] = []
        patterns = step_patterns(config)
        for c in catalog.copies(tier=tier, states=cat.HOLDS_BYTES):
            ck = step_key(patterns, c.root, c.step)
            i = bisect.bisect_left(full, ck + "/")
            if i == len(full) or not full[i].startswith(ck + "/"):
                continue  # nothing of it goes
            whole = recursive and (not prefix or ck == prefix or ck.startswith(prefix + "/"))
            others = [
                o
                for o in catalog.copies(c.root, step=c.step, states=[cat.PRESENT])
                if o.tier != tier
            ]
            out.append(TrackedCopy(c.root, c.step, tier, c.state, whole, not others))
        return out
    finally:
        catalog.close()


def record_removed(copies: Sequence[TrackedCopy], *, config: Config | None = None) -> None:
    """After the deletion: each copy is ``deleted`` (whole) or ``missing`` (in part)."""
    if not copies:
        return
    catalog = _catalog(config or get_config())
    if catalog is None:
        return
    try:
        for c in copies:
            if c.whole:
                catalog.set_copy(c.root, c.step, c.tier, cat.DELETED)
            else:
                catalog.set_copy(
                    c.root, c.step, c.tier, cat.MISSING, error="objects deleted by fmstore rm"
                )
    finally:
        catalog.close()
