"""Steps moved aside: the newer steps a restore fell back from, out of the way of their redo.

When :meth:`~fmstore.tiering.managers.sharded.ShardedCheckpointManager.restore` falls back to an
older step (a node was replaced and no replica holds its part of the newer steps), every
node still holding a newer step directory on a node-local tier moves it aside, with its
replicas of the other nodes' parts of that step, so that the job's re-save of that step
number commits there again.  A step moved aside is::

    TIER_ROOT/.aside/TOKEN/ROOT/step_N/...            this node's part (and manifest)
    TIER_ROOT/.aside/TOKEN/.replicas/ROOT/step_N/...  its replicas of other nodes' parts

``TOKEN`` is ``<unix milliseconds>-<random hex>``.  The single-node
:class:`~fmstore.tiering.managers.manager.CheckpointManager` moves the newer steps proven damaged on
its POSIX write tier aside the same way after a fallback (:mod:`.redo`).  Restore, export, retention and the
catalog's rescan look only under the run's root and its ``.replicas`` (a name that starts
with a dot is never a run), so they skip it; the orphan sweep removes a ``TOKEN``
directory once its time is older than the grace period (:func:`moved_aside`).

Why a crash at any point is safe (``docs/distributed.md``, "Steps moved aside"): the only
change to a step directory is one ``rename`` of the whole directory, atomic on a POSIX
file system, made durable by an fsync of both parents; before it the step is where it
was (the next restore falls back again, as nothing has become more readable, and moves it
again), after it the step is wholly aside.  The catalog rows go first (the node's
daemon starts no new export of the step), then the step's generations are retired on the
shared tiers (:mod:`.retire`), then the rename: an export of the step still under way
(nothing waits for it) either finds its source gone or is fenced at its commit.

Every path is resolved from a descriptor of the tier's root with no link followed
(:mod:`fmstore.stores.beneath`): listed with ``scandir(fd)``, moved with ``rename`` between
directory descriptors, removed with ``rmtree(dir_fd=)``.  A link where a step's directory,
the run's, ``.replicas`` or ``.aside`` should be refuses the call
(:class:`~fmstore.errors.PermissionDenied`, naming the tier and key) before anything is
moved or removed, and ``.aside`` / ``.replicas`` made by someone else are refused too
(:func:`~fmstore.stores.beneath.shared_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterable, Iterator

from ...checkpoint.layout import GENERATION_RE, REPLICA_PREFIX, parse_step, step_name
from ...errors import FmstoreError, PermissionDenied
from ...stores import beneath
from ...stores.base import Store
from ...stores.posix_io import tree_bytes

__all__ = [
    "ASIDE_PREFIX",
    "move_aside",
    "moved_aside",
    "newer_steps",
    "generations",
    "remove",
]

#: The directory of a node-local tier that holds the steps moved aside.
ASIDE_PREFIX = ".aside"
_TOKEN_RE = re.compile(r"([0-9]{13})-[0-9a-f]{8}")  # whole names only (fullmatch)


def _tier_root(store: Store, tier: str) -> str:
    root = store.local_root
    if root is None:
        raise FmstoreError(
            f"tier {tier!r} is node-local but not a POSIX directory: the steps a restore "
            "fell back from cannot be moved aside there (remove them, then restart)",
            tier=tier,
        )
    return root


@contextlib.contextmanager
def _root_fd(base: str) -> Iterator[int]:
    """The tier's root, open (the operator's path, links and all, as the store opens it);
    everything below it is resolved from this descriptor with no link followed."""
    fd = os.open(base, beneath.DIR_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


def _refused(tier: str, key: str) -> PermissionDenied:
    return PermissionDenied(
        "a symbolic link or a file where a step's directory should be: links inside a tier "
        "are not followed, and nothing there is moved aside or removed",
        tier=tier,
        key=key,
    )


def _open_dir(dir_fd: int, rel: str, tier: str, key: str) -> int | None:
    """Directory ``rel`` beneath ``dir_fd``, open; None when it is not there."""
    try:
        return beneath.open_dir(dir_fd, rel)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refused(tier, key) from None
        raise


def _places(root: int, tier: str, run: str) -> list[tuple[str, int]]:
    """Where this node holds steps of ``run``: (key, open directory) of ``run`` and of
    ``.replicas/run`` (the caller closes them); a link on the way, or a ``.replicas``
    someone else made (:func:`~fmstore.stores.beneath.shared_dir`), raises
    :class:`PermissionDenied`."""
    out: list[tuple[str, int]] = []
    try:
        fd = _open_dir(root, run, tier, run)
        if fd is not None:
            out.append((run, fd))
        reps = beneath.shared_dir(root, REPLICA_PREFIX, tier=tier, create=False)
        if reps is not None:
            key = f"{REPLICA_PREFIX}/{run}"
            try:
                fd = _open_dir(reps, run, tier, key)
            finally:
                os.close(reps)
            if fd is not None:
                out.append((key, fd))
    except BaseException:
        for _k, fd in out:
            os.close(fd)
        raise
    return out


@contextlib.contextmanager
def _held(store: Store, tier: str, run: str) -> Iterator[tuple[int, list[tuple[str, int]]]]:
    with _root_fd(_tier_root(store, tier)) as root:
        places = _places(root, tier, run)
        try:
            yield root, places
        finally:
            for _k, fd in places:
                os.close(fd)


def newer_steps(store: Store, tier: str, run: str, than: int) -> list[int]:
    """The steps above ``than`` whose directory (own part or replica) this node holds
    of ``run`` on ``tier`` (``store``: its root).  A link where a directory of them should
    be raises :class:`PermissionDenied` (the restore then says so on every rank)."""
    found: set[int] = set()
    with _held(store, tier, run) as (_root, places):
        for key, fd in places:
            with os.scandir(fd) as it:
                for e in it:
                    s = parse_step(e.name)
                    if s is None or s <= than:
                        continue
                    if e.is_symlink():
                        raise _refused(tier, f"{key}/{e.name}")
                    if e.is_dir(follow_symlinks=False):
                        found.add(s)
    return sorted(found)


def _made(parent: int, _name: str) -> None:
    os.fsync(parent)


def move_aside(
    store: Store, tier: str, run: str, steps: Iterable[int], *, now: float | None = None
) -> str | None:
    """Move this node's directories of ``steps`` of ``run`` (its part, its replicas) into
    one new ``.aside/TOKEN`` directory of ``tier``; returns it (None: nothing to move).
    ``TOKEN`` starts with ``now`` (the caller's protocol clock, ``Env.now()``; this
    process's clock without one), which the sweep measures the grace period from.
    Every directory is resolved from the tier's root with no link followed: a link in the
    way raises :class:`PermissionDenied` before anything is moved."""
    steps = list(steps)
    with _held(store, tier, run) as (root, places):
        moves: list[tuple[int, str, str]] = []
        for s in steps:
            name = step_name(s)
            for key, fd in places:
                try:
                    mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue
                if stat.S_ISLNK(mode):
                    raise _refused(tier, f"{key}/{name}")
                if stat.S_ISDIR(mode):
                    moves.append((fd, key, name))
        if not moves:
            return None
        at = time.time() if now is None else now
        token = f"{int(at * 1000):013d}-{secrets.token_hex(4)}"
        aside = beneath.shared_dir(root, ASIDE_PREFIX, tier=tier, create=True)
        assert aside is not None
        try:
            os.mkdir(token, dir_fd=aside)
            os.fsync(aside)
            dest = beneath.open_dir(aside, token)
        finally:
            os.close(aside)
        try:
            for fd, key, name in moves:
                # one atomic rename of the whole step directory, durable with both parents
                # (and each directory made for it: make_dirs fsyncs their parents)
                dfd = beneath.make_dirs(dest, key, _made)
                try:
                    os.rename(name, name, src_dir_fd=fd, dst_dir_fd=dfd)
                    os.fsync(fd)
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        finally:
            os.close(dest)
    return os.path.join(_tier_root(store, tier), ASIDE_PREFIX, token)


def generations(store: Store, tier: str, run: str, steps: Iterable[int]) -> dict[int, set[str]]:
    """Step -> the generations this node holds of it on ``tier`` (the directories named as
    generations in its part's directory and in its replicas'), resolved as
    :func:`newer_steps` resolves them (no link followed)."""
    out: dict[int, set[str]] = {}
    with _held(store, tier, run) as (_root, places):
        for s in steps:
            name = step_name(s)
            for key, fd in places:
                sfd = _open_dir(fd, name, tier, f"{key}/{name}")
                if sfd is None:
                    continue
                try:
                    with os.scandir(sfd) as it:
                        for e in it:
                            if GENERATION_RE.match(e.name) and e.is_dir(follow_symlinks=False):
                                out.setdefault(s, set()).add(e.name)
                finally:
                    os.close(sfd)
    return out


def moved_aside(store: Store, *, now: float) -> list[tuple[str, int, float]]:
    """Each ``.aside/TOKEN`` key of ``store`` (a tier's root) with its bytes and its age
    (from ``now``, by the token's time); a name that is not a token, or a link, is left
    alone.  A ``.aside`` that is a link, or someone else's, raises
    :class:`PermissionDenied` (the sweep reports it and removes nothing there)."""
    base = store.local_root
    if base is None:
        return []
    out = []
    with _root_fd(base) as root:
        aside = beneath.shared_dir(root, ASIDE_PREFIX, tier=store.tier, create=False)
        if aside is None:
            return []
        try:
            with os.scandir(aside) as it:
                for e in it:
                    m = _TOKEN_RE.fullmatch(e.name)
                    if m is None or not e.is_dir(follow_symlinks=False):
                        continue
                    size = tree_bytes(e.name, dir_fd=aside)
                    out.append((f"{ASIDE_PREFIX}/{e.name}", size, now - int(m.group(1)) / 1000))
        finally:
            os.close(aside)
    return out


def remove(store: Store, key: str) -> None:
    """Remove ``key`` (a :func:`moved_aside` key) of ``store``, resolved from the tier's
    root with no link followed: links below it are removed, never followed, and a link in
    its place (or ``.aside`` as one) raises :class:`PermissionDenied`."""
    base = store.local_root
    token = key.removeprefix(f"{ASIDE_PREFIX}/")
    if base is None or token == key or not _TOKEN_RE.fullmatch(token):
        raise ValueError(f"{key!r} is not a step moved aside")
    with _root_fd(base) as root:
        aside = beneath.shared_dir(root, ASIDE_PREFIX, tier=store.tier, create=False)
        if aside is None:
            return
        try:
            try:
                mode = os.stat(token, dir_fd=aside, follow_symlinks=False).st_mode
            except FileNotFoundError:
                return
            if not stat.S_ISDIR(mode):
                raise _refused(store.tier, key)
            shutil.rmtree(token, dir_fd=aside)
        finally:
            os.close(aside)
