"""Limits that copies and checkpoint writes keep: bandwidth (:class:`TokenBucket`) and
bytes held at once (:class:`ByteBudget`)."""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """A bandwidth limit shared by every transfer: ``acquire(n)`` waits until ``n`` bytes
    may pass at ``rate`` bytes/s (a burst of up to ``burst`` bytes goes at once)."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = burst if burst is not None else max(rate / 10, 1.0)
        self._next = time.monotonic()

    async def acquire(self, n: int) -> None:
        now = time.monotonic()
        # Virtual clock: each grant pushes the next free moment by n / rate; an idle
        # bucket lets the clock lag by at most one burst.
        self._next = max(self._next, now - self.burst / self.rate) + n / self.rate
        delay = self._next - now
        if delay > 0:
            await asyncio.sleep(delay)


class ByteBudget:
    """At most ``limit`` bytes held by copies at once (a single bigger request is let
    through alone, so nothing waits forever)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        return n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()
