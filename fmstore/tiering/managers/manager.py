"""``CheckpointManager``: save every N steps to the fast tier, let policies carry copies down,
restore the newest complete checkpoint from the fastest tier that holds it.

::

    with fmstore.CheckpointManager("runs/llama-7b") as mgr:      # tiers + [policies] from fmstore.toml
        state = mgr.restore() if mgr.latest_step() is not None else init()
        for step in range(start, steps):
            train_step(state)
            if step % 100 == 0:
                mgr.save(step, state)       # returns once snapshotted; written in the background

Checkpoint ``(root, step)`` lives at ``ROOT/step_SSSSSSSSSSSS`` on every tier (see
:mod:`fmstore.tiering.tiers`); every save and every copy is recorded in the catalog of the
config's ``state_dir``.

**Policies.**  Without an ``fmstore daemon`` on the node, a helper process started by this
one runs them at background priority (:mod:`~fmstore.tiering.service.helper`; ``[daemon]
priority``), so copies, checksums and compression never hold this process's GIL or take a
core training wants; ``run_policies="thread"`` runs them in a thread of this process
instead (:class:`~fmstore.tiering.service.background.BackgroundRunner`, at normal priority).  With a
daemon, the daemon holds the runner lock, the helper stays idle and this process only
records its saves in the catalog.  ``run_policies=False`` never runs them from here.

**Write tier full** (``[policies] on_full``): before writing, the manager compares the
tier's free space with the checkpoint's raw size (compression only shrinks it).  ``"fail"``
(default) raises :class:`~fmstore.errors.TierFull` at once, naming the tier and the sizes;
``"fallback"`` writes to the next tier of the ladder that has room (the catalog records
where).  A tier that fills up *during* a write fails that save (the engine removes the
partial data; nothing committed is touched); a synchronous save then falls back too, an
asynchronous one reports the error from :meth:`wait` (its snapshot is gone by then).

**Restore** tries the newest complete checkpoint first, each tier holding it fastest first;
a copy that is missing or fails its checksums is marked in the catalog and the next tier is
tried; when every copy of a step fails and no step was asked for, the next older step is
tried; the newer steps it fell back past whose copies on a write tier are proven damaged are
then moved aside (deleted on an object store) so that their redo saves (:mod:`.redo`,
:attr:`CheckpointManager.moved_aside`).  With ``[policies.restore] cache_tier`` set, a copy
on a slower tier is brought to the cache tier: ``eager`` copies it whole (verified) and
loads from there; ``lazy`` loads it lazily, fetching blobs on first access and keeping them
on the cache tier.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import filelock

from ... import runtime
from ...checkpoint.layout import checkpoint_key
from ...checkpoint.verify import read_committed
from ...config import Config, get_config, load_config
from ...errors import AlreadyExists, CorruptData, FmstoreError, NotFound, StoreUnavailable, TierFull
from ...format.checksum import crc32c
from ...format.manifest import Manifest
from ..exports.mover import copy_checkpoint
from ..inventory import catalog as cat
from ..inventory.catalog import Catalog
from ..inventory.discovery import rediscover
from ..policy.failures import PolicyWait, close_warning, failing_since_wait, policy_wait
from ..policy.policies import Policies, from_config
from ..policy.runner import PolicyRunner, event
from ..service.background import BackgroundRunner
from ..service.helper import PolicyHelper, tier_problems
from ..tiers import Tiers
from .cache import ReadThroughStore

log = logging.getLogger("fmstore.checkpoint")

#: Bytes added to a checkpoint's raw size when checking free space (manifest, padding).
_SLACK = 1 << 20


class PendingSave:
    """A save in progress: :meth:`result` waits until it is committed and recorded."""

    def __init__(self, step: int, tier: str, future: cf.Future[Manifest]) -> None:
        self.step = step
        self.tier = tier
        self._future = future

    def result(self, timeout: float | None = None) -> Manifest:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def __repr__(self) -> str:
        return f"PendingSave(step={self.step}, tier={self.tier!r}, done={self.done()})"


def _state_nbytes(obj: Any) -> int:
    """Raw bytes of the tensors (and numpy arrays) in a state tree, each storage once."""
    import numpy as np
    import torch

    from ...checkpoint.tree import LazyMapping

    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, LazyMapping):
            # A lazy restore: loaded now in one batch of reads (the save loads it anyway)
            # rather than value by value through values().
            x = x.materialize()
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
        elif isinstance(x, np.ndarray):
            total += x.nbytes
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list | tuple):
            stack.extend(x)
    return total


class CheckpointManager:
    """Tiered checkpoints of one run (``root``: a key prefix on every tier, like ``runs/a``).

    ``config``: a :class:`~fmstore.config.Config`, a path to ``fmstore.toml`` or None (the
    usual lookup).  ``policies``: overrides the config's ``[policies]``.  ``async_save``:
    :meth:`save` returns once the state is snapshotted (default) or once committed.
    ``run_policies``: run export / retention / release unless a daemon does, in a helper
    process (``True`` or ``"process"``) or a thread of this process (``"thread"``).  ``save_on_sigterm``: a callable returning ``(step, state)``; on SIGTERM
    (preemption) that state is saved synchronously before the previous handler runs.
    ``save_options``: passed to :func:`fmstore.save` (compression, chunk_size…).
    """

    def __init__(
        self,
        root: str,
        *,
        config: Config | str | os.PathLike[str] | None = None,
        policies: Policies | None = None,
        async_save: bool = True,
        run_policies: bool | Literal["process", "thread"] = True,
        policy_interval: float = 5.0,
        save_on_sigterm: Callable[[], tuple[int, Any]] | None = None,
        save_options: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(config, Config):
            self.config = config
        elif config is None:
            self.config = get_config()
        else:
            self.config = load_config(config)
        self.policies = (
            policies.validate(self.config.tiers) if policies else from_config(self.config)
        )
        from ..service.daemon import settings_from_config

        # The same copy settings as the daemon ([daemon] concurrency, bwlimit, verify),
        # validated, like the policies, before anything is created.
        ds = settings_from_config(self.config)
        self.root = root.strip("/")
        checkpoint_key(self.root, 0)  # validates the root as a key
        self.async_save = async_save
        self.save_options = dict(save_options or {})
        self.catalog = Catalog.for_state_dir(self.config.state_dir)
        self.tiers = Tiers(self.config)
        self._finisher = cf.ThreadPoolExecutor(1, thread_name_prefix="fmstore-ckpt-commit")
        self._pending: list[PendingSave] = []
        self._lock = threading.Lock()
        self._pins: list[int] = []
        self._discovered = False
        self._discover_lock = threading.Lock()
        self.restored_step: int | None = None
        #: The tier the last :meth:`restore` read from.
        self.restored_tier: str | None = None
        #: The newer steps the last :meth:`restore` cleared out of their redo's way (it
        #: fell back past their damaged copies on a write tier: :mod:`.redo`).
        self.moved_aside: list[int] = []
        self._runner = PolicyRunner(
            self.config,
            self.policies,
            self.catalog,
            tiers=self.tiers,
            mover=ds.transfer,
        )
        if run_policies not in (True, False, "process", "thread"):
            raise ValueError(
                f"run_policies must be True, False, 'process' or 'thread', not {run_policies!r}"
            )
        self._background: BackgroundRunner | PolicyHelper | None = None
        if run_policies == "thread":
            runner = self._runner
            self._background = BackgroundRunner(
                runner, interval=policy_interval, startup_check=lambda: tier_problems(runner)
            )
        elif run_policies:
            self._background = PolicyHelper(
                self.config,
                self.policies,
                ds.transfer,
                interval=policy_interval,
                priority=ds.priority,
            )
        self._sigterm_state = save_on_sigterm
        self._prev_handler: Any = None
        if save_on_sigterm is not None and threading.current_thread() is threading.main_thread():
            self._prev_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    # ---- saving ----------------------------------------------------------------------

    def _choose_tier(self, state: Any) -> str:
        need = _state_nbytes(state) + _SLACK
        ladder = self.policies.ladder
        start = self.policies.rank(self.policies.write_tier)
        first = ladder[start]
        free = self.tiers.free_bytes(first)
        if free is None or free >= need:
            return first
        if self.policies.on_full == "fail":
            raise TierFull(
                f"the write tier has {free} bytes free but this checkpoint needs about {need}; "
                "free space (release policies, retention) or set [policies] on_full = 'fallback'",
                tier=first,
                key=checkpoint_key(self.root, 0).rsplit("/", 1)[0],
            )
        for tier in ladder[start + 1 :]:
            f = self.tiers.free_bytes(tier)
            if f is None or f >= need:
                event("save_fallback", root=self.root, tier=tier, skipped=first, need=need)
                return tier
        raise TierFull(f"no tier of {list(ladder)} has {need} bytes free", tier=first)

    def save(self, step: int, state: Any, *, overwrite: bool = False) -> PendingSave:
        """Save ``state`` as checkpoint ``step`` on the write tier.

        Asynchronous by default: returns once the state is snapshotted; :meth:`wait` (or the
        returned handle's ``result()``) waits for the commit.  Raises
        :class:`AlreadyExists` when ``step`` is already saved (unless ``overwrite``),
        :class:`TierFull` per ``on_full``.
        """
        from ...checkpoint import api

        # What the tiers hold decides which saves are exported (every_saves counts from the
        # newest checkpoint already on each destination): learn it before the first save.
        self._ensure_discovered()
        tier = self._choose_tier(state)
        existing = self.catalog.copy(self.root, step, tier)
        if existing is not None and existing.state == cat.PRESENT and not overwrite:
            raise AlreadyExists(
                f"checkpoint step {step} already exists",
                tier=tier,
                key=self.tiers.key(self.root, step),
            )
        self.catalog.record_checkpoint(self.root, step)
        self.catalog.set_copy(self.root, step, tier, cat.WRITING, error=None)
        store = self.tiers.checkpoint(tier, self.root, step)
        opts = {**self.save_options, "overwrite": overwrite}
        if not self.async_save:
            try:
                manifest = api.save(state, store, **opts)
            except TierFull as e:
                self._abandon(step, tier, e)
                if self.policies.on_full != "fallback":
                    raise
                nxt = self._next_tier(tier)
                event("save_fallback", root=self.root, tier=nxt, skipped=tier, step=step)
                self.catalog.record_checkpoint(self.root, step)
                self.catalog.set_copy(self.root, step, nxt, cat.WRITING)
                tier, store = nxt, self.tiers.checkpoint(nxt, self.root, step)
                manifest = api.save(state, store, **opts)
            except BaseException as e:
                self._abandon(step, tier, e)
                raise
            fut: cf.Future[Manifest] = cf.Future()
            try:
                fut.set_result(self._committed(step, tier, manifest))
            except BaseException as e:
                fut.set_exception(e)
            pending = PendingSave(step, tier, fut)
            pending.result()
            return pending
        try:
            handle = api.async_save(state, store, **opts)
        except BaseException as e:
            self._abandon(step, tier, e)
            raise

        def finish() -> Manifest:
            try:
                manifest = handle.result()
            except BaseException as e:
                self._abandon(step, tier, e)
                raise
            return self._committed(step, tier, manifest)

        pending = PendingSave(step, tier, self._finisher.submit(finish))
        with self._lock:
            self._pending.append(pending)
        return pending

    def _next_tier(self, tier: str) -> str:
        ladder = self.policies.ladder
        i = ladder.index(tier)
        if i + 1 >= len(ladder):
            raise TierFull("no tier left to fall back to", tier=tier)
        return ladder[i + 1]

    def _abandon(self, step: int, tier: str, e: BaseException) -> None:
        """The save raised before its commit (the writer removed its blobs): recorded as
        never committed (``deleted``, ``error`` :data:`~.catalog.SAVE_FAILED`), which
        ``fmstore ckpt list`` shows as ``not committed``."""
        with contextlib.suppress(FmstoreError):
            self.catalog.set_copy(
                self.root,
                step,
                tier,
                cat.DELETED,
                error=f"{cat.SAVE_FAILED}: {type(e).__name__}",
                expect=[cat.WRITING],
            )

    def _committed(self, step: int, tier: str, manifest: Manifest) -> Manifest:
        store = self.tiers.checkpoint(tier, self.root, step)
        data, _ = runtime.run(read_committed(store))
        self.catalog.record_checkpoint(
            self.root, step, bytes=manifest.stored_bytes, manifest_crc32c=crc32c(data)
        )
        # Freshly written with freshly computed checksums: counts as verified.
        self.catalog.set_copy(
            self.root,
            step,
            tier,
            cat.PRESENT,
            bytes=manifest.stored_bytes,
            verified=self.catalog.now(),
        )
        event("saved", root=self.root, step=step, tier=tier, bytes=manifest.stored_bytes)
        if self._background is not None:
            self._background.poke()
        return manifest

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every save in flight; raises the first failure."""
        with self._lock:
            pending, self._pending = self._pending, []
        errors = []
        for p in pending:
            try:
                p.result(timeout)
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def wait_for_policies(self, timeout: float | None = None) -> PolicyWait:
        """Wait until the background policies have nothing left to do (tests, shutdown).

        Returns a :class:`~fmstore.tiering.policy.failures.PolicyWait`, truthy when every policy
        is satisfied; falsy on timeout, when no background runner is active, or as soon as
        an export of this root fails again after ``[policies] warn_after_failures``
        failures in a row (waiting longer does not help until its tier is fixed), carrying
        the exports still pending for this root (``pending``, ``pending_steps``), those
        that keep failing (``failing``) and the newest error (``last_error``), so
        ``if mgr.wait_for_policies(): ...`` keeps working and ``print(result.describe())``
        says why not."""
        self.wait()
        if self._background is None:
            reason = "no background policies in this process (run_policies=False)"
            return policy_wait(False, self.policies, self.catalog, self.root, reason)
        since = self.catalog.now()
        stuck = failing_since_wait(self.catalog, self.root, since, self.policies)
        done = self._background.wait_idle(timeout, give_up=stuck)
        why = None
        if not done:
            why = "an export keeps failing" if stuck() else f"still working after {timeout} s"
        return policy_wait(done, self.policies, self.catalog, self.root, why)

    # ---- what exists -----------------------------------------------------------------

    def refresh(self) -> None:
        """Reconcile the catalog with the tiers for this root: every step whose manifest
        validates on a tier is recorded there as present (a new node, a lost catalog, a save
        that committed but died before recording it: its row said ``writing``); rows in
        other states are left as they are (:func:`~fmstore.tiering.inventory.discovery.rediscover`).
        Done once, on first use."""
        found = runtime.run(
            rediscover(self.catalog, self.tiers, self.policies.ladder, roots=[self.root])
        )
        for tier, error in found.unreachable.items():
            event("refresh_skipped", tier=tier, error=error)
        self._discovered = True

    def _ensure_discovered(self) -> None:
        with self._discover_lock:
            if not self._discovered:
                self.refresh()

    def prepare(self, state: Any) -> cf.Future[int]:
        """Get the first :meth:`save` of a state like ``state`` ready, off the training loop.

        Returns at once.  A background thread learns what the tiers hold (the first save
        would do it on the caller's thread) and, with ``async_save``, allocates and faults in
        the staging buffer a snapshot of ``state`` takes (see
        :func:`fmstore.prepare_async_save`), so the first save stalls no longer than the
        later ones.  Call it once the model and optimizer state exist (optimizer moments
        appear at the first ``step()``).  The future gives the staging buffer's size."""
        from ...checkpoint import api

        fut: cf.Future[int] = cf.Future()

        def run() -> None:
            try:
                self._ensure_discovered()
                size = api.prepare_async_save(state).result() if self.async_save else 0
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(size)

        threading.Thread(target=run, name="fmstore-ckpt-prepare", daemon=True).start()
        return fut

    def steps(self, tier: str | None = None) -> list[int]:
        """Steps committed (on ``tier``, or anywhere), ascending: their manifest was read and
        validated on the tier, by this manager's save or by the scan of its first use
        (:meth:`refresh`), whatever the catalog said before.  Waits for the saves in flight
        first, so a step just saved is there once committed (a failed save's error stays
        for :meth:`wait`)."""
        with self._lock:
            pending = [p._future for p in self._pending]
        cf.wait(pending)
        self._ensure_discovered()
        if tier is not None:
            self.config.tier(tier)
        copies = self.catalog.copies(self.root, tier=tier, states=[cat.PRESENT])
        return sorted({c.step for c in copies})

    def latest_step(self) -> int | None:
        """The newest committed step (:meth:`steps`), None when there is none."""
        s = self.steps()
        return s[-1] if s else None

    def tiers_of(self, step: int) -> list[str]:
        """Tiers holding a complete copy of ``step``, fastest first."""
        have = {c.tier for c in self.catalog.copies(self.root, step=step, states=[cat.PRESENT])}
        return [t for t in self.policies.ladder if t in have]

    # ---- restoring ---------------------------------------------------------------------

    def restore(
        self,
        step: int | None = None,
        *,
        map_location: Any = None,
        keys: str | Sequence[str] | None = None,
        lazy: bool | None = None,
        weights_only: bool = True,
    ) -> Any:
        """Load checkpoint ``step`` (default: the newest complete one); see the module
        docstring for the tier order and fallbacks.  ``lazy``: default from
        ``[policies.restore] mode``.  Raises :class:`NotFound` when no complete copy of
        the step (or of any step) could be read; the step restored is in
        :attr:`restored_step`."""
        self.wait()
        self._ensure_discovered()
        lazy = self.policies.restore.mode == "lazy" if lazy is None else lazy
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        if not candidates:
            raise NotFound(f"no checkpoint under {self.root!r} on any tier")
        failures: list[str] = []
        self.moved_aside = []
        damaged: dict[tuple[int, str], str] = {}  # what this restore's loads proved bad
        for s in candidates:
            pin = self.catalog.pin(
                self.root, s, reason="restore", owner=f"pid {os.getpid()}", ttl=3600
            )
            keep_pin = False
            present = self.tiers_of(s)
            try:
                for tier in [*present, *self._exporting_to(s)]:
                    try:
                        out = self._load_from(s, tier, map_location, keys, lazy, weights_only)
                    except (CorruptData, NotFound) as e:
                        bad = cat.CORRUPT if isinstance(e, CorruptData) else cat.MISSING
                        if tier in present:  # an export's row is its owner's to decide
                            self.catalog.set_copy(self.root, s, tier, bad, error=str(e))
                        damaged[(s, tier)] = f"{bad}: {e}"
                        failures.append(f"step {s} on {tier}: {e}")
                        event("restore_fallback", root=self.root, step=s, tier=tier, error=str(e))
                        continue
                    except StoreUnavailable as e:
                        failures.append(f"step {s} on {tier}: {e}")
                        event("restore_fallback", root=self.root, step=s, tier=tier, error=str(e))
                        continue
                    self.restored_step, self.restored_tier = s, tier
                    self.catalog.touch(self.root, s, tier)
                    keep_pin = lazy
                    event("restored", root=self.root, step=s, tier=tier, lazy=lazy)
                    if step is None:
                        self._clear_newer(s, damaged)
                    return out
            finally:
                if keep_pin:
                    self._pins.append(pin)  # a lazy state still reads from the tiers
                else:
                    self.catalog.unpin(pin)
        what = f"step {step}" if step is not None else "any checkpoint"
        raise NotFound(
            f"could not restore {what} of {self.root!r}: " + "; ".join(failures or ["no copy"])
        )

    def _clear_newer(self, restored: int, damaged: dict[tuple[int, str], str]) -> None:
        """After a restore that chose ``restored`` itself: the newer steps whose copy on a
        write tier is proven damaged stop blocking their redo (:mod:`.redo`: moved aside
        on a POSIX tier, deleted manifest first on an object store); a valid copy is never
        touched.  A failure to do so is logged, never raised: the state is restored, the
        redo fails as it would have, and the next restore tries again."""
        from .redo import clear_newer

        done = clear_newer(self.tiers, self.catalog, self.policies, self.root, restored, damaged)
        self.moved_aside = done.steps
        if self.moved_aside:
            log.warning(
                "restored step %d of %r: moved its newer steps %s aside for their redo (%s)",
                restored,
                self.root,
                self.moved_aside,
                "; ".join(f"step {s} on {w}" for s, ws in done.moved.items() for w in ws)[:2000],
                extra={"event": "steps_moved_aside", "fields": {"steps": self.moved_aside}},
            )
        if done.problems:
            log.warning(
                "restored step %d of %r, but could not look at or move its newer steps on "
                "%s; a redo of a damaged one raises AlreadyExists until the next restore",
                restored,
                self.root,
                "; ".join(done.problems)[:1000],
                extra={"event": "steps_moved_aside_failed", "fields": {}},
            )

    def _exporting_to(self, step: int) -> list[str]:
        """Tiers an export of ``step`` was copying to, fastest first.  An export killed after
        its commit on the destination but before its catalog record leaves the row
        ``exporting`` with a committed copy there: a restore reads it (the load validates
        the manifest and every checksum; no manifest is a miss) when no present copy loads."""
        rows = self.catalog.copies(self.root, step=step, states=[cat.EXPORTING])
        have = {c.tier for c in rows}
        return [t for t in self.policies.ladder if t in have]

    def _load_from(
        self,
        step: int,
        tier: str,
        map_location: Any,
        keys: str | Sequence[str] | None,
        lazy: bool,
        weights_only: bool,
    ) -> Any:
        from ...checkpoint import api

        store = self.tiers.checkpoint(tier, self.root, step)
        cache = self.policies.restore.cache_tier
        kw = {"map_location": map_location, "keys": keys, "weights_only": weights_only}
        if cache is not None and self.policies.rank(tier) > self.policies.rank(cache):
            fast = self.tiers.checkpoint(cache, self.root, step)
            if not lazy:
                res = runtime.run(copy_checkpoint(store, fast))
                self.catalog.set_copy(
                    self.root,
                    step,
                    cache,
                    cat.PRESENT,
                    bytes=res.manifest.stored_bytes,
                    verified=self.catalog.now(),
                )
                event("restore_cached", root=self.root, step=step, src=tier, dst=cache)
                return api.load(fast, **kw)

            def complete(manifest: Manifest, data: bytes) -> None:
                self.catalog.set_copy(
                    self.root, step, cache, cat.PRESENT, bytes=manifest.stored_bytes
                )

            rt = ReadThroughStore(fast, store, on_complete=complete)
            return api.load(rt, lazy=True, **kw)
        return api.load(store, lazy=lazy, **kw)

    # ---- lifetime --------------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        fn = self._sigterm_state
        if fn is not None:
            try:
                step, state = fn()
                existing = self.catalog.copy(self.root, step, self.policies.write_tier)
                if existing is None or existing.state != cat.PRESENT:
                    self.save(step, state).result()
                self.wait()
                event("preemption_save", root=self.root, step=step)
            except Exception as e:  # the process is going down anyway: say why, go on
                log.error("save on SIGTERM failed: %s", e)
        prev = self._prev_handler
        signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
        if callable(prev):
            prev(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def close(self) -> None:
        """Wait for saves, stop the background policies (after the current copy); warn
        when exports of this root are still pending or failing, naming the steps and the
        command that finishes them."""
        try:
            self.wait()
        finally:
            if self._background is not None:
                self._background.close()
            with contextlib.suppress(Exception):  # a warning must never fail the close
                self._warn_unfinished()
            for pin in self._pins:
                with contextlib.suppress(FmstoreError):
                    self.catalog.unpin(pin)
            self._pins.clear()
            self._finisher.shutdown(wait=True)
            if self._sigterm_state is not None and self._prev_handler is not None:
                with contextlib.suppress(ValueError):
                    signal.signal(signal.SIGTERM, self._prev_handler)
            with contextlib.suppress(Exception):
                runtime.run(self.tiers.close(), timeout=30)
            self.catalog.close()

    def _warn_unfinished(self) -> None:
        daemon = False
        try:
            self._runner.lock.acquire(timeout=0)
            self._runner.lock.release()
        except filelock.Timeout:
            daemon = True  # another runner (the daemon) holds the node's state directory
        wait = policy_wait(False, self.policies, self.catalog, self.root)
        text = close_warning(wait, self.root, daemon, self.config)
        if text is not None:
            log.warning("%s", text, extra={"event": "close_unfinished", "fields": {}})

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
