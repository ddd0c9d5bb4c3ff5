"""What each rank's node holds of a candidate of a restore, told to every rank.

Each rank looks at its own node's stores (:func:`look`): the manifest it holds (its
sha256), the pending parts (generations with a rank record, no manifest), the replicas it
holds of other nodes' parts, and what it could not read.  A read that failed is no
verdict: what it would have told stays unknown (``error``, ``held_error``: a
``READ_ERROR``, or a ``FAILED`` for an error that is no storage error).  Views are sent
as JSON and checked field by field on arrival (:meth:`View.gather`), never pickled.  The
restore's decisions on them are :mod:`.collective`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

from ... import runtime
from ...config import is_node_id
from ...errors import CorruptData, NotFound
from ...protocol.problems import Problem, from_json, look_failed, to_json
from ...protocol.wire import gather_json
from ...stores import Store
from ..commit import read_bounded_manifest
from ..layout import GENERATION_RE
from . import replicas
from .manifest import MANIFEST_KEY
from .nodes import has_rank_record, node_id, tier_scope
from .reader import Reader

__all__ = ["View", "look", "open_candidate"]


@dataclass(frozen=True)
class View:
    """What one rank's node holds of one candidate."""

    rank: int
    node: str
    digest: str | None  # sha256 of the manifest this node holds, None: no manifest
    pending: tuple[str, ...]  # generations holding this rank's record, no manifest here
    #: a read failed: what this node holds is unknown
    error: Problem | None = None
    #: the replicas this node holds of other nodes' parts: sha256 of their manifest, ranks
    held: tuple[str | None, tuple[int, ...]] = (None, ())
    #: reading those replicas failed: what they hold is unknown
    held_error: Problem | None = None

    @classmethod
    def gather(cls, pg: Any, mine: View) -> list[View]:
        """Every rank's view, sent as JSON and checked field by field on arrival."""
        out = []
        sent = {**dataclasses.asdict(mine), "error": to_json(mine.error)}
        sent["held_error"] = to_json(mine.held_error)
        for r, d in enumerate(gather_json(pg, sent)):
            try:
                digest, ranks = d["held"]
                v = cls(
                    rank=d["rank"],
                    node=d["node"],
                    digest=d["digest"],
                    pending=tuple(d["pending"]),
                    error=from_json(d["error"]),
                    held=(digest, tuple(ranks)),
                    held_error=from_json(d["held_error"]),
                )
                ok = (
                    isinstance(d["pending"], list)
                    and isinstance(ranks, list)
                    and type(v.rank) is int
                    and is_node_id(v.node)
                    and all(isinstance(x, (str, type(None))) for x in (v.digest, digest))
                    and all(isinstance(g, str) for g in v.pending)
                    and all(type(x) is int for x in v.held[1])
                )
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise CorruptData(f"rank {r} sent a view of its candidate that is not one")
            out.append(v)
        return out


def open_candidate(uri: str, so: dict[str, Any]) -> Store:
    """The store of candidate ``uri`` (:class:`NotFound` where its directory is not there:
    a load makes none)."""
    return Reader(uri, store_options=so).store


def look(uri: str, so: dict[str, Any], rank: int) -> View:
    """This rank's view of ``uri``; never raises (every rank answers in the gather that
    follows): what it could not read is its ``error``."""
    try:
        return runtime.run(_look(uri, so, rank))
    except Exception as e:
        return View(rank, node_id(), None, (), look_failed(e, uri))


async def _look(uri: str, so: dict[str, Any], rank: int) -> View:
    me = node_id()
    cfg = so.get("config")
    try:
        store = open_candidate(uri, so)
    except NotFound:
        return View(rank, me, None, ())
    try:
        data = await read_bounded_manifest(store)
    except NotFound:
        data = None
    except Exception as e:
        return View(rank, me, None, (), look_failed(e, f"{uri}/{MANIFEST_KEY}"))
    held: tuple[str | None, tuple[int, ...]] = (None, ())
    unknown: Problem | None = None
    if replicas.replicas_of(uri, cfg):
        try:
            held = await replicas.held(uri, so)
        except Exception as e:  # told to the others: a restore may need them
            unknown = look_failed(e, f"the replicas of {uri}")
    if data is not None:
        return View(rank, me, hashlib.sha256(data).hexdigest(), (), held=held, held_error=unknown)
    pending = []
    if tier_scope(uri, cfg) == "node":
        # A generation holding any rank's record on this node (the relaunch may run other
        # ranks here than the save did).
        async for o in store.list("", recursive=False):
            gen = o.key.rstrip("/").rsplit("/", 1)[-1]
            if GENERATION_RE.match(gen) and await has_rank_record(store, gen):
                pending.append(gen)
    return View(rank, me, None, tuple(sorted(pending)), held=held, held_error=unknown)
