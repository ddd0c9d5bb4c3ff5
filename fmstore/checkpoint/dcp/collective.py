"""``save`` / ``async_save`` / ``load``: DCP's collectives, made safe for node-local tiers.

On a shared tier (Lustre, S3) these are ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``
with fmstore's ``Writer`` and ``Reader`` on a gloo group of their own.  On a node-local tier
(``[tiers.X] scope = "node"``) of a job that spans several nodes they also do what DCP
cannot: only DCP's coordinator runs ``finish`` (the commit), on its own node, so

* :func:`save` and :func:`async_save` copy the committed manifest to every node after the
  commit (the coordinator broadcasts its bytes, the lowest rank of each other node writes
  them, create-only, beside its node's part);
* :func:`load` is a collective restore: every rank says what its node holds of each
  candidate (a committed manifest, a pending part), all ranks take the first candidate that
  every rank can read, adopt a pending part whose manifest another node holds, and if any
  rank fails to read it, all of them go on to the next candidate together.  No rank ever
  loads a different checkpoint from another.

Every collective here runs on ``process_group`` (default: one gloo group of its own, made
on first use), never on the training group.  See ``docs/distributed.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ... import runtime
from ...errors import AlreadyExists, CorruptData, FmstoreError, NotFound, StoreUnavailable
from ...protocol.problems import (
    Code,
    Move,
    Problem,
    code_of,
    first,
    fmstore_error,
    from_json,
    look_failed,
    next_move,
    reason,
    to_json,
)
from ...protocol.routing import Holding, Routes, lowest_rank, route
from ...protocol.wire import broadcast_result, gather_json
from ...stores import Store
from ...stores.bounded import manifest_limit
from ..commit import commit_manifest, read_bounded_manifest
from . import replica_stream, replicas
from .manifest import MANIFEST_KEY, DcpManifest
from .nodes import drop_pending, node_id, tier_scope
from .peers import Peers
from .planning import plan_here, plans_alone
from .reader import Reader
from .staging import Stager
from .views import View, look, open_candidate
from .writer import Writer

__all__ = ["CandidatesFailed", "async_save", "checkpoint_group", "load", "save"]

_lock = threading.Lock()
_groups: dict[int, Any] = {}
_after: dict[int, Future[None]] = {}
_pool: ThreadPoolExecutor | None = None


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def checkpoint_group() -> Any:
    """A gloo group of every rank, made once per world (a collective on first use: every
    rank must call it, from the training thread), for checkpoint traffic only."""
    dist = _dist()
    if dist is None:
        return None
    key = id(dist.group.WORLD)
    with _lock:
        if key not in _groups:
            _groups[key] = dist.new_group(backend="gloo")
        return _groups[key]


def _writer(target: Writer | str, store_options: dict[str, Any] | None, opts: Any) -> Writer:
    w = (
        target
        if isinstance(target, Writer)
        else Writer(target, store_options=store_options, **opts)
    )
    w.distributes = True
    return w


def _spans_nodes(writer: Writer, pg: Any) -> bool:
    """Whether a save by ``writer`` may be in parts (decided alike on every rank, from the
    configuration alone)."""
    dist = _dist()
    if dist is None or dist.get_world_size(pg) <= 1:
        return False
    return tier_scope(writer.uri, writer.store_options.get("config")) == "node"


def save(
    state_dict: dict[str, Any],
    uri: Writer | str,
    *,
    process_group: Any = None,
    planner: Any = None,
    store_options: dict[str, Any] | None = None,
    **options: Any,
) -> None:
    """``dcp.save`` to ``uri`` (a URI, or a :class:`Writer`; ``options`` are its
    :class:`WriteOptions`), then, on a node-local tier of several nodes, the committed
    manifest copied to every node.  Returns once every node holds it."""
    import torch.distributed.checkpoint as dcp

    writer = _writer(uri, store_options, options)
    writer.planner = planner  # a planner caching its plans hands the Writer cached ones
    pg = process_group if process_group is not None else checkpoint_group()
    if _dist() is None:
        dcp.save(state_dict, storage_writer=writer, planner=planner, no_dist=True)
        return
    _wait_previous(pg)
    if spans := _spans_nodes(writer, pg):
        writer.replica_group = replica_stream.group_for(pg)
    dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=pg)
    if spans:
        _distribute(writer, pg)


def async_save(
    state_dict: dict[str, Any],
    uri: Writer | str,
    *,
    stager: Stager | None = None,
    process: bool = False,
    process_group: Any = None,
    store_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Future[Any]:
    """``dcp.async_save`` to ``uri`` (a URI or a :class:`Writer`), staged by ``stager``
    (reused across calls).

    Returns once the state is staged: the caller may change its tensors; the checkpoint
    keeps the values of this moment.  The returned future completes when the checkpoint is
    committed, and on a node-local tier of several nodes, once every node holds its
    manifest.  ``process=True`` runs the save in DCP's checkpoint process (the stager should
    then be made with ``share_memory=True``).  A later call with the same stager, or on the
    same group, waits for this save to finish first.  ``kwargs`` go to ``dcp.async_save``
    (``planner``, ...).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    writer = _writer(uri, store_options, {})
    writer.planner = kwargs.get("planner")
    if stager is None:
        stager = Stager(share_memory=process)
    pg = process_group if process_group is not None else checkpoint_group()
    _wait_previous(pg)
    kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    if pg is not None and not process and _spans_nodes(writer, pg):
        writer.replica_group = replica_stream.group_for(pg)  # out of reach of a process
    fut = dcp.async_save(
        state_dict,
        storage_writer=writer,
        async_stager=stager,
        async_checkpointer_type=kind,
        process_group=pg,
        **kwargs,
    )
    upload: Future[Any] = fut.upload_completion if hasattr(fut, "upload_completion") else fut
    if pg is not None and _spans_nodes(writer, pg):
        out: Future[Any] = Future()

        def then(f: Future[Any]) -> None:
            try:
                f.result()
                _distribute(writer, pg)
            except BaseException as e:
                out.set_exception(e)
            else:
                out.set_result(None)

        upload.add_done_callback(lambda f: _executor().submit(then, f))
        upload = out
    if pg is not None:
        with _lock:
            _after[id(pg)] = upload
    stager.track(upload)
    return upload


def _executor() -> ThreadPoolExecutor:
    """One thread: the manifests' distribution, in the order the saves were made."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="fmstore-dcp-commit")
        return _pool


def _wait_previous(pg: Any) -> None:
    """Wait for the previous asynchronous save on ``pg`` (its collectives must not
    interleave with this one's); its failure was the caller's to see on its future."""
    with _lock:
        prev = _after.pop(id(pg), None)
    if prev is not None:
        with contextlib.suppress(BaseException):
            prev.result()


def _distribute(writer: Writer, pg: Any) -> None:
    """After the commit: the coordinator's manifest bytes to every rank, written by the
    lowest rank of each other node; raises on every rank if some node could not write it
    (the checkpoint stays committed; a restore adopts that node's part)."""
    dist = _dist()
    rank = dist.get_rank(pg)
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = runtime.run(read_bounded_manifest(writer.store))
        except Exception as e:  # every rank raises it below, none waits for the others
            box[0] = f"the coordinator could not read its manifest again: {reason(e)}"
    box[0] = broadcast_result(pg, 0, box[0], limit=manifest_limit())
    err = ""
    try:
        if isinstance(box[0], str):
            raise FmstoreError(box[0])
        m = DcpManifest.loads(box[0], where=f"{writer.uri}/{MANIFEST_KEY}")
        me = node_id()
        part = m.part_of(me)
        if part is not None and rank == min(part.ranks) and 0 not in part.ranks:
            runtime.run(_put_manifest(writer.store, box[0]))
    except Exception as e:  # reported to every rank below
        err = f"node {node_id()}: {type(e).__name__}: {e}"
    errors = _gather(pg, err)
    bad = [e for e in errors if e]
    if bad:
        raise FmstoreError(
            f"{writer.uri} is committed, but its manifest could not be copied to every node "
            f"({'; '.join(bad)[:400]}); a restore adopts those nodes' parts",
            key=MANIFEST_KEY,
        )
    # With [tiers.X] replicas: each rank's part to its partner on the next node.
    replicas.replicate(writer.uri, box[0], pg, writer.store_options, writer.replica_stream)


async def _put_manifest(store: Store, data: bytes) -> None:
    try:
        # same-or-fail: these bytes there already mean copied already; another save's
        # manifest on this node is never overwritten
        await commit_manifest(store, data, "same-or-fail")
    except AlreadyExists:
        raise FmstoreError(
            "another manifest is already committed here", tier=store.tier, key=MANIFEST_KEY
        ) from None


def _gather(pg: Any, obj: str) -> list[str]:
    """Every rank's message (an error's text, or ""): JSON, never a pickle."""
    got = gather_json(pg, obj)
    if not all(isinstance(g, str) for g in got):
        raise CorruptData("a rank sent a message that is not text")
    return got


def _gather_problems(pg: Any, p: Problem | None) -> list[Problem | None]:
    """Every rank's problem (or None), sent as JSON and checked on arrival."""
    out = []
    for r, d in enumerate(gather_json(pg, to_json(p))):
        try:
            out.append(from_json(d))
        except ValueError:
            raise CorruptData(f"rank {r} sent a problem that is not one") from None
    return out


def _gather_answers(
    pg: Any, p: Problem | None, own: frozenset[int]
) -> list[tuple[Problem | None, frozenset[int]]]:
    """Every rank's answer about a candidate: its problem (or None) and the saved ranks
    whose blobs its node holds complete; JSON, checked on arrival."""
    out = []
    for r, d in enumerate(gather_json(pg, [to_json(p), sorted(own)])):
        try:
            ok = isinstance(d, list) and len(d) == 2 and isinstance(d[1], list)
            ok = ok and all(type(x) is int and x >= 0 for x in d[1])
            if not ok:
                raise ValueError("not an answer")
            out.append((from_json(d[0]), frozenset(d[1])))
        except ValueError:
            raise CorruptData(
                f"rank {r} sent an answer about a candidate that is not one"
            ) from None
    return out


# ---- the collective restore -------------------------------------------------------------


class CandidatesFailed(NotFound):
    """No candidate is readable by every rank; ``problems``: each candidate and the
    problem every rank agreed on (all ``NO_MANIFEST``: the run has no checkpoint there)."""

    def __init__(self, message: str, problems: Sequence[tuple[str, Problem]]) -> None:
        super().__init__(message)
        self.problems = list(problems)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (CandidatesFailed, (self.message, self.problems))


#: how often a candidate whose state is unknown (a read error) is looked at again, and
#: the pause before each new look (seconds, doubled each time)
UNKNOWN_TRIES = 3
UNKNOWN_PAUSE = 0.2


def load(
    state_dict: dict[str, Any],
    uri: Reader | str | os.PathLike[str],
    *,
    fallbacks: Sequence[str] = (),
    process_group: Any = None,
    planner: Any = None,
    store_options: dict[str, Any] | None = None,
    passed: list[tuple[str, Problem]] | None = None,
    **options: Any,
) -> str:
    """Load the first of ``uri`` (a URI, or a :class:`Reader`: its URI, store and read
    options) and ``fallbacks`` that every rank can read into ``state_dict`` (in place, like
    ``dcp.load``), the same one on every rank; returns it.

    Candidates on a node-local tier are used only when every rank's node holds its part
    (checked with the manifest, before anything is read) under the same rank-to-node map
    as the save, or a replica restores it; a pending part whose manifest another node
    holds is adopted, and pending parts of a save no node holds a manifest of (every rank
    answered, none with an error) are removed.  If any rank's read fails (a bad checksum,
    a missing blob) every rank goes on to the next candidate.  A candidate some rank could
    not look at (a read error: its state is unknown) is looked at again
    (:data:`UNKNOWN_TRIES`), then the error is raised on every rank: never skipped for an
    older one.  An error that is no storage error (a bug, a wrong argument:
    :data:`~.problems.Code.FAILED`) on any rank raises :class:`FmstoreError` on every rank
    at once.  Raises :class:`CandidatesFailed` (a :class:`NotFound`) naming every
    candidate and why it was passed over; ``passed``, when given, receives the candidates
    passed over before the one loaded.  Without a process group the same rules hold for
    the one process: only a manifest the store says is absent sends it to the next
    candidate as "no checkpoint"; a read error is looked at again, then raised; any other
    error than fmstore's is raised as it is.
    """
    if isinstance(uri, Reader):
        if store_options is not None or options:
            raise TypeError("load(Reader(...)): give store_options and read options to the Reader")
        store_options, options, uri = uri.store_options, dataclasses.asdict(uri.options), uri.uri
    if not all(isinstance(u, (str, os.PathLike)) for u in (uri, *fallbacks)):
        raise TypeError(f"load() takes URIs or a Reader, not {uri!r:.80} {fallbacks!r:.80}")
    so = dict(store_options or {})
    pg = process_group if process_group is not None else checkpoint_group()
    why: list[tuple[str, Problem]] = [] if passed is None else passed
    for cand in [os.fspath(u) for u in (uri, *fallbacks)]:
        problem = _load_one(state_dict, cand, so, pg, planner, options)
        looks = 1
        while (move := next_move(problem, looks, UNKNOWN_TRIES)) is Move.LOOK_AGAIN:
            time.sleep(UNKNOWN_PAUSE * 2 ** (looks - 1))
            problem = _load_one(state_dict, cand, so, pg, planner, options)
            looks += 1
        if move is Move.LOAD:
            return cand
        assert problem is not None  # a candidate not loaded has one
        if move is Move.RAISE and problem.code is Code.FAILED:
            raise FmstoreError(f"restoring {cand} failed on a rank, not retried: {problem.text}")
        if move is Move.RAISE:
            raise StoreUnavailable(
                f"could not tell whether {cand} is a committed checkpoint after "
                f"{UNKNOWN_TRIES} looks ({problem.text}); not falling back to an older step"
            )
        why.append((cand, problem))
    text = "; ".join(f"{c}: {p.text}" for c, p in why)
    raise CandidatesFailed("no checkpoint every rank can read: " + text[:1500], why)


def _load_one(
    state_dict: dict[str, Any],
    cand: str,
    so: dict[str, Any],
    pg: Any,
    planner: Any,
    options: dict[str, Any],
) -> Problem | None:
    """One look at ``cand``: the collective one (:func:`_try`), or without a process group
    a plain load, its problem coded by :func:`~.problems.code_of` (only the manifest's
    absence is ``NO_MANIFEST``; a read error leaves the candidate unknown; a failure is
    raised, the error inside DCP's ``CheckpointException`` unwrapped)."""
    if _dist() is not None:
        return _try(state_dict, cand, so, pg, planner, options)
    import torch.distributed.checkpoint as dcp

    try:
        reader = Reader(cand, store_options=so, **options)
        # Looked at first, outside DCP: its load reports a failed metadata read as a bare
        # AssertionError, which would hide whether the manifest is absent or unreadable.
        reader.read_metadata()
        reader.checked = reader.manifest  # not read a second time
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if code_of(e) is not Code.FAILED:
            return Problem(code_of(e), reason(e))
        if fmstore_error(e) is e:
            raise
        raise fmstore_error(e) from fmstore_error(e).__cause__  # unwrapped from DCP's
    return None


def _load_problem(e: BaseException) -> Problem:
    """This rank's problem when its load raised ``e`` (:func:`~.problems.code_of`): a read
    error or a failure as they are, any other verdict makes the candidate unusable."""
    code = code_of(e)
    return Problem(code if code in (Code.READ_ERROR, Code.FAILED) else Code.UNUSABLE, reason(e))


def _try(
    state_dict: dict[str, Any],
    cand: str,
    so: dict[str, Any],
    pg: Any,
    planner: Any,
    options: dict[str, Any],
) -> Problem | None:
    """Every rank: prepare ``cand`` and load it; the problem every rank agrees on, None
    once loaded.  A read that failed without a verdict (:class:`StoreUnavailable`,
    :class:`PermissionDenied`: :func:`~.problems.code_of`) is a ``READ_ERROR``, another
    error than fmstore's or DCP's verdict a ``FAILED``; a bad checksum or a missing blob
    makes the candidate ``UNUSABLE``."""
    import torch.distributed.checkpoint as dcp

    problem, prepared = _prepare(cand, so, pg)
    if problem is not None:
        return problem
    err: Problem | None = None
    reader = Reader(cand, store_options=so, **options)
    routes, reader.checked = prepared or (None, None)  # the manifest parsed once per rank
    if routes is not None and reader.checked is not None:
        cfg = so.get("config")
        where = replicas.replica_uri(cand, cfg) if replicas.replicas_of(cand, cfg) else cand
        reader.peers = Peers(pg, _dist().get_rank(pg), routes, where, reader.checked)
    alone = plans_alone(planner)  # no gather and scatter of every rank's plan
    read: Callable[[], None] | None = None
    try:
        if alone:
            read = plan_here(state_dict, reader, planner, _dist().get_rank(pg))
        else:
            dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=pg)
    except BaseException as e:
        err = _load_problem(e)
    if alone:  # every rank planned before any reads: an error leaves every state as it was
        if (err := first(_gather_problems(pg, err))) is not None:
            return err
        assert read is not None  # planned here, as no rank has a problem
        try:
            read()
        except BaseException as e:
            err = _load_problem(e)
    return first(_gather_problems(pg, err))


def _prepare(
    uri: str, so: dict[str, Any], pg: Any
) -> tuple[Problem | None, tuple[Routes | None, DcpManifest] | None]:
    """Agree on whether ``uri`` is readable by every rank, adopting or removing pending
    parts; no problem when it is (the same answer on every rank), with its manifest as
    parsed here (the Reader parses it no second time) and the routes of its blobs when some
    rank reads blobs from another node or its node's replicas (else None)."""
    dist = _dist()
    rank = dist.get_rank(pg)
    # Every step below answers on every rank, errors included: a rank that raised here
    # would leave the others waiting in the next collective.
    views = View.gather(pg, look(uri, so, rank))
    nodes = tuple(v.node for v in views)
    holders = [v for v in views if v.digest is not None]
    unread = [(v.node, p) for v in views for p in (v.error, v.held_error) if p is not None]
    if failed := [p for _n, p in unread if p.code is Code.FAILED]:
        return failed[0], None  # a bug on some rank: raised on every rank
    if not holders:
        bad = [v for v in views if v.error is not None]
        if bad:
            # Some node could not look: it may hold the manifest.  Nothing is removed.
            text = f"node {bad[0].node} could not look: {bad[0].error.text}"  # type: ignore[union-attr]
            return Problem(Code.READ_ERROR, text), None
        pending = [v for v in views if v.pending]
        if views[rank].pending and rank == lowest_rank(nodes, views[rank].node):
            with contextlib.suppress(Exception):  # stays pending: the next restore retries
                runtime.run(drop_pending(open_candidate(uri, so), views[rank].pending, nodes))
        if pending:
            text = "never committed: no node holds its manifest; its pending parts are removed"
            return Problem(Code.NO_MANIFEST, text), None
        return Problem(Code.NO_MANIFEST, "no committed checkpoint there"), None
    src = holders[0]
    box: list[Any] = [None]
    if rank == src.rank:
        try:
            box[0] = runtime.run(read_bounded_manifest(open_candidate(uri, so)))
        except Exception as e:
            box[0] = f"node {src.node} could not read its manifest again: {reason(e)}"
    box[0] = broadcast_result(pg, src.rank, box[0], limit=manifest_limit())
    if isinstance(box[0], str):  # the holder could not read it again: unknown
        return Problem(Code.READ_ERROR, box[0]), None
    mine_p: Problem | None = None
    m: DcpManifest | None = None
    own: frozenset[int] = frozenset()
    try:
        m = DcpManifest.loads(box[0], where=f"{uri}/{MANIFEST_KEY}")
    except Exception as e:
        mine_p = Problem(Code.UNUSABLE, reason(e))
    else:
        try:
            mine_p, own = runtime.run(_check_part(uri, so, m, views, rank, src))
        except Exception as e:  # listing this node's blobs failed: unknown
            mine_p = look_failed(e, f"this node's part of {uri}")
    answers = _gather_answers(pg, mine_p, own)
    every = [p for p, _own in answers]
    problem = first(every)
    routes: Routes | None = None
    # What no node is known to hold may be in the replicas a node could not read (I3).
    unknown = next(
        (Problem(Code.READ_ERROR, f"node {n} could not look: {p.text}") for n, p in unread), None
    )
    if problem is None and m is not None and _remapped(m, views, uri, so):
        # The relaunch put ranks on other nodes than the save: each item from a node
        # that holds it, or the candidate passed over (a shared tier reads it).
        problem, routes = _route(m, views, [o for _p, o in answers], src)
        if problem is not None:  # a saved rank on no node, even as a replica
            return unknown or problem, None
    if problem is not None:
        # Parts lost with their nodes come back from the replicas other nodes hold.
        lacking = [r for r, p in enumerate(every) if p is not None]
        fetches = None
        if m is not None and all(p is None or p.code is Code.LACKS_PART for p in every):
            held = [v.held for v in views]
            fetches = replicas.sources(uri, so, m, src.digest or "", held, lacking, pg)
            problem = problem if fetches is not None else unknown or problem
        if m is None or fetches is None:
            return problem, None
        errs = [e for e in _gather(pg, replicas.fetch(uri, so, m, fetches, pg)) if e]
        if errs:
            text = f"{problem.text}; its replica did not restore it ({errs[0]})"
            return Problem(Code.UNUSABLE, text), None
    assert m is not None  # no problem: the manifest was read
    # Every rank can read its part: the nodes that lacked the manifest adopt theirs.
    err: Problem | None = None
    if m.parts and views[rank].digest is None and tier_scope(uri, so.get("config")) == "node":
        part = m.part_of(views[rank].node)
        # Routed, a node that lost its part reads every blob from others: nothing to adopt.
        holds = routes is None or bool(answers[rank][1])
        if part is not None and holds and rank == lowest_rank(nodes, views[rank].node):
            try:
                runtime.run(_put_manifest(open_candidate(uri, so), box[0]))
            except Exception as e:
                text = f"node {views[rank].node} could not adopt its part: {reason(e)}"
                err = Problem(Code.UNUSABLE, text)
    return first(_gather_problems(pg, err)), (routes, m)


def _remapped(m: DcpManifest, views: list[View], uri: str, so: dict[str, Any]) -> bool:
    """Whether ``m`` is in node-local parts and some rank runs on another node than its
    part was saved on (every rank decides alike, from gathered facts)."""
    if not m.parts or tier_scope(uri, so.get("config")) != "node":
        return False
    return any(m.node_of_rank(v.rank) != v.node for v in views)


def _route(
    m: DcpManifest, views: list[View], own: list[frozenset[int]], src: View
) -> tuple[Problem | None, Routes | None]:
    """The routes of a remapped restore (every rank alike), or why there are none."""
    holdings = [
        Holding(
            v.rank,
            v.node,
            own[v.rank],
            frozenset(v.held[1]) if v.held[0] == src.digest else frozenset(),
        )
        for v in views
    ]
    got = route(m.world_size, holdings)
    if isinstance(got, Routes):
        return None, got
    text = (
        f"ranks {list(got)[:8]} of the save are on no node of this job (its ranks moved "
        "to other nodes, and those parts are lost): restore from a shared tier"
    )
    return Problem(Code.LACKS_PART, text), None


async def _check_part(
    uri: str, so: dict[str, Any], m: DcpManifest, views: list[View], rank: int, src: View
) -> tuple[Problem | None, frozenset[int]]:
    """Why this rank cannot read its share of the checkpoint ``m`` at ``uri`` (None if it
    can), and the saved ranks whose blobs this node's part holds complete."""
    me = views[rank]
    none: frozenset[int] = frozenset()
    if me.digest is not None and me.digest != src.digest:
        text = (
            f"node {me.node} holds another manifest than node {src.node} (two saves to one prefix?)"
        )
        return Problem(Code.UNUSABLE, text), none
    if not m.parts or tier_scope(uri, so.get("config")) != "node":
        # In one part, or on a shared tier: every rank sees the same store, DCP's read
        # checks the rest.
        if me.digest is None:
            text = f"node {me.node} (rank {me.rank}) cannot see the manifest node {src.node} reads"
            return Problem(me.error.code if me.error else Code.UNUSABLE, text), none
        return None, none
    if m.world_size != len(views):
        return Problem(
            Code.UNUSABLE,
            f"saved by {m.world_size} ranks in node-local parts, restored by {len(views)}: "
            "node-local parts are not used; restore from a shared tier",
        ), none
    part = m.part_of(me.node)
    have: dict[str, int] = {}
    if part is not None:
        try:
            store = open_candidate(uri, so)
        except NotFound:
            pass  # not even the checkpoint's directory on this node
        else:
            have = {o.key: o.size async for o in store.list(f"{m.generation}/") if not o.is_dir}
    short: dict[int, str] = {}  # saved rank of this node's part -> the first blob it lacks
    for b in m.blobs:
        if part is None or b.rank not in part.ranks or b.rank in short:
            continue
        key = f"{m.generation}/{b.name}"
        size = have.get(key)
        if size != b.size:
            short[b.rank] = (
                f"{key} is {'missing' if size is None else f'{size} bytes, not {b.size}'}"
            )
    own = frozenset(r for r in (part.ranks if part else ()) if r not in short)
    if me.rank in short and m.node_of_rank(me.rank) == me.node:
        return Problem(
            Code.LACKS_PART,
            f"node {me.node} lacks its part (rank {me.rank}'s blob {short[me.rank]}; "
            "was the node replaced or its NVMe wiped?)",
        ), own
    return None, own
