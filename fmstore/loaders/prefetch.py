"""Background download of a worker's upcoming shards, with bounded concurrency.

Runs in its own small thread pool, beside (not inside) the DataLoader worker's iteration:
the worker reads samples while the next shards arrive.  Every worker on a node prefetches
the same upcoming shards; the cache's per-shard lock makes the first one download each and
the others skip it, so together they spread the downloads.  A prefetch never evicts a
shard needed sooner than the one it fetches, and gives up (for now) when nothing fits.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from collections.abc import Callable


class Prefetcher:
    """Keeps up to ``depth`` shards ahead of the reader downloading, ``concurrency`` at once.

    ``upcoming``: shard ids in the order the reader first needs them; ``fetch(shard)`` does
    one prefetch (returns whether the shard is now cached).  Call :meth:`advance` with the
    index into ``upcoming`` the reader has reached.
    """

    def __init__(
        self, upcoming: list[int], fetch: Callable[[int], bool], *, depth: int, concurrency: int
    ) -> None:
        self.upcoming = upcoming
        self.fetch = fetch
        self.depth = max(0, depth)
        self.pool = cf.ThreadPoolExecutor(
            max(1, concurrency), thread_name_prefix="fmstore-prefetch"
        )
        self.next = 0
        self.lock = threading.Lock()
        self.futures: list[cf.Future[bool]] = []
        self.submitted: set[int] = set()
        self.closed = False

    def advance(self, reached: int) -> None:
        with self.lock:
            if self.closed:
                return
            want = min(len(self.upcoming), reached + 1 + self.depth)
            self.next = max(self.next, reached + 1)
            while self.next < want:
                shard = self.upcoming[self.next]
                self.next += 1
                self._submit(shard)
            self.futures = [f for f in self.futures if not f.done()]

    def ensure(self, shards: list[int]) -> None:
        """Start downloading ``shards`` now (the reader is about to need them)."""
        with self.lock:
            if not self.closed:
                for s in shards:
                    self._submit(s)

    def _submit(self, shard: int) -> None:
        if shard not in self.submitted:
            self.submitted.add(shard)
            self.futures.append(self.pool.submit(self._one, shard))

    def _one(self, shard: int) -> bool:
        if self.closed:
            return False
        try:
            return self.fetch(shard)
        except Exception:  # the reader fetches it itself and reports the error
            return False

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for f in self.futures:
                f.cancel()
        with contextlib.suppress(Exception):
            self.pool.shutdown(wait=True, cancel_futures=True)
