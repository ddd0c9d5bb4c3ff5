"""The configured tiers as stores, and where a checkpoint lives on each.

A checkpoint of run root ``R`` at step ``S`` is the prefix ``R/step_SSSSSSSSSSSS`` (12
digits, so listings sort by step) on every tier, or ``R/`` + the name its step pattern
gives (``[runs."R"] step_pattern``, :mod:`.foreign`); copies between tiers keep the same key.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import keys as _keys
from ..checkpoint.commit import read_bounded_manifest
from ..checkpoint.layout import REPLICA_PREFIX
from ..config import Config
from ..errors import CorruptData, NotFound
from ..format.checksum import crc32c
from ..format.manifest import MANIFEST_KEY
from ..protocol.decisions import ManifestFacts, Problem, manifest_facts, step_committed
from ..protocol.env import Env
from ..stores import Location, open_store
from ..stores.base import Store
from ..stores.posix_io import tree_bytes
from .inventory.foreign import (
    DCP,
    DCP_METADATA,
    InFuture,
    NotCounted,
    look,
    step_key,
    step_parser,
    step_patterns,
)
from .policy.policies import TierUsage

log = logging.getLogger("fmstore.tiering")

#: ``known(step, crc32c)``: whether that manifest was validated on the tier before.
Known = Callable[[int, int], bool]


@dataclass(frozen=True)
class CommittedCopy:
    """A step's validated manifest on a tier, and when it was written (None: unknown)."""

    facts: ManifestFacts
    mtime: float | None


async def read_manifest(ckpt: Store) -> tuple[bytes, float | None]:
    """The bytes and modification time of the manifest at ``ckpt``'s root: the one read of
    a manifest that counting a step makes (NotFound where there is none)."""
    meta = await ckpt.stat(MANIFEST_KEY)
    data = await read_bounded_manifest(ckpt)
    return bytes(data), meta.mtime


async def _sizes(ckpt: Store, facts: ManifestFacts) -> dict[str, int]:
    """Name -> size of every object in the manifest's generation (one listing)."""
    gen = facts.generation + "/"
    try:
        return {m.key[len(gen) :]: m.size async for m in ckpt.list(gen, recursive=False)}
    except NotFound:
        return {}


class Tiers:
    """Opens each configured tier once (thread-safe) and hands out checkpoint prefixes."""

    def __init__(self, config: Config, env: Env | None = None) -> None:
        self.config = config
        #: The protocol's clock, node and settings (the config's ``[protocol]`` table
        #: unless given): leases, commits and counting follow it, and so does everything
        #: that runs the protocol on these tiers (the runner, its exports, the sweep).
        self.env = Env.from_config(config) if env is None else env
        #: Run root -> the step pattern it declares (others: ``step_…``).
        self.patterns = step_patterns(config)
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()

    def store(self, tier: str) -> Store:
        with self._lock:
            s = self._stores.get(tier)
            if s is None:
                t = self.config.tier(tier)
                s = open_store(t.url, tier=tier, config=self.config, **dict(t.options))
                self._stores[tier] = s
            return s

    def checkpoint(self, tier: str, root: str, step: int) -> Store:
        """The store rooted at checkpoint ``(root, step)`` on ``tier``."""
        return self.store(tier).sub(self.key(root, step))

    def key(self, root: str, step: int) -> str:
        """The key of checkpoint ``(root, step)`` on every tier."""
        return step_key(self.patterns, root, step)

    def local_dir(self, tier: str) -> str | None:
        """The directory behind a POSIX tier (None for object stores)."""
        return Location.parse(self.config.tier(tier).url, self.config).local_root

    def usage(self, tier: str) -> TierUsage | None:
        """Used and total bytes of the file system holding a POSIX tier, and on a
        node-local tier the bytes of the replicas it holds of other nodes' parts."""
        d = self.local_dir(tier)
        if d is None or not os.path.isdir(d):
            return None
        du = shutil.disk_usage(d)
        node = self.config.tier(tier).scope == "node"
        reps = 0
        if node:
            try:
                reps = tree_bytes(os.path.join(d, REPLICA_PREFIX))
            except OSError as e:  # a link: not followed, nor counted
                log.warning("%s: %s not counted: %s", tier, REPLICA_PREFIX, e)
        return TierUsage(used=du.total - du.free, total=du.total, replicas=reps)

    def free_bytes(self, tier: str) -> int | None:
        d = self.local_dir(tier)
        if d is None or not os.path.isdir(d):
            return None
        return shutil.disk_usage(d).free

    async def steps_on(self, tier: str, root: str) -> list[int]:
        """Steps under ``root`` committed on ``tier`` (see :meth:`committed_on`)."""
        return sorted(await self.committed_on(tier, root))

    async def committed_on(
        self, tier: str, root: str, *, known: Known | None = None
    ) -> dict[int, float | None]:
        """Step -> modification time of its manifest (the commit), for every step under
        ``root`` committed on ``tier`` (:meth:`committed_facts`)."""
        return {s: c.mtime for s, c in (await self.committed_facts(tier, root, known)).items()}

    async def committed_facts(
        self,
        tier: str,
        root: str,
        known: Known | None = None,
        notes: NotCounted | None = None,
        *,
        listing: bool = True,
    ) -> dict[int, CommittedCopy]:
        """Every step under ``root`` committed on ``tier``, with its manifest's facts.

        A step counts when its manifest is read and validated, never on a stat alone
        (an empty or foreign ``manifest.json`` is no commit: retention would count it
        among the newest and delete a real checkpoint): fmstore's format, a version this
        fmstore reads, a generation whose blobs (this node's part on a node-local tier)
        are there with the manifest's sizes, and a creation time no later than now plus
        the allowed clock skew (:func:`fmstore.protocol.decisions.step_committed`).
        ``known(step, crc32c)``: True when this manifest (same checksum) was validated on
        this tier before (the catalog); its blobs are then not listed again.
        ``notes``: given what does not count, with why: each manifest there that does not
        (a newer fmstore's included: this one cannot check it), each step directory holding
        a native DCP checkpoint, and what the root's listing shows under names fmstore does
        not count (:func:`.foreign.look`; ``listing=False``: not the listing, already
        looked at)."""
        found: dict[int, CommittedCopy] = {}
        for step in await self.step_dirs(tier, root, notes if listing else None):
            copy = await self.committed_copy(tier, root, step, known, notes)
            if copy is not None:
                found[step] = copy
        return found

    async def step_dirs(self, tier: str, root: str, notes: NotCounted | None = None) -> list[int]:
        """Every step directory under ``root`` on ``tier``, committed or not (one listing),
        ascending; ``notes``: given what the listing shows that fmstore does not count."""
        store = self.store(tier)
        if notes is not None:
            return (await look(store, tier, root, self.patterns, notes)).steps
        prefix = _keys.validate_prefix(root)
        step_of = step_parser(self.patterns, root)
        try:
            return sorted(
                [
                    step
                    async for meta in store.list(prefix, recursive=False)
                    if meta.is_dir and (step := step_of(meta.key[len(prefix) :])) is not None
                ]
            )
        except NotFound:
            return []

    async def committed_copy(
        self,
        tier: str,
        root: str,
        step: int,
        known: Known | None = None,
        notes: NotCounted | None = None,
    ) -> CommittedCopy | None:
        """Step ``step`` of ``root`` on ``tier`` if it is committed there (validated as
        :meth:`committed_facts` says), else None; a read error is raised, never taken for
        "not committed"."""
        key = self.key(root, step)
        ckpt = self.store(tier).sub(key)
        node = self.env.here() if self.config.tier(tier).scope == "node" else None
        where = f"{ckpt.url}/{MANIFEST_KEY}"
        under = f"{tier}:{root.strip('/')}"
        try:
            data, mtime = await read_manifest(ckpt)
            crc = crc32c(data)
            facts = manifest_facts(data, crc32c=crc, where=where)
            sizes = None if known and known(step, crc) else await _sizes(ckpt, facts)
        except NotFound:
            # No manifest: not committed here (a save under way), or torch's own files
            # under a step's name (one stat, made by scans only).
            if notes is not None and await ckpt.exists(DCP_METADATA):
                notes.add(under, f"{tier}:{key}", DCP)
            return None
        except CorruptData as e:  # not a manifest this fmstore can count
            if notes is not None:
                notes.add(under, where, str(e))
            return None
        now = self.env.now()
        why = step_committed(facts, sizes=sizes, node=node, now=now, skew=self.env.clock_skew)
        if why is None:
            return CommittedCopy(facts, mtime)
        if notes is None:
            pass
        elif why is Problem.CREATED_IN_FUTURE:  # a clock is off: said loudly by the scans
            offset = facts.created - now
            notes.add_future(InFuture(tier, root.strip("/"), step, where, offset, facts.written_by))
        else:
            notes.add(under, where, why.value)
        return None

    async def newest_committed(
        self, tier: str, root: str, steps: Iterable[int] | None = None
    ) -> int | None:
        """The newest step of ``root`` committed on ``tier`` (of ``steps``, its step
        directories when already listed): validated newest first, so that the usual answer
        costs one listing and one manifest read."""
        dirs = await self.step_dirs(tier, root) if steps is None else steps
        for step in sorted(dirs, reverse=True):
            if await self.committed_copy(tier, root, step) is not None:
                return step
        return None

    async def close(self) -> None:
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for s in stores:
            await s.close()
