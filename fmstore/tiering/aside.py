"""Steps moved aside: the newer steps a restore fell back from, out of the way of their redo.

When :meth:`~fmstore.tiering.sharded.ShardedCheckpointManager.restore` falls back to an
older step (a node was replaced and no replica holds its part of the newer steps), every
node still holding a newer step directory on a node-local tier moves it aside, with its
replicas of the other nodes' parts of that step, so that the job's re-save of that step
number commits there again.  A step moved aside is::

    TIER_ROOT/.aside/TOKEN/ROOT/step_N/...            this node's part (and manifest)
    TIER_ROOT/.aside/TOKEN/.replicas/ROOT/step_N/...  its replicas of other nodes' parts

``TOKEN`` is ``<unix milliseconds>-<random hex>``.  Restore, export, retention and the
catalog's rescan look only under the run's root and its ``.replicas`` (a name that starts
with a dot is never a run), so they skip it; the orphan sweep removes a ``TOKEN``
directory once its time is older than the grace period (:func:`moved_aside`).

Why a crash at any point is safe (``docs/distributed.md``, "Steps moved aside"): the only
change to a step directory is one ``rename`` of the whole directory, atomic on a POSIX
file system, made durable by an fsync of both parents; before it the step is where it
was (the next restore falls back again, as nothing has become more readable, and moves it
again), after it the step is wholly aside.  The catalog rows go first (the node's
daemon starts no new export of the step) and an export of it under way on this node is
waited for before the rename, so no export reads a directory being moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable

from ..checkpoint.layout import REPLICA_PREFIX, parse_step, step_name
from ..errors import FmstoreError
from ..stores.base import Store
from ..stores.posix_io import fsync_dir, tree_bytes
from .journal import live_destinations

__all__ = [
    "ASIDE_PREFIX",
    "move_aside",
    "moved_aside",
    "newer_steps",
    "remove",
    "wait_for_exports",
]

#: The directory of a node-local tier that holds the steps moved aside.
ASIDE_PREFIX = ".aside"
_TOKEN_RE = re.compile(r"^([0-9]{13})-[0-9a-f]{8}$")
#: how often this node's exports are looked at again while one of a step is under way,
#: and for how long at most (seconds)
EXPORT_POLL = 0.5
EXPORT_WAIT = 600.0


def _tier_root(store: Store, tier: str) -> str:
    root = store.local_root
    if root is None:
        raise FmstoreError(
            f"tier {tier!r} is node-local but not a POSIX directory: the steps a restore "
            "fell back from cannot be moved aside there (remove them, then restart)",
            tier=tier,
        )
    return root


def newer_steps(store: Store, tier: str, run: str, than: int) -> list[int]:
    """The steps above ``than`` whose directory (own part or replica) this node holds
    of ``run`` on ``tier`` (``store``: its root)."""
    base = _tier_root(store, tier)
    found: set[int] = set()
    for where in (os.path.join(base, run), os.path.join(base, REPLICA_PREFIX, run)):
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(where) as it:
            for e in it:
                s = parse_step(e.name)
                if s is not None and s > than and e.is_dir(follow_symlinks=False):
                    found.add(s)
    return sorted(found)


def move_aside(store: Store, tier: str, run: str, steps: Iterable[int]) -> str | None:
    """Move this node's directories of ``steps`` of ``run`` (its part, its replicas) into
    one new ``.aside/TOKEN`` directory of ``tier``; returns it (None: nothing to move)."""
    base = _tier_root(store, tier)
    moves = []
    for s in steps:
        for sub in (run, f"{REPLICA_PREFIX}/{run}"):
            src = os.path.join(base, sub, step_name(s))
            if os.path.isdir(src) and not os.path.islink(src):
                moves.append((sub, src))
    if not moves:
        return None
    token = f"{int(time.time() * 1000):013d}-{secrets.token_hex(4)}"
    dest = os.path.join(base, ASIDE_PREFIX, token)
    for sub, src in moves:
        parent = os.path.join(dest, sub)
        os.makedirs(parent, exist_ok=True)
        # one atomic rename of the whole step directory, durable with both parents (and
        # the directories made for it, up to the tier's root)
        os.rename(src, os.path.join(parent, os.path.basename(src)))
        fsync_dir(os.path.dirname(src))
        d = parent
        while d != base:
            fsync_dir(d)
            d = os.path.dirname(d)
    fsync_dir(base)
    return dest


def _under(url: str, dests: Iterable[str]) -> str | None:
    return next((d for d in dests if url == d or url.startswith(d + "/")), None)


async def wait_for_exports(
    state_dir: str, dests: Iterable[str], *, limit: float = EXPORT_WAIT
) -> None:
    """Until no copy on this node writes under ``dests`` (the URLs of the steps' prefixes
    on the shared tiers): an export in progress holds its journal's lock
    (:func:`fmstore.tiering.journal.live_destinations`), dropped when it ends or its process
    dies.  Raises :class:`FmstoreError` after ``limit`` seconds."""
    dests = [d.rstrip("/") for d in dests]
    until = time.monotonic() + limit
    while True:
        busy = [u for u in live_destinations(state_dir) if _under(u, dests)]
        if not busy:
            return
        if time.monotonic() > until:
            raise FmstoreError(
                f"an export of a step to move aside is still under way after {limit:.0f} s: "
                f"{busy[0]}"
            )
        await asyncio.sleep(EXPORT_POLL)


def moved_aside(store: Store, *, now: float) -> list[tuple[str, int, float]]:
    """Each ``.aside/TOKEN`` key of ``store`` (a tier's root) with its bytes and its age
    (from ``now``, by the token's time); a name that is not a token is left alone."""
    base = store.local_root
    if base is None:
        return []
    out = []
    where = os.path.join(base, ASIDE_PREFIX)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(where) as it:
        for e in it:
            m = _TOKEN_RE.match(e.name)
            if m is None or not e.is_dir(follow_symlinks=False):
                continue
            size = tree_bytes(e.path)
            out.append((f"{ASIDE_PREFIX}/{e.name}", size, now - int(m.group(1)) / 1000))
    return out


def remove(store: Store, key: str) -> None:
    """Remove ``key`` (a :func:`moved_aside` key) of ``store``; links are removed, never
    followed."""
    base = store.local_root
    if base is None or not _TOKEN_RE.match(key.removeprefix(f"{ASIDE_PREFIX}/")):
        raise ValueError(f"{key!r} is not a step moved aside")
    shutil.rmtree(os.path.join(base, key))
