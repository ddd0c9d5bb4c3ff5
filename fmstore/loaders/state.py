"""Resume state: where a job is in the canonical order (see :mod:`.order`).

The state is the epoch and one *position* in that epoch's global order: every sample
before it has been consumed by some rank.  With ``W`` ranks that each consumed ``k``
samples the position is ``start + W * k``, so it is the same number whatever ``W`` is,
and a run resumed with a different number of ranks or workers continues exactly where the
old one stopped (elastic resume).  Ranks of one job consume in lockstep (DDP), so rank 0's
state speaks for all of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError

VERSION = 1


@dataclass(frozen=True)
class LoaderState:
    epoch: int
    position: int
    seed: int
    length: int
    world_size: int = 1
    version: int = VERSION

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
                }
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"loader state is malformed: {e}") from None
        if st.version > VERSION:
            raise ConfigError(f"loader state version {st.version} is newer than {VERSION}")
        if not 0 <= st.position <= st.length:
            raise ConfigError(f"loader state position {st.position} is outside [0, {st.length}]")
        return st
