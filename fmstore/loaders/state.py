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

import operator
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError

VERSION = 2
#: the most canonical partitions a state may name (every one is a slice of an epoch)
MAX_CANONICAL = 1 << 20
#: the most ranks a state may name (as many as a checkpoint's world may hold)
MAX_WORLD = 1 << 20
_I63 = (1 << 63) - 1

#: each field's whole-number range (inclusive); a state is read from a checkpoint, so a
#: value outside it (``inf``, ``-3``, ``true``, ``"7"``) is refused here, by name, not deep
#: inside numpy (epochs and seeds seed its generators, which take no negative number).
RANGES: dict[str, tuple[int, int]] = {
    "epoch": (0, _I63),
    "position": (0, _I63),
    "seed": (0, (1 << 64) - 1),
    "length": (0, _I63),
    "world_size": (1, MAX_WORLD),
    "version": (1, VERSION),
    "canonical": (0, MAX_CANONICAL),
}


def _shown(v: int) -> str:
    # str() of an int of over 4300 digits raises; a state's numbers are small when sane.
    return str(v) if v.bit_length() <= 64 else f"a number of {v.bit_length()} bits"


def _field(d: dict[Any, Any], name: str) -> int:
    if name not in d:
        if name == "canonical":  # states of version 1 have none: the global order of old
            return 0
        raise ConfigError(f"loader state has no field {name!r}")
    v = d[name]
    if isinstance(v, bool):
        raise ConfigError(f"loader state field {name!r} must be a whole number, not a bool")
    try:
        n = operator.index(v)  # ints and numpy's integers; never a float or a string
    except TypeError:
        raise ConfigError(
            f"loader state field {name!r} must be a whole number, not {type(v).__name__}"
        ) from None
    lo, hi = RANGES[name]
    if not lo <= n <= hi:
        raise ConfigError(f"loader state field {name!r} is {_shown(n)}, outside [{lo}, {hi}]")
    return n


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
        st = cls(**{name: _field(d, name) for name in RANGES})
        if st.position > st.length:
            raise ConfigError(
                f"loader state field 'position' is {st.position}, outside [0, {st.length}]"
            )
        return st

    def check_canonical(self, configured: int) -> None:
        """Refuse canonical partitions no dataset of this state's length needs: each epoch
        costs time linear in them, so 2^20 of them on 600 samples took minutes an epoch.
        At most one partition a sample, or what this dataset's configuration would write."""
        if self.canonical > max(1, self.length, configured):
            raise ConfigError(
                f"loader state field 'canonical' is {self.canonical}, more canonical "
                f"partitions than the {self.length} samples of an epoch"
            )
