"""Resume state: where a job is in the canonical order (see :mod:`.order`).

The state is the epoch and one *position* in that epoch's global order: every sample
before it has been consumed by some rank.  With ``W`` ranks that each consumed ``k``
samples the position is ``start + W * k``, so it is the same number whatever ``W`` is,
and a run resumed with a different number of ranks or workers continues exactly where the
old one stopped (elastic resume).  Ranks of one job consume in lockstep (DDP), so rank 0's
state speaks for all of them.

``canonical`` is the number of canonical partitions the epoch's order was cut into (see
:mod:`.order`); it is what makes the order, so a resume on any number of nodes keeps it.
``0`` is the global order of old (states of version 1 have no such field, and mean it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError

VERSION = 2
#: the most canonical partitions a state may name (every one is a slice of an epoch)
MAX_CANONICAL = 1 << 20


@dataclass(frozen=True)
class LoaderState:
    epoch: int
    position: int
    seed: int
    length: int
    world_size: int = 1
    version: int = VERSION
    canonical: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> LoaderState:
        if not isinstance(d, dict):
            raise ConfigError(f"loader state must be a dict, not {type(d).__name__}")
        try:
            st = cls(
                **{
                    k: int(d[k])
                    for k in ("epoch", "position", "seed", "length", "world_size", "version")
                },
                canonical=int(d.get("canonical", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"loader state is malformed: {e}") from None
        if st.version > VERSION:
            raise ConfigError(f"loader state version {st.version} is newer than {VERSION}")
        if not 0 <= st.position <= st.length:
            raise ConfigError(f"loader state position {st.position} is outside [0, {st.length}]")
        if not 0 <= st.canonical <= MAX_CANONICAL:
            raise ConfigError(
                f"loader state canonical partitions {st.canonical} is outside [0, {MAX_CANONICAL}]"
            )
        return st
