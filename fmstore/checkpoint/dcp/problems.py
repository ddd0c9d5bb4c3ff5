"""What went wrong, as ranks tell each other: a typed code and a text for people.

Every decision of the collective restore (fall back to the next candidate, fetch a part
from its replica, retry, give up, remove pending parts) reads the :class:`Code` of each
rank's :class:`Problem`, never its text: rewording a message changes no behaviour.

* ``NO_MANIFEST``: the rank looked and found no manifest, with no error (the only answer
  that, from every rank, lets a restore treat a candidate as absent or remove its pending
  parts);
* ``READ_ERROR``: a read failed (EIO, a timeout, a server error): the candidate's state is
  *unknown*; it is retried, then raised, never skipped for an older step;
* ``LACKS_PART``: the rank's node holds the manifest's step but not its own blobs (replaced
  node, wiped NVMe): a replica may restore it;
* ``UNUSABLE``: the candidate is readable but not by this job (another layout, another
  world size, two different manifests, a failed adoption, a failed load): the next
  candidate is tried.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import short_repr

__all__ = [
    "Code",
    "Move",
    "Problem",
    "code_of",
    "first",
    "fmstore_error",
    "from_json",
    "next_move",
    "reason",
    "to_json",
]


class Code(str, enum.Enum):
    NO_MANIFEST = "no_manifest"
    READ_ERROR = "read_error"
    LACKS_PART = "lacks_part"
    UNUSABLE = "unusable"


@dataclass(frozen=True)
class Problem:
    """One rank's answer about one candidate (``text`` is for logs and errors only)."""

    code: Code
    text: str = ""

    def __post_init__(self) -> None:
        # Sent between ranks: keep it a known code and a bounded text.
        object.__setattr__(self, "code", Code(self.code))
        object.__setattr__(self, "text", str(self.text)[:400])


def to_json(p: Problem | None) -> dict[str, str] | None:
    """``p`` as ranks send it (JSON, never a pickle: ``docs/security.md``)."""
    return None if p is None else {"code": p.code.value, "text": p.text}


def from_json(d: object) -> Problem | None:
    """A problem as a peer sent it, checked: ValueError unless None or a known code and a
    text."""
    if d is None:
        return None
    if not (isinstance(d, dict) and set(d) == {"code", "text"} and isinstance(d["text"], str)):
        raise ValueError(f"not a problem: {short_repr(d)}")
    return Problem(Code(d["code"]), d["text"])


def first(problems: Sequence[Problem | None]) -> Problem | None:
    """The problem that decides for every rank: a read error first (the candidate is
    unknown), then any other, in rank order; None when no rank had one."""
    got = [p for p in problems if p is not None]
    for p in got:
        if p.code is Code.READ_ERROR:
            return p
    return got[0] if got else None


def fmstore_error(e: BaseException) -> BaseException:
    """The error to show for ``e``: the fmstore error a DCP ``CheckpointException`` wraps
    (the first rank's that has one), else ``e`` itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        from ...errors import FmstoreError

        inner = [x[0] for x in failures.values() if isinstance(x, tuple) and x]
        for exc in inner:
            if isinstance(exc, FmstoreError):
                return exc
        for exc in inner:
            if isinstance(exc, BaseException):
                return exc
    return e


def reason(e: BaseException) -> str:
    """The first line of an error (of the fmstore error a DCP exception wraps)."""
    e = fmstore_error(e)
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:400]


def code_of(e: BaseException) -> Code:
    """The code of one rank's failed look at or load of a candidate, from the error's type
    (and, for a ``NotFound``, the key it names), never its text: ``NO_MANIFEST`` only when
    the store said ``manifest.json`` itself is absent; ``READ_ERROR`` for a read that
    failed without a verdict (:class:`~fmstore.errors.StoreUnavailable`,
    :class:`~fmstore.errors.PermissionDenied`, an OS error fmstore did not translate);
    ``UNUSABLE`` for a proven problem (a missing blob, a bad checksum, a layout this job
    cannot read)."""
    from ...errors import FmstoreError, NotFound, PermissionDenied, StoreUnavailable
    from ...format.manifest import MANIFEST_KEY

    e = fmstore_error(e)
    if isinstance(e, NotFound):
        return Code.NO_MANIFEST if e.key == MANIFEST_KEY else Code.UNUSABLE
    if isinstance(e, (StoreUnavailable, PermissionDenied)):
        return Code.READ_ERROR
    if isinstance(e, OSError) and not isinstance(e, FmstoreError):
        return Code.READ_ERROR
    return Code.UNUSABLE


class Move(str, enum.Enum):
    """What a restore does after every rank looked at a candidate."""

    LOAD = "load"  # every rank can read it: it is the one restored
    NEXT = "next"  # passed over (absent, unusable): the next, older candidate
    LOOK_AGAIN = "look_again"  # unknown (a read error): looked at again
    RAISE = "raise"  # still unknown after every look: raised, never skipped


def next_move(problem: Problem | None, looks: int, tries: int) -> Move:
    """The restore's decision about one candidate from the problem every rank agrees on
    (:func:`first`) after ``looks`` looks of at most ``tries``: I3 of docs/distributed.md
    (a candidate whose state is unknown is never skipped for an older one)."""
    if problem is None:
        return Move.LOAD
    if problem.code is not Code.READ_ERROR:
        return Move.NEXT
    return Move.LOOK_AGAIN if looks < tries else Move.RAISE
