"""``ShardedCheckpointManager``: steps of a sharded (DCP) state, across ranks and nodes.

The sibling of :class:`~fmstore.tiering.manager.CheckpointManager` for state that every rank
holds a shard of (FSDP2, DTensor): a DCP load fills the caller's tensors in place, so
:meth:`ShardedCheckpointManager.restore` takes the state to fill instead of returning one.
Every method but :meth:`save`'s wait is a collective of every rank of ``process_group``
(a gloo group for checkpoint traffic only).

* :meth:`save` (every rank, same step) stages the state with fmstore's ``Stager`` (the
  stall is the device-to-host copy) and writes it in the background to the write tier
  through :func:`fmstore.checkpoint.dcp.async_save` (on a node-local tier, one part per
  node, the manifest then copied to every node);
* :meth:`latest_step` is the newest step some node holds a committed manifest of, the same
  on every rank;
* :meth:`restore` loads the newest step every rank can read, from the fastest tier of the
  ladder that holds it for every rank (:func:`fmstore.checkpoint.dcp.load`): all ranks fall
  back together to a slower tier, then to an older step.

It works the same with every tier shared (one node, or Lustre as the write tier).  Each
committed step is recorded in the node's catalog (by the node's lowest rank), so the node's
``fmstore daemon`` exports its part, retains and releases it by ``[policies]``
(``docs/distributed.md``).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Any

from .. import keys as _keys
from .. import runtime
from ..checkpoint.dcp import Stager, checkpoint_group
from ..checkpoint.dcp import async_save as dcp_async_save
from ..checkpoint.dcp import load as dcp_load
from ..checkpoint.dcp.wire import gather_json
from ..checkpoint.layout import MANIFEST_KEY, checkpoint_key, parse_step, step_name
from ..config import Config, get_config, load_config
from ..errors import CorruptData, NotFound
from .rules import from_config
from .tiers import Tiers

__all__ = ["ShardedCheckpointManager"]


class ShardedCheckpointManager:
    """Sharded checkpoints of one run (``root``: a key prefix on every tier, like ``runs/a``).

    ``process_group``: the checkpoint group (default: one gloo group made on first use).
    ``write_tier`` and ``ladder`` (fastest first) default to the config's ``[policies]``.
    ``write_options``: :class:`~fmstore.checkpoint.dcp.WriteOptions` fields.
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
    ) -> None:
        if isinstance(config, Config):
            self.config = config
        else:
            self.config = get_config() if config is None else load_config(config)
        policies = from_config(self.config)
        self.root = root.strip("/")
        checkpoint_key(self.root, 0)  # validates the root as a key
        self.ladder = list(ladder or policies.ladder)
        self.write_tier = write_tier or policies.write_tier
        for t in [*self.ladder, self.write_tier]:
            self.config.tier(t)  # ConfigError naming the configured tiers
        self.pg = process_group if process_group is not None else checkpoint_group()
        self.stager = stager or Stager()
        self.write_options = dict(write_options or {})
        self.tiers = Tiers(self.config)
        self._pending: list[cf.Future[Any]] = []
        self._records: list[threading.Event] = []
        #: Record each committed step in this node's catalog (its lowest rank does, by
        #: default), for the node's ``fmstore daemon`` to tier it.
        self.record = os.environ.get("LOCAL_RANK", "0") == "0" if record is None else record
        self.restored_step: int | None = None
        #: the tier the last :meth:`restore` read from
        self.restored_tier: str | None = None

    def uri(self, tier: str, step: int) -> str:
        return f"{tier}:{checkpoint_key(self.root, step)}"

    def save(self, step: int, state: dict[str, Any]) -> cf.Future[Any]:
        """Every rank: stage ``state`` and save it as ``step`` in the background; the future
        completes once the step is committed (and on every node)."""
        step_name(step)  # validates
        from ..checkpoint.dcp import Writer

        w = Writer(self.uri(self.write_tier, step), **self.write_options)
        fut = dcp_async_save(state, w, stager=self.stager, process_group=self.pg)
        if self.record:
            done = threading.Event()
            self._records = [e for e in self._records if not e.is_set()] + [done]
            fut.add_done_callback(lambda f: self._recorded(f, step, done))
        self._pending = [f for f in self._pending if not f.done()] + [fut]
        return fut

    def _recorded(self, fut: cf.Future[Any], step: int, done: threading.Event) -> None:
        """Once ``step`` is committed (and on this node), record it in this node's catalog
        so that its ``fmstore daemon`` exports, retains and releases it by ``[policies]``
        (the same rows on every node: the step and its manifest's creation time)."""
        if fut.cancelled() or fut.exception() is not None:
            done.set()
            return

        def record() -> None:
            try:
                self._record(step)
            finally:
                done.set()

        # Off the thread that completed the future (it may be an event loop's); wait()
        # waits for it, so a job that waits for its saves has them recorded too.
        threading.Thread(target=record, name="fmstore-record").start()

    def _record(self, step: int) -> None:
        import logging

        from ..checkpoint.verify import read_committed
        from ..format.checksum import crc32c
        from . import catalog as cat

        try:
            store = self.tiers.checkpoint(self.write_tier, self.root, step)
            data, m = runtime.run(read_committed(store))
            with cat.Catalog.for_state_dir(self.config.state_dir) as c:
                c.record_checkpoint(
                    self.root,
                    step,
                    bytes=m.stored_bytes,
                    manifest_crc32c=crc32c(data),
                    created=getattr(m, "created", None) or None,
                )
                c.set_copy(self.root, step, self.write_tier, cat.PRESENT, bytes=m.stored_bytes)
        except Exception as e:  # the save stands; a daemon's rescan finds it again
            logging.getLogger("fmstore.tiering").warning(
                "could not record step %d of %r in the catalog: %s", step, self.root, e
            )

    def wait(self, timeout: float | None = None) -> None:
        """Until every save of this manager is committed; raises the first failure."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result(timeout)
        records, self._records = self._records, []
        for done in records:
            done.wait(timeout)

    def _steps(self) -> dict[str, tuple[set[int], set[int]]]:
        """This rank's view: per tier, the steps it sees committed and every step directory."""
        out: dict[str, tuple[set[int], set[int]]] = {}
        for tier in self.ladder:
            try:
                out[tier] = runtime.run(self._steps_on(tier))
            except Exception:
                # Unreachable from this rank: it sees nothing there (and must still answer
                # the collective, or the other ranks would wait for it).
                out[tier] = (set(), set())
        return out

    async def _steps_on(self, tier: str) -> tuple[set[int], set[int]]:
        store = self.tiers.store(tier)
        prefix = _keys.validate_prefix(self.root)
        committed: set[int] = set()
        present: set[int] = set()
        try:
            async for meta in store.list(prefix, recursive=False):
                step = parse_step(meta.key[len(prefix) :]) if meta.is_dir else None
                if step is None:
                    continue
                present.add(step)
                if await store.exists(_keys.join(self.root, step_name(step), MANIFEST_KEY)):
                    committed.add(step)
        except NotFound:
            pass
        return committed, present

    def _views(self) -> list[dict[str, tuple[set[int], set[int]]]]:
        mine = self._steps()
        if self.pg is None:
            return [mine]
        # JSON, not pickles (docs/security.md), checked on arrival
        got = gather_json(self.pg, {t: [sorted(c), sorted(p)] for t, (c, p) in mine.items()})
        return [_view_of(r, v) for r, v in enumerate(got)]

    def latest_step(self) -> int | None:
        """Every rank: the newest step some node holds a committed manifest of."""
        steps = {s for v in self._views() for c, _p in v.values() for s in c}
        return max(steps) if steps else None

    def restore(self, state: dict[str, Any]) -> int | None:
        """Every rank: fill ``state`` (a DCP state dict) from the newest step every rank can
        read, the same on every rank; returns it (None when the run has no checkpoint yet).
        Raises :class:`~fmstore.errors.NotFound` naming every candidate passed over when
        steps exist but none is readable by every rank."""
        self.wait()
        views = self._views()
        steps = sorted({s for v in views for _c, p in v.values() for s in p}, reverse=True)
        if not steps:
            return None
        # Newest step first, fastest tier first; a step directory anywhere is a candidate
        # (a pending part of a save that never committed is removed by the collective).
        cands = [
            self.uri(t, s)
            for s in steps
            for t in self.ladder
            if any(s in v[t][1] for v in views if t in v)
        ]
        used = dcp_load(state, cands[0], fallbacks=cands[1:], process_group=self.pg)
        tier, _, key = used.partition(":")
        self.restored_tier = tier
        self.restored_step = parse_step(key.rsplit("/", 1)[-1])
        return self.restored_step


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
