"""The configured tiers as stores, and where a checkpoint lives on each.

A checkpoint of run root ``R`` at step ``S`` is the prefix ``R/step_SSSSSSSSSSSS`` (12
digits, so listings sort by step) on every tier; copies between tiers keep the same key.
"""

from __future__ import annotations

import os
import shutil
import threading

from .. import keys as _keys
from ..checkpoint.layout import checkpoint_key, parse_step, step_name
from ..config import Config
from ..errors import NotFound
from ..format.manifest import MANIFEST_KEY
from ..stores import Location, open_store
from ..stores.base import Store
from .policies import TierUsage


class Tiers:
    """Opens each configured tier once (thread-safe) and hands out checkpoint prefixes."""

    def __init__(self, config: Config) -> None:
        self.config = config
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
        return self.store(tier).sub(checkpoint_key(root, step))

    def local_dir(self, tier: str) -> str | None:
        """The directory behind a POSIX tier (None for object stores)."""
        return Location.parse(self.config.tier(tier).url, self.config).local_root

    def usage(self, tier: str) -> TierUsage | None:
        """Used and total bytes of the file system holding a POSIX tier."""
        d = self.local_dir(tier)
        if d is None or not os.path.isdir(d):
            return None
        du = shutil.disk_usage(d)
        return TierUsage(used=du.total - du.free, total=du.total)

    def free_bytes(self, tier: str) -> int | None:
        d = self.local_dir(tier)
        if d is None or not os.path.isdir(d):
            return None
        return shutil.disk_usage(d).free

    async def steps_on(self, tier: str, root: str) -> list[int]:
        """Steps under ``root`` whose manifest is committed on ``tier`` (a listing plus one
        stat per step directory)."""
        return sorted(await self.committed_on(tier, root))

    async def committed_on(self, tier: str, root: str) -> dict[int, float | None]:
        """Step -> modification time of its manifest (the commit), for every step under
        ``root`` committed on ``tier``."""
        store = self.store(tier)
        prefix = _keys.validate_prefix(root)
        found: dict[int, float | None] = {}
        try:
            async for meta in store.list(prefix, recursive=False):
                step = parse_step(meta.key[len(prefix) :]) if meta.is_dir else None
                if step is None:
                    continue
                try:
                    m = await store.stat(_keys.join(root, step_name(step), MANIFEST_KEY))
                except NotFound:
                    continue
                found[step] = m.mtime
        except NotFound:
            return {}
        return found

    async def close(self) -> None:
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for s in stores:
            await s.close()
