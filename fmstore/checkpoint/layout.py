"""Key names of checkpoints: predictable, so gc can recognise leftovers.

A run's checkpoint of step ``S`` is the prefix ``ROOT/step_SSSSSSSSSSSS`` (12 digits, so
listings sort by step) on every tier.  Inside a checkpoint prefix:

manifest.json                the commit (written last)
gMMMMMMMMMMMM-RRRRRRRR/      one generation per save: ms timestamp (hex) + random
    000000.bin ...           data blobs
    rank-000003.json         on a node-local tier of several nodes: a rank's record of its
                             blobs; in a generation no manifest names, a *pending* part
"""

from __future__ import annotations

import re
import secrets
import time

from .. import keys as _keys
from ..errors import CorruptData, NotFound
from ..format.manifest import MANIFEST_KEY, Manifest
from ..stores.base import Store
from ..stores.bounded import manifest_limit, read_bounded

#: Where a node keeps the replicas it holds of other nodes' parts, on the same node-local
#: tier (``.replicas/KEY/`` for the checkpoint at ``KEY``).
REPLICA_PREFIX = ".replicas"

# ASCII digits only, and ``\Z``: ``$`` also matches before a trailing newline.
STEP_RE = re.compile(r"^step_([0-9]{12})\Z")
GENERATION_RE = re.compile(r"^g([0-9a-f]{12})-[0-9a-f]{8}\Z")
BLOB_RE = re.compile(r"^[0-9]{6,}\.bin\Z")
#: A rank's record of its blobs in a checkpoint on a node-local tier (``dcp/nodes.py``).
RANK_RECORD_RE = re.compile(r"^rank-([0-9]{6})\.json\Z")

__all__ = [
    "BLOB_RE",
    "GENERATION_RE",
    "MANIFEST_KEY",
    "RANK_RECORD_RE",
    "STEP_RE",
    "blob_name",
    "checkpoint_key",
    "generation_age",
    "manifest_bytes",
    "new_generation",
    "parse_step",
    "read_manifest",
    "read_manifest_bytes",
    "step_name",
]


def new_generation() -> str:
    return f"g{int(time.time() * 1000):012x}-{secrets.token_hex(4)}"


def blob_name(i: int) -> str:
    return f"{i:06d}.bin"


def generation_age(gen: str, now: float | None = None) -> float:
    """Seconds since the generation was started (from its name)."""
    m = GENERATION_RE.match(gen)
    if not m:
        return 0.0
    return (now if now is not None else time.time()) - int(m.group(1), 16) / 1000.0


def step_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a checkpoint step must be a whole number >= 0, not {step!r}")
    return f"step_{step:012d}"


def parse_step(name: str) -> int | None:
    m = STEP_RE.fullmatch(name.rstrip("/"))
    return int(m.group(1)) if m else None


def checkpoint_key(root: str, step: int) -> str:
    return _keys.join(root, step_name(step))


async def manifest_bytes(store: Store) -> bytes:
    """The bytes of the committed manifest at ``store``'s root, of either format; NotFound
    (saying so) when the prefix holds no checkpoint."""
    try:
        return await read_bounded(store, MANIFEST_KEY, manifest_limit(), what="manifest")
    except NotFound:
        raise NotFound(
            f"no checkpoint at {store.url} (no {MANIFEST_KEY})", tier=store.tier, key=MANIFEST_KEY
        ) from None
    except CorruptData as e:  # refused as read (too big, not JSON text): said as the parse says it
        raise CorruptData(f"not a valid checkpoint: {e.message}", tier=e.tier, key=e.key) from None


async def read_manifest_bytes(store: Store) -> tuple[bytes, Manifest]:
    """The committed manifest of the checkpoint at ``store``'s root, with its bytes (their
    CRC32C is what the catalog records); NotFound when the prefix holds no checkpoint,
    CorruptData when the manifest does not parse."""
    data = await manifest_bytes(store)
    return data, Manifest.loads(data, where=store.url)


async def read_manifest(store: Store) -> Manifest:
    """The committed manifest; NotFound when the prefix holds no checkpoint."""
    return (await read_manifest_bytes(store))[1]
