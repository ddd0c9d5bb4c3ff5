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
from ..format.manifest import MANIFEST_KEY

# Re-exported: the manifest's reads lived here before commit.py, and are imported from here too.
from .commit import manifest_bytes, read_manifest, read_manifest_bytes

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
