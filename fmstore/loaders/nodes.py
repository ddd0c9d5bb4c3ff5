"""Which node a rank is on, and how the epoch's order is shared between nodes.

A job of ``W`` ranks on ``N`` nodes of ``R = W / N`` ranks each reads the epoch's order
(:mod:`.order`) so that local rank ``l`` of node ``n`` takes the slot ``n + N * l``: the
ranks of one node then read only the positions ``= n (mod N)``, which belong to their own
canonical partitions, and every node downloads only its share of the epoch.

Where this rank's node comes from, first found first:

1. :class:`PartitionOptions` ``node``/``nodes`` given explicitly (with ``LOCAL_RANK`` or
   the rank's place among its node's ranks);
2. ``torch.distributed`` initialized: every rank's node id (``$FMSTORE_NODE_ID`` or the host
   name, the same identity as the checkpoints' node parts) is gathered once, so ranks on one
   node are found whatever the launcher's rank layout;
3. ``LOCAL_WORLD_SIZE``/``LOCAL_RANK`` (torchrun and most launchers): node
   ``(rank - LOCAL_RANK) / LOCAL_WORLD_SIZE`` of ``WORLD_SIZE / LOCAL_WORLD_SIZE``;
4. otherwise all ranks count as one node (the order and downloads of the global order).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from math import gcd

from ..config import node_id
from ..errors import ConfigError
from .state import MAX_CANONICAL


@dataclass(frozen=True)
class PartitionOptions:
    """How an epoch is shared between nodes.

    ``mode``: ``"node"`` (each node reads its own canonical partitions) or ``"global"``
    (the order of fmstore before node partitioning: one partition, ranks interleaved by
    rank number, every node reads every shard).  ``canonical``: the number of canonical
    partitions, fixed for the life of a job so that a resume on another number of nodes
    continues the same order (None: the number of nodes of the first run, carried in the
    state).  ``node``/``nodes``: this rank's node index and the number of nodes, where the
    environment cannot tell (see the module's docstring)."""

    mode: str = "node"
    canonical: int | None = None
    node: int | None = None
    nodes: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("node", "global"):
            raise ConfigError(f"partition mode must be 'node' or 'global', not {self.mode!r}")
        if self.canonical is not None and not 1 <= self.canonical <= MAX_CANONICAL:
            raise ConfigError(
                f"canonical partitions must be in [1, {MAX_CANONICAL}], not {self.canonical}"
            )
        if (self.node is None) != (self.nodes is None):
            raise ConfigError("give both node and nodes, or neither")


@dataclass(frozen=True)
class NodeLayout:
    """This rank's node ``node`` of ``nodes``, and its ``local_rank`` there."""

    node: int
    nodes: int
    local_rank: int

    def slot(self) -> int:
        """This rank's slot in the epoch's order (see :mod:`.order`)."""
        return self.node + self.nodes * self.local_rank

    def partitions_read(self, canonical: int) -> int:
        """How many canonical partitions each node's ranks read at once (the cache holds
        their shuffle windows): ``canonical / gcd(canonical, nodes)``."""
        return canonical // gcd(canonical, self.nodes)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"${name} must be an integer, not {raw!r}") from None


def _checked(node: int, nodes: int, local: int, rank: int, world: int, where: str) -> NodeLayout:
    if nodes < 1 or world % nodes or not 0 <= node < nodes:
        raise ConfigError(
            f"{where}: node {node} of {nodes} nodes does not fit {world} ranks "
            "(every node must run the same number of ranks)"
        )
    if not 0 <= local < world // nodes:
        raise ConfigError(
            f"{where}: local rank {local} of rank {rank} is outside [0, {world // nodes})"
        )
    return NodeLayout(node, nodes, local)


def _gathered(rank: int, world: int) -> NodeLayout | None:
    """The layout from every rank's node id, where ``torch.distributed`` is initialized with
    this rank and world size."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() != world or dist.get_rank() != rank:
        return None
    ids: list[str | None] = [None] * world
    dist.all_gather_object(ids, node_id())
    names = list(dict.fromkeys(str(i) for i in ids))  # in order of their first rank
    me = names.index(str(ids[rank]))
    local = sum(1 for i in ids[:rank] if i == ids[rank])
    per_node = {n: sum(1 for i in ids if i == n) for n in names}
    if len(set(per_node.values())) != 1:
        raise ConfigError(
            f"nodes run different numbers of ranks ({per_node}): node partitioning needs the "
            "same number on every node (or PartitionOptions(mode='global'))"
        )
    return _checked(me, len(names), local, rank, world, "node ids")


def layout(opts: PartitionOptions, rank: int, world: int) -> NodeLayout:
    """This rank's node (see the module's docstring for where it comes from)."""
    local_env = _env_int("LOCAL_RANK")
    if opts.node is not None and opts.nodes is not None:
        per = world // opts.nodes if opts.nodes and world % opts.nodes == 0 else 1
        local = local_env if local_env is not None else rank % per
        return _checked(opts.node, opts.nodes, local, rank, world, "PartitionOptions")
    if world > 1:
        got = _gathered(rank, world)
        if got is not None:
            return got
    local_world = _env_int("LOCAL_WORLD_SIZE")
    if local_world is not None and local_env is not None and local_world >= 1:
        if world % local_world or (rank - local_env) % local_world:
            raise ConfigError(
                f"rank {rank} of {world} with $LOCAL_RANK {local_env} of $LOCAL_WORLD_SIZE "
                f"{local_world} is not on consecutive ranks per node: give "
                "PartitionOptions(node=, nodes=) or initialize torch.distributed first"
            )
        return _checked(
            (rank - local_env) // local_world, world // local_world, local_env, rank, world,
            "$LOCAL_RANK/$LOCAL_WORLD_SIZE",
        )  # fmt: skip
    return NodeLayout(0, 1, rank)
