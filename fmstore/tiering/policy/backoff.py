"""Back-off per tier: a tier whose actions fail waits on its own, doubling up to a limit,
while the actions on the other tiers go on (one misspelt bucket never holds up Lustre)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


class TierBackoff:
    """For each failing tier, the delay (doubling from 1 s up to ``limit``) and when its
    actions may run again; a success clears it."""

    def __init__(self, limit: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.clock = clock
        self._delay: dict[str, float] = {}
        self._until: dict[str, float] = {}

    def failed(self, tier: str) -> float:
        """Record a failure on ``tier``; returns its new delay."""
        delay = min(max(1.0, self._delay.get(tier, 0.0) * 2), self.limit)
        self._delay[tier] = delay
        self._until[tier] = self.clock() + delay
        return delay

    def succeeded(self, tiers: Iterable[str | None]) -> None:
        for t in tiers:
            if t is not None:
                self._delay.pop(t, None)
                self._until.pop(t, None)

    def waiting(self, tiers: Iterable[str | None]) -> bool:
        """Whether any of ``tiers`` is still backing off."""
        now = self.clock()
        return any(t is not None and self._until.get(t, 0.0) > now for t in tiers)

    def next_due(self) -> float | None:
        """Seconds until the first backing-off tier may run again; None when none waits."""
        now = self.clock()
        left = [u - now for u in self._until.values() if u > now]
        return max(0.0, min(left)) if left else None

    @property
    def largest(self) -> float:
        """The longest current delay (0 when no tier is failing)."""
        return max(self._delay.values(), default=0.0)
