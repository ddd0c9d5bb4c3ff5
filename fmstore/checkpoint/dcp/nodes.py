"""Nodes of a multi-node job, and the part records of a checkpoint on a node-local tier.

A tier is *shared* (every node sees the same bytes: Lustre, S3) or *node-local* (``[tiers.X]
scope = "node"``: each node has its own copy, like NVMe).  On a node-local tier a DCP
checkpoint of a job that spans several nodes has one *part* per node: the blobs of that
node's ranks, each rank's blobs described by a *rank record* (``GEN/rank-RRRRRR.json``:
rank, node, save id, blob names and sizes) written, fsynced, after the rank's blobs are.
A node's part is its ranks' blobs and records.  See ``docs/distributed.md``.

A rank record in a generation that no manifest names marks a *pending* part: a save whose
commit this node has not seen yet (the global manifest is written on the coordinator's node
first, then copied to every node).  Only a restore's collective decides about a pending
part (it adopts it when some node holds the manifest, removes it when none does); the
orphan sweep's age rule never removes one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from ...config import NODE_ENV, node_id
from ...errors import CorruptData, FmstoreError, describe_error
from ...format.manifest import field_int, field_list, field_number, field_str, parse_header
from ...protocol.records import field_node
from ...protocol.routing import may_drop_pending
from ...stores import Store
from ...stores.bounded import RECORD_LIMIT, read_bounded
from ..layout import RANK_RECORD_RE

__all__ = [
    "NODE_ENV",
    "LocalInfo",
    "RANK_RECORD_RE",
    "RankRecord",
    "drop_pending",
    "has_rank_record",
    "local_copies",
    "node_id",
    "rank_record_key",
    "tier_scope",
]

RANK_FORMAT_NAME = "fmstore-dcp-rank"
RANK_FORMAT_VERSION = 1


def tier_scope(uri: str, config: Any = None) -> str:
    """``"node"`` when ``uri`` is on a tier configured with ``scope = "node"`` (in
    ``config``, default the process's), else ``"shared"`` (a path or URL outside the
    configured tiers counts as shared)."""
    from ...config import get_config
    from ...stores import split_tier

    cfg = config if config is not None else get_config()
    name, _rest = split_tier(uri, cfg)
    if name is None:
        return "shared"
    return str(cfg.tier(name).scope)


def rank_record_key(generation: str, rank: int) -> str:
    return f"{generation}/rank-{rank:06d}.json"


@dataclass(frozen=True)
class RankRecord:
    """What one rank wrote on its node: made durable after its blobs, before it reports."""

    generation: str
    save_id: str
    rank: int
    node: str
    blobs: tuple[tuple[str, int], ...]  # (name, size)
    created: float = 0.0
    #: the node of every rank of the save: a restore removes a pending part only when its
    #: own job has this layout (then every node of the save said it holds no manifest)
    nodes: tuple[str, ...] = ()

    def dumps(self) -> bytes:
        d: dict[str, Any] = {
            "format": RANK_FORMAT_NAME,
            "version": RANK_FORMAT_VERSION,
            "generation": self.generation,
            "save_id": self.save_id,
            "rank": self.rank,
            "node": self.node,
            "created": self.created or time.time(),
            "blobs": [{"name": n, "size": s} for n, s in self.blobs],
            "nodes": list(self.nodes),
        }
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, data: bytes, *, where: str) -> RankRecord:
        d, _v = parse_header(
            data,
            where=where,
            format_name=RANK_FORMAT_NAME,
            max_version=RANK_FORMAT_VERSION,
            kind="rank record of a sharded checkpoint",
        )
        try:
            return cls(
                generation=field_str(d, "generation"),
                save_id=field_str(d, "save_id"),
                rank=field_int(d, "rank"),
                node=field_node(d, "node"),
                blobs=tuple(
                    (field_str(b, "name"), field_int(b, "size")) for b in field_list(d, "blobs")
                ),
                created=field_number(d, "created", 0.0),
                nodes=tuple(field_node({"node": n}, "node") for n in field_list(d, "nodes")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptData(
                f"rank record at {where} is malformed ({describe_error(e)})"
            ) from None


@dataclass(frozen=True)
class LocalInfo:
    """What each rank tells the coordinator in its local plan's ``storage_data``: its node,
    and its items before DCP's deduplication dropped the ones another rank also holds."""

    node: str
    items: tuple[WriteItem, ...]
    #: the replicas it would stream while writing (0: none, or it cannot reach the group)
    replicas: int = 0
    #: its node's failure domain for the tier (None: none named)
    domain: str | None = None
    #: :func:`.plancache.digest` of its whole local plan, sent even when plan caching
    #: leaves the plan empty ("": unknown)
    digest: str = ""


def local_copies(plans: list[SavePlan], nodes: tuple[str, ...]) -> list[SavePlan]:
    """Plans in which every node's ranks write every item one of them held before DCP's
    deduplication (``dedup_save_plans`` keeps a replicated value on one rank, maybe on
    another node): the copy goes to the lowest rank of the node that held it."""
    out = [list(p.items) for p in plans]
    for node in dict.fromkeys(nodes):
        ranks = [r for r, n in enumerate(nodes) if n == node]
        have = {wi.index for r in ranks for wi in plans[r].items}
        for r in ranks:
            info = plans[r].storage_data
            assert isinstance(info, LocalInfo)
            for wi in info.items:
                if wi.index not in have:
                    out[r].append(wi)
                    have.add(wi.index)
    return [replace(p, items=items) for p, items in zip(plans, out, strict=True)]


async def has_rank_record(store: Store, gen: str) -> bool:
    """Whether generation ``gen`` of ``store`` holds any rank's record."""
    async for o in store.list(f"{gen}/", recursive=False):
        if not o.is_dir and RANK_RECORD_RE.match(o.key.rsplit("/", 1)[-1]):
            return True
    return False


async def drop_pending(store: Store, gens: Sequence[str], nodes: tuple[str, ...]) -> None:
    """Remove this node's pending parts ``gens`` in ``store`` of saves no node committed (by
    the node's lowest rank): a restore's collective found no manifest on any node of the job
    (``nodes``: each rank's node), and every node of the save is in it, whatever rank it runs
    now (:func:`~fmstore.protocol.routing.may_drop_pending`).  A part of a save some of
    whose nodes are not in the job stays pending (a job with them decides about it)."""
    for gen in gens:
        async for o in store.list(f"{gen}/", recursive=False):
            if o.is_dir or not RANK_RECORD_RE.match(o.key.rsplit("/", 1)[-1]):
                continue
            try:
                raw = await read_bounded(store, o.key, RECORD_LIMIT, what="rank record")
                rec = RankRecord.loads(raw, where=f"{store.url}/{o.key}")
            except FmstoreError:
                continue
            if rec.generation != gen or not may_drop_pending(rec.nodes, nodes):
                continue
            await store.delete_many([f"{gen}/{name}" for name, _size in rec.blobs])
            await store.delete(o.key)
