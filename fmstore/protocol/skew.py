"""Clock skew, said loudly: manifests created in the future, and this node's clock
against a shared tier's.

A manifest whose ``created`` is later than this node's clock plus the allowed skew
(``[protocol] clock_skew``) is not counted as committed: no save can have written it yet,
so counting it would let a node's wrong clock decide what is committed (invariant I1).
Every scan that meets one says so at warning, naming the node whose clock set it and by
how much it is ahead (:func:`future_groups`): the daemon's rescans, ``ckpt list``, the
``fmstore_manifests_in_future`` metrics.  Where a tier sets its objects' modification
times itself (a file server, S3), the tier check compares that time with this node's clock
(:func:`clock_offset`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["FutureGroup", "InFuture", "clock_offset", "clock_warning", "future_groups"]


@dataclass(frozen=True)
class InFuture:
    """A step whose manifest says it was created later than this node's clock plus the
    allowed skew: not counted as committed, and a sign that a node's clock is off."""

    tier: str
    root: str
    step: int
    url: str
    #: seconds its ``created`` is ahead of this node's clock
    offset: float
    #: the node whose clock set it, where the manifest says (its writer, or rank 0's node)
    node: str | None

    def describe(self) -> str:
        by = f" by node {self.node}" if self.node else ""
        return f"created in the future (+{self.offset:.0f} s){by} — clock skew?"


@dataclass(frozen=True)
class FutureGroup:
    """The steps of one run root on one tier whose manifests one node wrote in the future."""

    tier: str
    root: str
    node: str | None
    steps: tuple[int, ...]
    max_offset: float

    def describe(self, skew: float) -> str:
        n = len(self.steps)
        shown = ", ".join(map(str, self.steps[:8])) + (", …" if n > 8 else "")
        whose = f"node {self.node}" if self.node else "a node the manifests do not name"
        return (
            f"{n} checkpoint{'s' if n != 1 else ''} of {self.root!r} on {self.tier} (step"
            f"{'s' if n != 1 else ''} {shown}) created in the future, up to "
            f"+{self.max_offset:.0f} s ahead of this node's clock, written by {whose} — "
            f"clock skew? Not counted as committed (no export, retention or restore choice "
            f"counts them) until this node's clock reaches them; the clocks of {whose} and "
            f"this node are more than the allowed {skew:g} s apart ([protocol] clock_skew): "
            "check their time sync (chronyc tracking, timedatectl)"
        )


def future_groups(found: Iterable[InFuture]) -> list[FutureGroup]:
    """``found`` by tier, run root and writing node, ascending."""
    by: dict[tuple[str, str, str], list[InFuture]] = {}
    for f in found:
        by.setdefault((f.tier, f.root, f.node or ""), []).append(f)
    return [
        FutureGroup(
            tier,
            root,
            node or None,
            tuple(sorted(f.step for f in fs)),
            max(f.offset for f in fs),
        )
        for (tier, root, node), fs in sorted(by.items())
    ]


def clock_offset(before: float, after: float, mtime: float | None, *, resolution: float) -> float:
    """How far a tier's clock is ahead of this node's (negative: behind), from the
    modification time ``mtime`` that a write made between ``before`` and ``after`` (this
    node's clock) got there; 0 where that is within the write's duration plus the tier's
    time ``resolution`` (S3's ``Last-Modified`` has whole seconds) or unknown."""
    if mtime is None:
        return 0.0
    if mtime > after + resolution:
        return mtime - after
    if mtime < before - resolution:
        return mtime - before
    return 0.0


def clock_warning(tier: str, offset: float, skew: float) -> str | None:
    """The warning for a tier whose clock is ``offset`` s from this node's, None within
    ``skew``."""
    if abs(offset) <= skew:
        return None
    side = "behind" if offset > 0 else "ahead of"
    return (
        f"this node's clock is {abs(offset):.0f} s {side} tier {tier}'s (the modification "
        f"time a write there got), more than the allowed clock skew of {skew:g} s "
        "([protocol] clock_skew): "
        + (
            "checkpoints this node writes look created in the future to nodes with right "
            "clocks, which do not count them"
            if offset < 0
            else "checkpoints of nodes with right clocks look created in the future here, "
            "and this node does not count them"
        )
        + "; check this node's time sync (chronyc tracking, timedatectl)"
    )
