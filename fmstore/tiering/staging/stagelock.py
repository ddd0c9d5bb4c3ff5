"""One stage at a time into a destination, per node.

Two identical ``fmstore stage`` runs at once would share one resume journal and write the
same files, parts and temporary names, each undoing the other's work (the second failed
with a false "no such object").  So a stage holds a lock on its destination for as long as
it writes there, and a second one waits until the first is done, then plans afresh (and
finds the files already there).

Shards of one stage (``--shard K/N``, or one process per task of an ``srun`` step) write
disjoint files and run side by side: an unsharded stage takes the destination's lock
exclusively; a shard takes it shared, plus the lock of its own shard exclusively.  So two
runs of the same shard wait for each other, and a whole stage waits for every shard (and
the other way round).

The locks are ``flock`` s on files under ``<state_dir>/stage-locks/`` (released by the
kernel when a process dies): they order the stages of one node.  Nodes do not see each
other's state directories; stages into one shared directory from several nodes are
sharded by the caller (``--shard``), as the docs say.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
from collections.abc import Callable

from ...stores import Location

#: How often a waiting stage tries the lock again (it waits for a whole copy: the cost of
#: polling is nothing beside it, and unlike a blocking flock it can be interrupted).
POLL_SECONDS = 0.2


def destination_id(dst_url: str) -> str:
    """The destination as every spelling of it resolves (``nvme:ds`` and the directory
    behind it are one destination)."""
    loc = Location.parse(dst_url)
    if loc.local_root is not None:
        return "file://" + os.path.realpath(loc.local_root)
    base = loc.base.rstrip("/")
    return f"{base}/{loc.sub.strip('/')}" if loc.sub.strip("/") else base


class DestinationLock:
    """Held locks of one stage; :meth:`release` (or process death) lets the next one in."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = fds

    def release(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the descriptor drops its flock
        self._fds = []


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except PermissionError:  # another user's lock in a shared state directory: flock works
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)


def _try(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _note_pid(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode().strip())
        if pid > 0:
            return f" (pid {pid})"
    return ""


async def lock_destination(
    state_dir: str,
    dst_url: str,
    shard: tuple[int, int] | None,
    *,
    on_wait: Callable[[str], None] | None = None,
) -> DestinationLock:
    """Take the locks of a stage into ``dst_url`` (``shard``: this process's shard, None
    for the whole source), waiting while another stage holds them; ``on_wait`` is told
    once, with a sentence saying who is waited for."""
    dest = destination_id(dst_url)
    digest = hashlib.sha256(dest.encode()).hexdigest()[:24]
    directory = os.path.join(state_dir, "stage-locks")
    os.makedirs(directory, exist_ok=True)
    sharded = shard is not None and shard[1] > 1
    wanted = [
        (os.path.join(directory, f"{digest}.lock"), fcntl.LOCK_SH if sharded else fcntl.LOCK_EX)
    ]
    if sharded:
        assert shard is not None
        wanted.append(
            (os.path.join(directory, f"{digest}.{shard[0]}-{shard[1]}.lock"), fcntl.LOCK_EX)
        )
    held: list[int] = []
    told = False
    try:
        for path, how in wanted:
            fd = _open(path)
            held.append(fd)
            while not _try(fd, how):
                if not told and on_wait is not None:
                    told = True
                    what = "another stage"
                    if len(held) == 2 and shard is not None:
                        what = f"another run of shard {shard[0]}/{shard[1]}"
                    if how == fcntl.LOCK_EX and len(held) == 1 and _try(fd, fcntl.LOCK_SH):
                        fcntl.flock(fd, fcntl.LOCK_UN)
                        what, who = "sharded stages are", ""
                    else:
                        who = _holder(fd) + " is"
                    on_wait(
                        f"{what}{who} writing into {dest} on this node: waiting until "
                        f"{'they are' if who == '' else 'it is'} done (two copies into one "
                        "destination would undo each other's work)"
                    )
                await asyncio.sleep(POLL_SECONDS)
            if how == fcntl.LOCK_EX:
                _note_pid(fd)
    except BaseException:
        DestinationLock(held).release()
        raise
    return DestinationLock(held)
