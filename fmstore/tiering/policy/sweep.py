"""The orphan sweep: remove what writers that died left on the tiers.

A process killed mid-write leaves work no later run may come back to:

``upload``
    an unfinished S3 multipart upload, holding its parts (and their storage bill) until
    aborted;
``temp``
    a POSIX temp file of an interrupted write;
``generation``
    checkpoint blobs no manifest names: a save or an export that never committed, or the
    generation an overwrite superseded (see :mod:`fmstore.checkpoint.gc`);
``aside``
    the steps a restore fell back from, moved aside on a POSIX tier
    (``.aside/TOKEN``: :mod:`.aside`, :mod:`.redo`), once the token's time is older than the grace;
``journal``
    the resume journal of a copy whose process died, when no later run can use it: its
    pending write was removed above, or its destination is gone.  (The journal of a copy
    that finished stays: a re-run skips on its word.)

Ownership is never guessed.  An item is removed only when

* no live copy on this node writes where it lies: a running ``fmstore stage`` or export
  holds its journal (:mod:`.journal`), and everything under that journal's destination is
  kept, however old;
* it has been idle for at least the grace period (``[daemon] orphan_grace``, 1 h): idle is
  the time since it last changed (an upload's newest part, a temp file's mtime, a
  generation's newest object as written *there*: a copy carries its source's mtime, so a
  file's ctime counts too), so a write in progress on another node survives even when it
  began long ago;
* no node's export lease in it is alive (an export of a checkpoint in node parts, on any
  node: ``docs/distributed.md``), whatever its age and the grace period; its part records
  are removed before its blobs and leases, and it is looked at again in between;
* it is not part of a committed checkpoint (pinned ones included): the generation a manifest
  names is never garbage, and a manifest that does not parse keeps its whole prefix;
* it is not a pending part of a sharded checkpoint on a node-local tier (a generation with a
  rank record no manifest names: its commit may not have reached this node yet).

A replaced node (its state directory gone) finds its predecessor's leftovers the same way,
by listing the tiers.  Exports the daemon had in progress are not the sweep's to resume:
the policy runner retries them, from their journal when the sweep left it.  A ``fmstore
stage`` killed and re-run within the grace period resumes; after it, its uploads and temp
files are gone and the re-run copies those files again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

from ... import runtime
from ...checkpoint.gc import Generation, orphan_generations, remove_generation
from ...config import Config
from ...errors import FmstoreError
from ...protocol.env import Env
from ...stores.base import Store
from .. import metrics as m
from ..copy import journal as _journal
from ..inventory import aside

log = logging.getLogger("fmstore.sweep")

#: How long an orphan must be idle before the sweep removes it, by default.
DEFAULT_GRACE = 3600.0


@dataclass(frozen=True)
class Orphan:
    """One item the sweep found: on which tier, what, where (a key under the tier's root;
    for a journal, the destination of its copy), its bytes, its idle time, and what was
    done with it."""

    tier: str
    kind: str
    where: str
    size: int
    age: float
    #: "removed", "would remove", "kept: live copy", "kept: young", "kept: pending part",
    #: "kept: live export"
    action: str


@dataclass
class SweepReport:
    orphans: list[Orphan] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dry_run: bool = False

    @property
    def removed(self) -> list[Orphan]:
        return [o for o in self.orphans if o.action in ("removed", "would remove")]

    @property
    def bytes_reclaimed(self) -> int:
        return sum(o.size for o in self.removed)


def _under(url: str, dests: list[str]) -> bool:
    return any(url == d or url.startswith(d + "/") for d in dests)


def _root(store: Store) -> str:
    return store.url.rstrip("/")


def _url(store: Store, key: str) -> str:
    return f"{store.url.rstrip('/')}/{key}" if key else store.url


class Sweeper:
    """One sweep over some tiers, with the live copies of this node's state directory; leases
    are judged and ages measured by ``env`` (the protocol's clock and settings; without
    one, this process's environment's)."""

    def __init__(
        self, state_dir: str, *, grace: float, dry_run: bool = False, env: Env | None = None
    ) -> None:
        self.env = Env.from_config(None) if env is None else env
        self.grace = grace
        self.dry_run = dry_run
        self.report = SweepReport(dry_run=dry_run)
        self.journals = _journal.read_all(os.path.join(state_dir, "transfers"))
        #: Destinations of the copies in progress on this node: nothing under them goes.
        self.live = [j.dest.rstrip("/") for j in self.journals if j.live and j.dest]
        self._aborted: set[str] = set()
        self._stores: list[Store] = []

    def _decide(self, tier: str, kind: str, where: str, url: str, size: int, age: float) -> bool:
        """Record the item; True when it is to be removed now."""
        if _under(url, self.live):
            action = "kept: live copy"
        elif age < self.grace:
            action = "kept: young"
        else:
            action = "would remove" if self.dry_run else "removed"
        self.report.orphans.append(Orphan(tier, kind, where, size, age, action))
        return action == "removed"

    async def tier(self, tier: str, store: Store) -> None:
        """Sweep ``store`` (a tier, or a prefix of one)."""
        self._stores.append(store)
        try:
            leftovers = await store.leftovers()
            pending: list[str] = []
            gens, _, _ = await orphan_generations(store, pending, env=self.env)
        except FmstoreError as e:
            self.report.errors.append(f"{tier}: {e}")
            log.warning("sweep of %s failed: %s", tier, e)
            return
        for item in leftovers:
            url = _url(store, item.key)
            if self._decide(
                tier, item.kind, item.key, url, item.size, item.idle
            ) and await self._remove(tier, item.key, store.remove_leftover(item)):
                self._count(tier, item.kind, item.size)
                # What a journal calls this pending write: the upload id, the temp file.
                self._aborted.add(item.token or item.key.rsplit("/", 1)[-1])
        for where in pending:
            # A part of a sharded checkpoint whose manifest has not reached this node: only
            # a restore's collective decides about it (docs/distributed.md).
            self.report.orphans.append(
                Orphan(tier, "generation", where, 0, 0.0, "kept: pending part")
            )
        moved: list[tuple[str, int, float]] = []
        if store.local_root is not None:  # steps are moved aside on POSIX tiers only
            try:
                moved = await runtime.to_io(aside.moved_aside, store, now=self.env.now())
            except OSError as e:
                self.report.errors.append(f"{tier}: {aside.ASIDE_PREFIX}: {e}")
        for key, size, age in moved:
            # Steps a restore fell back from (docs/distributed.md): kept for the grace.
            if self._decide(tier, "aside", key, _url(store, key), size, age) and await self._remove(
                tier, key, runtime.to_io(aside.remove, store, key)
            ):
                self._count(tier, "aside", size)
        for g in gens:
            if g.exporting:
                # Some node's exporter renewed its lease in it lately (docs/distributed.md):
                # kept whatever its age and the grace period.
                self.report.orphans.append(
                    Orphan(tier, "generation", g.where, g.size, g.age, "kept: live export")
                )
                continue
            if self._decide(
                tier, "generation", g.where, _url(store, g.where), g.size, g.age
            ) and await self._remove(tier, g.where, self._gone_gen(store, g)):
                self._count(tier, "generation", g.size)

    async def _gone_gen(self, store: Store, g: Generation) -> None:
        if not await remove_generation(store, g, self.env):
            raise ValueError("an exporter came back to it meanwhile; kept")

    async def _remove(self, tier: str, where: str, removal: Awaitable[None]) -> bool:
        try:
            await removal
            return True
        except (FmstoreError, ValueError, OSError) as e:
            self.report.errors.append(f"{tier}: {where}: {e}")
            log.warning("sweep of %s could not remove %s: %s", tier, where, e)
            return False

    async def finish_journals(self) -> None:
        """Remove the journals of dead copies into the swept stores, idle past the grace
        period, that no later run could use: one whose pending write this sweep removed
        (an aborted upload, a deleted temp file), or whose destination is gone.  The
        journal of a copy that finished stays (a re-run skips on its word)."""
        now = time.time()  # journals are this node's files: their mtimes are its real clock
        for j in self.journals:
            store = self._store_of(j.dest)
            if j.live or store is None:
                continue
            if not j.tokens & self._aborted and not await self._gone(store, j.dest or ""):
                continue
            # Shown by the destination it was for; the file is an implementation detail.
            if self._decide("state", "journal", j.dest or "", "", 0, now - j.mtime):
                try:
                    os.unlink(j.path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    self.report.errors.append(f"journal {j.path}: {e}")
                    continue
                self._count("state", "journal", 0)

    def _store_of(self, dest: str | None) -> Store | None:
        """The swept store that ``dest`` lies under, if any."""
        if not dest:
            return None
        return next((s for s in self._stores if _under(dest.rstrip("/"), [_root(s)])), None)

    async def _gone(self, store: Store, dest: str) -> bool:
        """Whether nothing is left under ``dest`` (a URL under ``store``)."""
        sub = dest.rstrip("/")[len(_root(store)) + 1 :]
        try:
            async for m in store.list(sub, recursive=True):
                if not m.is_dir:  # an S3 folder marker holds nothing
                    return False
        except FmstoreError:
            return False  # unknown: keep the journal
        return True

    def _count(self, tier: str, kind: str, size: int) -> None:
        m.ORPHANS_REMOVED.labels(tier, kind).inc()
        m.ORPHAN_BYTES.labels(tier).inc(size)
        log.info("removed orphan %s on %s (%d bytes)", kind, tier, size)


async def sweep(
    config: Config,
    stores: dict[str, Store],
    *,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = False,
    env: Env | None = None,
) -> SweepReport:
    """Sweep each ``{tier: store}`` (a tier's root or a prefix of it) with the live copies
    of ``config``'s state directory; see the module doc.  Never raises for a tier that
    fails: its error is in the report.  Leases are judged by ``env`` (default: ``config``'s
    ``[protocol]`` settings)."""
    env = Env.from_config(config) if env is None else env
    s = Sweeper(config.state_dir, grace=grace, dry_run=dry_run, env=env)
    for tier, store in stores.items():
        await s.tier(tier, store)
    await s.finish_journals()
    return s.report
