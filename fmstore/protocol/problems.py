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
  candidate is tried;
* ``FAILED``: a rank met an error that is no verdict on the candidate (a bug, a wrong
  argument: a ``TypeError``, a ``ValueError`` raised by code): raised on every rank at
  once, never retried nor passed over.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import short_repr

__all__ = [
    "Code",
    "Move",
    "Problem",
    "code_of",
    "first",
    "fmstore_error",
    "from_json",
    "look_failed",
    "next_move",
    "reason",
    "to_json",
]


class Code(str, enum.Enum):
    NO_MANIFEST = "no_manifest"
    READ_ERROR = "read_error"
    LACKS_PART = "lacks_part"
    UNUSABLE = "unusable"
    FAILED = "failed"


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
    """The problem that decides for every rank: a failure first (raised everywhere), then a
    read error (the candidate is unknown), then any other, in rank order; None when no rank
    had one."""
    got = [p for p in problems if p is not None]
    for code in (Code.FAILED, Code.READ_ERROR):
        for p in got:
            if p.code is code:
                return p
    return got[0] if got else None


def fmstore_error(e: BaseException) -> BaseException:
    """The error to show for ``e``: the fmstore error a DCP ``CheckpointException`` wraps
    (the first rank's that has one), else ``e`` itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        from ..errors import FmstoreError

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
    ``UNUSABLE`` for a proven problem (a missing blob, a bad checksum: fmstore's other
    errors; a layout this job cannot read: the ``ValueError`` or ``RuntimeError`` of DCP's
    check of the checkpoint against the state dict, inside its ``CheckpointException``);
    ``FAILED`` for any other error (a bug, a wrong argument)."""
    from ..errors import FmstoreError, NotFound, PermissionDenied, StoreUnavailable
    from ..format.manifest import MANIFEST_KEY

    inner = fmstore_error(e)
    if isinstance(inner, NotFound):
        return Code.NO_MANIFEST if inner.key == MANIFEST_KEY else Code.UNUSABLE
    if isinstance(inner, (StoreUnavailable, PermissionDenied)):
        return Code.READ_ERROR
    if isinstance(inner, OSError) and not isinstance(inner, FmstoreError):
        return Code.READ_ERROR
    if isinstance(inner, FmstoreError):
        return Code.UNUSABLE
    if inner is not e and isinstance(inner, (ValueError, RuntimeError)):
        return Code.UNUSABLE  # DCP's verdict: "Size mismatch", "Missing key"
    return Code.FAILED


def look_failed(e: BaseException, what: str) -> Problem:
    """This rank's problem when its look at ``what`` (a candidate's manifest, part or
    replicas) raised ``e``: ``FAILED`` for a failure (:func:`code_of`; its traceback is
    logged here, on the one rank that has it), else ``READ_ERROR``: its state is unknown."""
    if code_of(e) is not Code.FAILED:
        return Problem(Code.READ_ERROR, reason(e))
    logging.getLogger("fmstore.checkpoint").error("looking at %s failed", what, exc_info=e)
    return Problem(Code.FAILED, reason(e))


class Move(str, enum.Enum):
    """What a restore does after every rank looked at a candidate."""

    LOAD = "load"  # every rank can read it: it is the one restored
    NEXT = "next"  # passed over (absent, unusable): the next, older candidate
    LOOK_AGAIN = "look_again"  # unknown (a read error): looked at again
    RAISE = "raise"  # still unknown after every look: raised, never skipped


def next_move(problem: Problem | None, looks: int, tries: int) -> Move:
    """The restore's decision about one candidate from the problem every rank agrees on
    (:func:`first`) after ``looks`` looks of at most ``tries``: I3 of docs/distributed.md
    (a candidate whose state is unknown is never skipped for an older one); a failure is
    raised at once."""
    if problem is None:
        return Move.LOAD
    if problem.code is Code.FAILED:
        return Move.RAISE
    if problem.code is not Code.READ_ERROR:
        return Move.NEXT
    return Move.LOOK_AGAIN if looks < tries else Move.RAISE
