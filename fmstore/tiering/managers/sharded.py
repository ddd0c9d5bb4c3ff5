"""``ShardedCheckpointManager``: steps of a sharded (DCP) state, across ranks and nodes.

The sibling of :class:`~fmstore.tiering.managers.manager.CheckpointManager` for state that every rank
holds a shard of (FSDP2, DTensor): a DCP load fills the caller's tensors in place, so
:meth:`ShardedCheckpointManager.restore` takes the state to fill instead of returning one.
Every method but :meth:`save`'s wait is a collective of every rank of ``process_group``
(a gloo group for checkpoint traffic only).

* :meth:`save` (every rank, same step) stages the state with fmstore's ``Stager`` (the
  stall is the device-to-host copy) and writes it in the background to the write tier
  through :func:`fmstore.checkpoint.dcp.async_save` (on a node-local tier, one part per
  node, the manifest then copied to every node);
* :meth:`latest_step` is the newest step some node holds committed (its manifest read and
  validated, never a file merely there), the same on every rank;
* :meth:`restore` loads the newest step every rank can read, from the fastest tier of the
  ladder that holds it for every rank (:func:`fmstore.checkpoint.dcp.load`): all ranks fall
  back together to a slower tier, then to an older step; it returns None when every rank
  found no manifest, with no error, for every candidate (a job killed in its first save, an
  empty step directory).  A candidate some rank could not look at (a read error) is retried,
  then raised: never skipped for an older step.  Having fallen back, it moves the newer
  steps aside on every node (:mod:`.aside`), so that the job's redo of them saves;
* :meth:`should_save` agrees at each step, on every rank, whether to save now (every N
  steps, or because some rank got SIGTERM: the handler only sets a flag).

No failure is lost: a failed background save (DCP's, or a collective's: every rank sees it)
is raised by the next :meth:`save` (after it waits for the previous one), by :meth:`wait`
and by :meth:`close`; a failure of this rank alone (recording in the catalog) is logged at
error and raised by :meth:`wait` and :meth:`close` only, so that no rank leaves a
collective the others enter.  The error raised is fmstore's own (the one DCP's
``CheckpointException`` wraps).

It works the same with every tier shared (one node, or Lustre as the write tier).  Each
committed step is recorded in the node's catalog (by the node's lowest rank), so the node's
``fmstore daemon`` exports its part, retains and releases it by ``[policies]``
(``docs/distributed.md``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import signal
import threading
from typing import Any

from ... import runtime
from ...checkpoint.dcp import Stager, checkpoint_group
from ...checkpoint.dcp import async_save as dcp_async_save
from ...checkpoint.dcp import load as dcp_load
from ...checkpoint.dcp.collective import CandidatesFailed
from ...checkpoint.dcp.nodes import node_id
from ...checkpoint.layout import checkpoint_key, parse_step, step_name
from ...config import Config, get_config, is_node_id, load_config
from ...errors import ConfigError, CorruptData, FmstoreError, NotFound, StoreUnavailable
from ...protocol.problems import Code, Problem, fmstore_error, reason
from ...protocol.wire import gather_json
from ..inventory.foreign import step_patterns
from ..policy.rules import from_config
from ..tiers import Tiers

__all__ = ["ShardedCheckpointManager"]

log = logging.getLogger("fmstore.tiering")
_flag_lock = threading.Lock()
_flag_groups: dict[int, Any] = {}


class ShardedCheckpointManager:
    """Sharded checkpoints of one run (``root``: a key prefix on every tier, like ``runs/a``).

    ``process_group``: the checkpoint group (default: one gloo group made on first use).
    ``config``: a :class:`~fmstore.config.Config` or a path to ``fmstore.toml`` (default the
    usual lookup); every tier of the saves and restores is looked up in it.
    ``write_tier`` and ``ladder`` (fastest first) default to the config's ``[policies]``.
    ``write_options``: :class:`~fmstore.checkpoint.dcp.WriteOptions` fields.
    ``handle_sigterm``: install a SIGTERM handler that sets the flag :meth:`should_save`
    agrees on (from the main thread only; the previous handler is restored by
    :meth:`close`).
    """

    def __init__(
        self,
        root: str,
        *,
        process_group: Any = None,
        config: Config | str | os.PathLike[str] | None = None,
        write_tier: str | None = None,
        ladder: list[str] | None = None,
        stager: Stager | None = None,
        write_options: dict[str, Any] | None = None,
        record: bool | None = None,
        handle_sigterm: bool = True,
    ) -> None:
        if isinstance(config, Config):
            self.config = config
        else:
            self.config = get_config() if config is None else load_config(config)
        policies = from_config(self.config)
        #: the tiers this node's exports write to (where a step a restore abandoned is fenced)
        self._export_dests = [e.to for e in policies.exports]
        self.root = root.strip("/")
        checkpoint_key(self.root, 0)  # validates the root as a key
        if (declared := step_patterns(self.config).get(self.root)) is not None:
            # its parts, replicas and restores are keyed step_…: one name per step
            raise ConfigError(
                f'{self.config.origin}: [runs."{self.root}"] declares step_pattern '
                f"{declared.text!r}, but ShardedCheckpointManager names its steps "
                "step_NNNNNNNNNNNN: remove the step_pattern, or save under another run root"
            )
        self.ladder = list(ladder or policies.ladder)
        self.write_tier = write_tier or policies.write_tier
        for t in [*self.ladder, self.write_tier]:
            self.config.tier(t)  # ConfigError naming the configured tiers
        self.pg = process_group if process_group is not None else checkpoint_group()
        self.stager = stager or Stager()
        self.write_options = dict(write_options or {})
        #: what every store of this manager is opened with: the caller's config
        self.store_options: dict[str, Any] = {"config": self.config}
        self.tiers = Tiers(self.config)
        self._pending: list[cf.Future[Any]] = []
        self._records: list[threading.Event] = []
        self._local_errors: list[BaseException] = []
        self._unlisted: list[str] = []
        self._unlisted_anywhere: list[str] = []
        #: Record each committed step in this node's catalog (its lowest rank does, by
        #: default), for the node's ``fmstore daemon`` to tier it.
        self.record = os.environ.get("LOCAL_RANK", "0") == "0" if record is None else record
        self.restored_step: int | None = None
        #: the tier the last :meth:`restore` read from
        self.restored_tier: str | None = None
        #: why the last :meth:`restore` passed over each faster or newer candidate
        self.restored_reason: list[str] = []
        #: the newer steps the last :meth:`restore` moved aside on some node (it fell back)
        self.moved_aside: list[int] = []
        #: set once :meth:`should_save` agreed that some rank got SIGTERM
        self.preempted = False
        self._sigterm = threading.Event()
        self._flag_pg: Any = None
        self._prev_handler: Any = None
        self._handler_set = False
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            self._prev_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._handler_set = True
        self._closed = False

    def _flag_group(self) -> Any:
        """A gloo group of the checkpoint group's ranks for :meth:`should_save`'s flag (the
        checkpoint group's collectives run in the background saves' threads too): made by
        the first call, on every rank at the same step, and shared by the managers of one
        checkpoint group."""
        if self.pg is None:
            return None
        if self._flag_pg is None:
            import torch.distributed as dist

            with _flag_lock:
                if id(self.pg) not in _flag_groups:
                    ranks = dist.get_process_group_ranks(self.pg)
                    _flag_groups[id(self.pg)] = dist.new_group(ranks=ranks, backend="gloo")
                self._flag_pg = _flag_groups[id(self.pg)]
        return self._flag_pg

    def uri(self, tier: str, step: int) -> str:
        return f"{tier}:{checkpoint_key(self.root, step)}"

    # ---- saving ------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any]) -> cf.Future[Any]:
        """Every rank: stage ``state`` and save it as ``step`` in the background; the future
        completes once the step is committed (and on every node).  Waits for the previous
        save first and raises its failure (every rank sees it alike)."""
        step_name(step)  # validates
        from ...checkpoint.dcp import Writer

        self._settle()
        w = Writer(
            self.uri(self.write_tier, step),
            store_options=self.store_options,
            **self.write_options,
        )
        fut = dcp_async_save(state, w, stager=self.stager, process_group=self.pg)
        if self.record:
            done = threading.Event()
            self._records = [e for e in self._records if not e.is_set()] + [done]
            fut.add_done_callback(lambda f: self._recorded(f, step, done))
        self._pending.append(fut)
        return fut

    def _settle(self, timeout: float | None = None) -> None:
        """Wait for every pending save; raise the first failure (fmstore's own error)."""
        pending, self._pending = self._pending, []
        failure: BaseException | None = None
        for f in pending:
            try:
                f.result(timeout)
            except cf.TimeoutError:
                raise
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                failure = failure or e
        if failure is not None:
            inner = fmstore_error(failure)
            if inner is failure:
                raise failure
            raise inner from None

    def _recorded(self, fut: cf.Future[Any], step: int, done: threading.Event) -> None:
        """Once ``step`` is committed (and on this node), record it in this node's catalog
        so that its ``fmstore daemon`` exports, retains and releases it by ``[policies]``
        (the same rows on every node: the step and its manifest's creation time)."""
        if fut.cancelled() or fut.exception() is not None:
            done.set()
            return

        def record() -> None:
            try:
                self._record(step, self.write_tier)
            finally:
                done.set()

        # Off the thread that completed the future (it may be an event loop's); wait()
        # waits for it, so a job that waits for its saves has them recorded too.
        threading.Thread(target=record, name="fmstore-record").start()

    def _record(self, step: int, tier: str) -> None:
        """Record ``step``'s copy on ``tier`` (this node's part, on a node-local tier) in
        this node's catalog; a failure is this rank's alone: logged at error, raised by
        :meth:`wait` and :meth:`close`."""
        from ...checkpoint.verify import read_committed
        from ...format.checksum import crc32c
        from ..inventory import catalog as cat

        try:
            store = self.tiers.checkpoint(tier, self.root, step)
            data, m = runtime.run(read_committed(store))
            with cat.Catalog.for_state_dir(self.config.state_dir) as c:
                c.record_checkpoint(
                    self.root,
                    step,
                    bytes=m.stored_bytes,
                    manifest_crc32c=crc32c(data),
                    created=getattr(m, "created", None) or None,
                )
                c.set_copy(self.root, step, tier, cat.PRESENT, bytes=m.stored_bytes)
        except Exception as e:  # the save stands; a daemon's rescan finds it again
            log.error(
                "could not record step %d of %r on %s in the catalog: %s", step, self.root, tier, e
            )
            self._local_errors.append(e)

    def wait(self, timeout: float | None = None) -> None:
        """Until every save of this manager is committed and recorded; raises the first
        failure of a save, else the first failure of this rank's recording."""
        self._wait_saves(timeout)
        if self._local_errors:
            err, self._local_errors = self._local_errors[0], []
            raise err

    def _wait_saves(self, timeout: float | None = None) -> None:
        """Wait for the saves and their records; raise a failed save (every rank sees it),
        never this rank's own recording failure (kept for wait() and close())."""
        try:
            self._settle(timeout)
        finally:
            records, self._records = self._records, []
            for done in records:
                done.wait(timeout)

    # ---- preemption --------------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only a flag: a save needs every rank, at the same step (see should_save).  A
        # second SIGTERM goes to the previous handler (by default: the process ends), so a
        # loop that never asks should_save stays killable.
        if not self._sigterm.is_set():
            self._sigterm.set()
            return
        prev = self._prev_handler
        signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
        self._handler_set = False
        if callable(prev):
            prev(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def should_save(self, step: int, every: int | None = None) -> bool:
        """Every rank, at every step (a collective): whether to save ``step`` now, the same
        answer on every rank: every ``every`` steps, or because some rank got SIGTERM since
        the last call (then :attr:`preempted` is set: save, wait, exit)."""
        flag = self._sigterm.is_set()
        group = self._flag_group()
        if group is not None:
            import torch
            import torch.distributed as dist

            t = torch.tensor([1 if flag else 0], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            flag = bool(t.item())
        if flag:
            self.preempted = True
            return True
        return every is not None and every > 0 and step % every == 0

    # ---- restoring ---------------------------------------------------------------------

    def _steps(self, committed: bool) -> dict[str, tuple[set[int], set[int]]]:
        """This rank's view: per tier, with ``committed`` the newest step it sees committed
        (else nothing), and every step directory; the tiers it could not list go to
        :attr:`_unlisted` (as ``(set(), set())`` values are not enough: an unlisted tier may
        hold the newest step)."""
        out: dict[str, tuple[set[int], set[int]]] = {}
        self._unlisted = []
        for tier in self.ladder:
            try:
                out[tier] = runtime.run(self._steps_on(tier, committed))
            except Exception as e:
                # Unreachable from this rank: it sees nothing there (and must still answer
                # the collective, or the other ranks would wait for it).
                out[tier] = (set(), set())
                self._unlisted.append(f"{tier} (node {node_id()}): {reason(e)}")
        return out

    async def _steps_on(self, tier: str, committed: bool) -> tuple[set[int], set[int]]:
        """The newest step committed on ``tier`` (its manifest read and validated, this
        node's part there on a node-local tier: :meth:`Tiers.committed_copy`), when
        ``committed``; and every step directory there."""
        present = await self.tiers.step_dirs(tier, self.root)
        newest = await self.tiers.newest_committed(tier, self.root, present) if committed else None
        return ({newest} if newest is not None else set()), set(present)

    def _views(self, committed: bool = False) -> list[dict[str, tuple[set[int], set[int]]]]:
        """Every rank's :meth:`_steps`; the tiers some rank could not list go to
        :attr:`_unlisted_anywhere` (the same on every rank)."""
        mine = self._steps(committed)
        if self.pg is None:
            self._unlisted_anywhere = list(self._unlisted)
            return [mine]
        # JSON, not pickles (docs/security.md), checked on arrival
        view = {t: [sorted(c), sorted(p)] for t, (c, p) in mine.items()}
        got = gather_json(self.pg, {"view": view, "unlisted": self._unlisted})
        out, unlisted = [], []
        for r, g in enumerate(got):
            us = g.get("unlisted") if isinstance(g, dict) else None
            if not (isinstance(us, list) and all(isinstance(u, str) for u in us)):
                raise CorruptData(f"rank {r} sent a view of its tiers that is not one")
            out.append(_view_of(r, g.get("view")))
            unlisted += [u[:400] for u in us]
        self._unlisted_anywhere = unlisted
        return out

    def latest_step(self) -> int | None:
        """Every rank: the newest step some node holds committed on some tier (its manifest
        read and validated there, with the node's part on a node-local tier), the same on
        every rank; None when there is none."""
        steps = {s for v in self._views(committed=True) for c, _p in v.values() for s in c}
        return max(steps) if steps else None

    def restore(
        self, state: dict[str, Any], step: int | None = None, *, planner: Any = None
    ) -> int | None:
        """Every rank: fill ``state`` (a DCP state dict) from ``step`` (default: the newest
        step every rank can read), the same on every rank; returns it.  None when the run
        has no checkpoint yet (every rank found no manifest, with no error, for every
        candidate).  Raises :class:`~fmstore.errors.NotFound` naming every candidate passed
        over when steps exist but none is readable by every rank (and when ``step`` is
        given and cannot be restored), :class:`~fmstore.errors.StoreUnavailable` when a
        candidate could not be looked at.  Why faster or newer candidates were passed over
        is in :attr:`restored_reason` (and logged by rank 0).  ``planner``: DCP's load
        planner (default torch's), used for every candidate."""
        self._wait_saves()  # this rank's own failures wait for wait() and close()
        views = self._views()
        present = {s for v in views for _c, p in v.values() for s in p}
        steps = sorted(present if step is None else present & {step}, reverse=True)
        if not steps:
            self._no_checkpoint(step)
            return None
        # Newest step first, fastest tier first; a step directory anywhere is a candidate
        # (a pending part of a save that never committed is removed by the collective).
        cands = [
            self.uri(t, s)
            for s in steps
            for t in self.ladder
            if any(s in v[t][1] for v in views if t in v)
        ]
        passed: list[tuple[str, Problem]] = []
        try:
            used = dcp_load(
                state,
                cands[0],
                fallbacks=cands[1:],
                process_group=self.pg,
                planner=planner,
                store_options=self.store_options,
                passed=passed,
            )
        except CandidatesFailed as e:
            self.restored_reason = [f"{c}: {p.text}" for c, p in e.problems]
            if step is None and all(p.code is Code.NO_MANIFEST for _c, p in e.problems):
                self._no_checkpoint(step)
                self._say(f"no checkpoint of {self.root!r} to restore")
                return None
            raise
        self.restored_reason = [f"{c}: {p.text}" for c, p in passed]
        self.restored_reason += [f"could not list {u}" for u in self._unlisted_anywhere]
        tier, _, key = used.partition(":")
        self.restored_tier = tier
        self.restored_step = parse_step(key.rsplit("/", 1)[-1])
        if self.restored_reason:
            self._say(f"restored {used} of {self.root!r}")
        if step is None and self.restored_step is not None:
            self._move_aside_newer(self.restored_step)
        if self.record and self.restored_step is not None:
            from ...checkpoint.dcp.nodes import tier_scope

            if tier_scope(used, self.config) == "node" and self._holds(tier, self.restored_step):
                # A part adopted or written back from a replica is this node's to tier (a
                # node that read every item from other nodes holds nothing of the step).
                self._record(self.restored_step, tier)
        return self.restored_step

    def _move_aside_newer(self, restored: int) -> None:
        """Every rank, after a restore of ``restored`` that chose the step itself: the
        lowest rank of each node moves its directories of newer steps (parts, replicas) on
        the node-local tiers aside (:mod:`.aside`), after their catalog rows and after
        retiring their generations on the shared tiers (:mod:`.retire`: a few bounded
        store calls, no wait for an export), so that the job's redo of those steps saves
        again and no export of the abandoned ones commits.  Raises on every rank if some
        node could not (the restored state stands; the next restore tries again)."""
        import torch.distributed as dist

        nodes = [node_id()] if self.pg is None else gather_json(self.pg, node_id())
        if not all(is_node_id(n) for n in nodes):
            raise CorruptData("a rank sent a node id that is not one")
        me = 0 if self.pg is None else dist.get_rank(self.pg)
        err, moved = "", []
        if nodes.index(nodes[me]) == me:
            try:
                moved = self._move_aside_here(restored)
            except Exception as e:  # reported to every rank below
                err = f"node {nodes[me]}: {reason(e)}"
        got: list[Any] = [[err, moved]] if self.pg is None else gather_json(self.pg, [err, moved])
        ok = all(
            isinstance(g, list)
            and len(g) == 2
            and isinstance(g[0], str)
            and isinstance(g[1], list)
            and all(type(s) is int for s in g[1])
            for g in got
        )
        if not ok:
            raise CorruptData("a rank sent what it moved aside in a form that is not one")
        self.moved_aside = sorted({int(s) for _e, m in got for s in m})
        bad = [str(e) for e, _m in got if e]
        if bad:
            raise FmstoreError(
                f"restored step {restored} of {self.root!r}, but could not move the newer "
                f"steps aside ({'; '.join(bad)[:1000]}); their redo cannot save yet"
            )
        if self.moved_aside and me == 0:
            log.warning(
                "restored step %d of %r: moved its newer steps %s aside for their redo",
                restored,
                self.root,
                self.moved_aside,
                extra={"event": "steps_moved_aside", "fields": {"steps": self.moved_aside}},
            )

    def _move_aside_here(self, restored: int) -> list[int]:
        """This node's part of :meth:`_move_aside_newer`; the steps moved."""
        from ..inventory import aside
        from ..inventory import catalog as cat

        local = list(dict.fromkeys([*self.ladder, self.write_tier, *self._export_dests]))
        shared = [t for t in local if self.config.tier(t).scope != "node"]
        local = [t for t in local if self.config.tier(t).scope == "node"]
        moved: set[int] = set()
        for tier in local:
            store = self.tiers.store(tier)
            steps = aside.newer_steps(store, tier, self.root, restored)
            if not steps:
                continue
            # No new export of them starts (the daemon exports catalog rows) ...
            # (its rows of unfinished exports of them go too: their source is moving).
            with cat.Catalog.for_state_dir(self.config.state_dir) as c:
                for s in steps:
                    for row in c.copies(self.root, step=s):
                        if row.tier == tier or (row.tier in shared and row.state != cat.PRESENT):
                            c.forget_copy(self.root, s, row.tier)
            # ... and none under way anywhere commits them: their generations are retired
            # on every shared tier first (an export still reading the part is fenced at its
            # commit), then the directories move.
            gens = aside.generations(store, tier, self.root, steps)
            retired = runtime.run(self._fence(shared, gens))
            with cat.Catalog.for_state_dir(self.config.state_dir) as c:
                for t, s in retired:
                    c.forget_copy(self.root, s, t)
            aside.move_aside(store, tier, self.root, steps, now=self.tiers.env.now())
            moved.update(steps)
        return sorted(moved)

    async def _fence(self, shared: list[str], gens: dict[int, set[str]]) -> list[tuple[str, int]]:
        """Retire each generation of ``gens`` (step -> generations this node holds) on
        every tier of ``shared`` (:func:`.retire.fence`), within :data:`FENCE_LIMIT`
        seconds in all; the (tier, step) of each commit taken back."""
        import asyncio

        from ..exports import retire

        async def go() -> list[tuple[str, int]]:
            out = []
            for t in shared:
                for s, gs in sorted(gens.items()):
                    dst = self.tiers.checkpoint(t, self.root, s)
                    for g in sorted(gs):
                        if await retire.fence(dst, g, self.tiers.env):
                            out.append((t, s))
            return out

        try:
            return await asyncio.wait_for(go(), FENCE_LIMIT)
        except TimeoutError:
            raise StoreUnavailable(
                f"could not retire the abandoned steps {sorted(gens)} on {shared} within "
                f"{FENCE_LIMIT:g} s"
            ) from None

    def _holds(self, tier: str, step: int) -> bool:
        """Whether this node holds ``step`` committed on ``tier`` (its manifest validated,
        with this node's part: :meth:`Tiers.committed_copy`); a read error: it may, and
        recording it says what went wrong."""
        try:
            return runtime.run(self.tiers.committed_copy(tier, self.root, step)) is not None
        except Exception:
            return True

    def _no_checkpoint(self, step: int | None) -> None:
        """Raise unless "no checkpoint" is known: every rank listed every tier."""
        if self._unlisted_anywhere:
            raise StoreUnavailable(
                f"could not tell whether {self.root!r} has a checkpoint: could not list "
                + "; ".join(self._unlisted_anywhere)[:1500]
            )
        if step is not None:
            raise NotFound(f"step {step} of {self.root!r} is on none of {self.ladder}")

    def _say(self, what: str) -> None:
        """Rank 0 logs why the last restore passed over each candidate."""
        import torch.distributed as dist

        if self.pg is None or dist.get_rank(self.pg) == 0:
            why = "; ".join(self.restored_reason)[:2000]
            log.warning(
                "%s; passed over: %s",
                what,
                why,
                extra={"event": "restore_passed_over", "fields": {}},
            )

    # ---- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Wait for every save (raising the first failure, then this rank's recording
        failure) and restore the previous SIGTERM handler."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._handler_set:
                prev = self._prev_handler
                with contextlib.suppress(ValueError):  # not the main thread: leave it
                    signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
            self._handler_set = False

    def __enter__(self) -> ShardedCheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The most seconds a node's leader spends retiring the steps a restore abandoned on the
#: shared tiers (a few bounded store calls per step and tier), between two collectives.
FENCE_LIMIT = 10.0


def _view_of(rank: int, v: Any) -> dict[str, tuple[set[int], set[int]]]:
    """A rank's view as gathered (JSON), checked: per tier, two lists of step numbers."""
    ok = isinstance(v, dict) and all(
        isinstance(t, str)
        and isinstance(pair, list)
        and len(pair) == 2
        and all(isinstance(x, list) and all(type(s) is int for s in x) for x in pair)
        for t, pair in v.items()
    )
    if not ok:
        raise CorruptData(f"rank {rank} sent a view of its tiers that is not one")
    return {t: (set(c), set(p)) for t, (c, p) in v.items()}
