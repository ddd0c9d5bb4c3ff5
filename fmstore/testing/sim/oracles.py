"""The simulation's oracles, checked after every store call that wrote or deleted: I1 in
full (the shared tier's ``keep_latest`` newest steps restorable from some tier) and its
counting half, I2 (a manifest's blobs all there, byte-exact), I4 (no blob of a committed
manifest deleted: checked at the delete itself).  They read the stores' bytes directly
(a backdoor), never through the code under test."""

from __future__ import annotations

from .scheduler import Scheduler, Violation
from .stores import SimStore

__all__ = ["STEPS", "Oracles"]

#: The steps every node saved, in every schedule.
STEPS = (10, 20)


class Oracles:
    """The invariants over a world's stores (:class:`~.world.World` fills these in)."""

    seed: int
    sched: Scheduler
    shared: SimStore
    keep: int
    saves: dict[int, tuple[bytes, dict[str, bytes]]]
    mkey: dict[int, str]
    blobs: dict[int, dict[str, bytes]]
    parts: dict[int, list[tuple[dict[str, bytes], str, bytes]]]
    counted: list[int]
    checked: int

    def on_delete(self, key: str) -> None:
        for step in STEPS:
            m = self.shared.data.get(self.mkey[step])
            if m == self.saves[step][0] and key in self.blobs[step]:
                raise Violation(f"I4: {key} deleted from a committed checkpoint (seed {self.seed})")

    def shared_holds(self, step: int) -> bool:
        data = self.shared.data
        if data.get(self.mkey[step]) != self.saves[step][0]:
            return False
        return all(data.get(k) == d for k, d in self.blobs[step].items())

    def nodes_hold(self, step: int) -> bool:
        m, key = self.saves[step][0], self.mkey[step]
        return all(
            data.get(key) == m and data.get(blob) == payload
            for data, blob, payload in self.parts[step]
        )

    def oracles(self) -> None:
        if set(self.counted) - set(STEPS):
            raise Violation(
                f"I1: steps {sorted(set(self.counted))} counted as committed (seed {self.seed})"
            )
        writes = self.sched.writes
        if writes == self.checked:
            return  # nothing written or deleted since the last look
        self.checked = writes
        for step in STEPS:
            m = self.shared.data.get(self.mkey[step])
            if m == self.saves[step][0] and not self.shared_holds(step):
                raise Violation(
                    f"I2: the manifest of step {step} on lustre lists blobs not there "
                    f"(seed {self.seed})"
                )
        for step in sorted(STEPS)[-self.keep :]:
            if not (self.shared_holds(step) or self.nodes_hold(step)):
                raise Violation(
                    f"I1: step {step}, among the {self.keep} newest verified, is restorable "
                    f"from no tier (seed {self.seed})"
                )
