"""Which node serves which saved rank's blobs in a restore from node-local parts: pure
decisions (no I/O, no torch), used by the collective restore and open to the tiering layer.

A checkpoint saved on a node-local tier by a job of several nodes is in *parts*, one per
node (the blobs its ranks wrote), and maybe *replicas* of each part on ``k`` other nodes.  A
relaunch with the same world size may put its ranks on other nodes (the rendezvous orders
hosts differently, a node was replaced).  Each node says which saved ranks' blobs it holds
complete, in its part or in its replicas; :func:`route` then says, for each rank of the
relaunch and each saved rank, where that rank reads those blobs: on its own node (the
node's part, else its replicas), else from the lowest rank of another node holding them
(a part before a replica, then the lowest rank: with several replicas of a part, whichever
holder is in the job), streamed over the checkpoint group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["PART", "REPLICA", "Holding", "Routes", "lowest_rank", "may_drop_pending", "route"]

#: where a node holds a saved rank's blobs
PART = "part"
REPLICA = "replica"


@dataclass(frozen=True)
class Holding:
    """What the node of rank ``rank`` (of the relaunch) holds: the saved ranks whose blobs
    are complete in its part, and in its replicas of other nodes' parts."""

    rank: int
    node: str
    parts: frozenset[int] = frozenset()
    replicas: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Routes:
    """``source[(rank, saved)]``: (the rank that reads saved rank ``saved``'s blobs for
    ``rank``, from its node's ``PART`` or ``REPLICA``); the reader is ``rank`` itself where its
    own node holds them."""

    source: dict[tuple[int, int], tuple[int, str]]

    def local(self, rank: int) -> set[int]:
        """The saved ranks whose blobs ``rank`` reads on its own node."""
        return {s for (r, s), (h, _k) in self.source.items() if r == rank and h == rank}

    def remote(self) -> bool:
        """Whether some rank reads some blobs from another node."""
        return any(h != r for (r, _s), (h, _k) in self.source.items())


def lowest_rank(nodes: Sequence[str], node: str) -> int:
    """The lowest rank on ``node``, ``nodes`` being each rank's node (the rank that writes
    or removes what belongs to the node as a whole)."""
    return nodes.index(node)


def route(world_size: int, holdings: Sequence[Holding]) -> Routes | tuple[int, ...]:
    """Where every rank of ``holdings`` reads every saved rank ``0..world_size-1``: its own
    node first, else another node's part, else another node's replica (the lowest rank of
    the node, the lowest such node's rank first).  The saved ranks that no node holds
    (a tuple) when some are missing: the restore must read a shared tier."""
    nodes = [h.node for h in holdings]
    by_node = {h.node: h for h in holdings}
    missing = tuple(
        s
        for s in range(world_size)
        if not any(s in h.parts or s in h.replicas for h in by_node.values())
    )
    if missing:
        return missing
    servers = sorted(by_node.values(), key=lambda h: lowest_rank(nodes, h.node))
    source: dict[tuple[int, int], tuple[int, str]] = {}
    for h in holdings:
        mine = by_node[h.node]
        for s in range(world_size):
            if s in mine.parts:
                source[(h.rank, s)] = (h.rank, PART)
            elif s in mine.replicas:
                source[(h.rank, s)] = (h.rank, REPLICA)
            else:
                src = next((o for o in servers if s in o.parts), None)
                kind = PART
                if src is None:
                    src = next(o for o in servers if s in o.replicas)
                    kind = REPLICA
                source[(h.rank, s)] = (lowest_rank(nodes, src.node), kind)
    return Routes(source)


def may_drop_pending(saved_nodes: Iterable[str], nodes: Iterable[str]) -> bool:
    """Whether a pending part (a save no node committed) may be removed by a job on
    ``nodes``: every node of the save (``saved_nodes``, from its rank record) is in the
    job, so every one of them answered that it holds no manifest, whatever rank it runs."""
    saved = set(saved_nodes)
    return bool(saved) and saved <= set(nodes)
