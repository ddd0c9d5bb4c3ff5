"""A lost node's part exported from its replica, so that the step commits without it.

A step in node parts commits on a shared tier only once every node's part is there
(:mod:`.parts`).  With ``[tiers.X] replicas = 1`` each node's part also lies on a peer's
node-local tier (under ``.replicas/``).  When a step has waited ``[policies]
replica_export_after`` (default 10 min) for node N's part on a destination (another
node's part record there is that old) and N holds no live export lease there, the daemon
of the node holding N's replica exports that part with :func:`~.parts.export_part`, from
the replica: the step then commits without N.  N may come back and export its part too:
both write the same blobs and records, and a part record is trusted by its content (blobs
that verify against the manifest), not by who wrote it (:func:`~.protocol.record_holds`).
The decision is :func:`~.protocol.replica_export_due`.  Each export says why the part was
missing (:attr:`ReplicaExport.why`): the node was lost (this node holds no replica of a later
step of its), or the node is up and only its daemon is not exporting (its ranks saved later
steps: a daemon not started yet, or behind; the same bytes are exported twice then).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from ...checkpoint.layout import MANIFEST_KEY, RANK_RECORD_RE, REPLICA_PREFIX, parse_step, step_name
from ...checkpoint.verify import read_committed
from ...config import Config
from ...errors import FmstoreError, NotFound
from ...protocol.decisions import replica_export_due
from ...protocol.env import Env
from ...stores.base import Store
from ..copy.transfer import TransferOptions
from ..policy.rules import Policies
from ..tiers import Tiers
from .parts import export_part, in_parts, lease_renewals, part_records

__all__ = ["ReplicaExport", "export_replicas"]

log = logging.getLogger("fmstore.tiering")

#: the most replicas of steps one pass looks at (a tier is hostile: its listing is bounded)
MAX_REPLICAS = 10_000


@dataclass(frozen=True)
class ReplicaExport:
    """One part exported from this node's replica: whose, of which step, where to, and
    whether the step committed with it."""

    node: str
    root: str
    step: int
    source: str
    dest: str
    committed: bool
    #: why ``node``'s part was missing: ``node_lost`` (this node holds no replica of a
    #: later step of ``node``'s: it saved nothing since) or ``daemon_not_exporting`` (its
    #: ranks saved later steps, so the node is up: its daemon is not running, or behind)
    why: str = "node_lost"
    #: the newest step of ``root`` whose replica of ``node``'s part this node holds
    newest_saved: int | None = None

    def describe(self) -> str:
        if self.why == NOT_EXPORTING:
            cause = (
                f"node {self.node} is up (its ranks saved step {self.newest_saved} since) but "
                f"its part did not reach {self.dest}: its daemon is not running or is behind "
                f"(check fmstore daemon on {self.node}); the same bytes, exported here"
            )
        else:
            cause = (
                f"node {self.node} saved nothing of {self.root!r} after this step that this "
                "node holds a replica of: it was lost, or its job stopped"
            )
        done = "the step committed" if self.committed else "the step still waits for others"
        return (
            f"exported node {self.node}'s part of {self.root} step {self.step} to {self.dest} "
            f"from its replica on {self.source} ({done}): {cause}"
        )


#: :attr:`ReplicaExport.why` codes.
NODE_LOST = "node_lost"
NOT_EXPORTING = "daemon_not_exporting"


def _destinations(config: Config, policies: Policies, tier: str) -> list[str]:
    """The shared tiers the export rules copy ``tier``'s checkpoints to."""
    out = []
    for r in policies.exports:
        if r.source in (None, tier) and config.tier(r.to).scope != "node" and r.to not in out:
            out.append(r.to)
    return out


async def _replicas(store: Store) -> list[tuple[str, int]]:
    """(root, step) of every replica of a step under ``.replicas/`` of a tier."""
    out: list[tuple[str, int]] = []
    with contextlib.suppress(NotFound):
        async for o in store.list(f"{REPLICA_PREFIX}/", recursive=True):
            key = o.key
            if o.is_dir or not key.endswith("/" + MANIFEST_KEY):
                continue
            rel = key[len(REPLICA_PREFIX) + 1 : -len(MANIFEST_KEY) - 1]
            root, _, last = rel.rpartition("/")
            step = parse_step(last)
            if step is not None and root:
                out.append((root, step))
                if len(out) >= MAX_REPLICAS:
                    break
    return out


async def _held_ranks(src: Store, generation: str) -> set[int]:
    """The ranks whose replica is complete (its record is written after its blobs)."""
    out: set[int] = set()
    with contextlib.suppress(NotFound):
        async for o in src.list(f"{generation}/", recursive=False):
            found = RANK_RECORD_RE.match(o.key.rsplit("/", 1)[-1])
            if found and not o.is_dir:
                out.add(int(found.group(1)))
    return out


async def export_replicas(
    config: Config,
    policies: Policies,
    tiers: Tiers,
    me: str,
    *,
    options: TransferOptions,
    now: float | None = None,
) -> list[ReplicaExport]:
    """Export, from the replicas node ``me`` holds, each part whose step has waited
    ``policies.replica_export_after`` for it on a destination of the export rules (see the
    module doc).  A failure on one part is logged and the others are tried."""
    done: list[ReplicaExport] = []
    for tier in policies.node_tiers:
        if config.tier(tier).replicas <= 0:
            continue
        dests = _destinations(config, policies, tier)
        if not dests:
            continue
        base = tiers.store(tier)
        held_parts: list[tuple[str, int, Store, Any, set[int]]] = []
        #: (root, node) -> the newest step whose replica of node's part is complete here
        newest: dict[tuple[str, str], int] = {}
        for root, step in await _replicas(base):
            src = base.sub(f"{REPLICA_PREFIX}/{root}/{step_name(step)}")
            try:
                _data, m = await read_committed(src)
            except FmstoreError:
                continue  # a replica half written or removed: nothing to export from
            if not in_parts(m):
                continue
            held = await _held_ranks(src, m.generation)  # type: ignore[union-attr]
            held_parts.append((root, step, src, m, held))
            for part in m.parts:  # type: ignore[union-attr]
                if part.node != me and set(part.ranks) <= held:
                    key = (root, part.node)
                    newest[key] = max(newest.get(key, step), step)
        for root, step, src, m, held in held_parts:
            for part in m.parts:
                if part.node == me or not set(part.ranks) <= held:
                    continue
                for dest in dests:
                    dst = tiers.checkpoint(dest, root, step)
                    try:
                        if not await _due(dst, m.generation, part.node, policies, now, tiers.env):
                            continue
                        res = await export_part(src, dst, part.node, options=options, env=tiers.env)
                    except FmstoreError as e:
                        log.warning(
                            "could not export node %s's part of %s step %d to %s from its "
                            "replica: %s",
                            part.node,
                            root,
                            step,
                            dest,
                            e,
                        )
                        continue
                    later = newest.get((root, part.node), step)
                    done.append(
                        ReplicaExport(
                            part.node,
                            root,
                            step,
                            tier,
                            dest,
                            not res.waiting_for and not res.retired,
                            NOT_EXPORTING if later > step else NODE_LOST,
                            later,
                        )
                    )
    return done


async def _due(
    dst: Store, generation: str, node: str, policies: Policies, now: float | None, env: Env
) -> bool:
    try:
        committed = await dst.exists(MANIFEST_KEY)
    except NotFound:
        return False
    records = {n: r.written for n, r in (await part_records(dst, generation)).items()}
    leases = await lease_renewals(dst, generation, env=env)
    return replica_export_due(
        node,
        records,
        leases,
        committed=committed,
        now=env.now() if now is None else now,
        after=policies.replica_export_after,
        ttl=env.lease_ttl,
        skew=env.clock_skew,
    )
