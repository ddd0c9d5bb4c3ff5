"""Key names inside a checkpoint prefix: predictable, so gc can recognise leftovers.

manifest.json                the commit (written last)
gMMMMMMMMMMMM-RRRRRRRR/      one generation per save: ms timestamp (hex) + random
    000000.bin ...           data blobs
"""

from __future__ import annotations

import re
import secrets
import time

from ..format.manifest import MANIFEST_KEY

GENERATION_RE = re.compile(r"^g([0-9a-f]{12})-[0-9a-f]{8}$")
BLOB_RE = re.compile(r"^[0-9]{6,}\.bin$")

__all__ = [
    "BLOB_RE",
    "GENERATION_RE",
    "MANIFEST_KEY",
    "blob_name",
    "generation_age",
    "new_generation",
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
