"""Reading a record or a manifest from a store, bounded before a byte is read.

Records and manifests come from a tier anyone with write access may have filled: a 1.5 GiB
sparse "lease" costs no disk but, read whole, gigabytes of memory in every ``gc`` and
sweep that meets it.  :func:`read_bounded` is the one way fmstore reads them: it asks the
object's size first (``stat``), refuses it when over the limit of its kind, and reads at
most that many bytes (a ranged get), so an object that grows between the two calls is
still read bounded.

The limits:

* :data:`LEASE_LIMIT` for export leases (a node name, a pid and a time);
* :data:`RECORD_LIMIT` for part records and rank records (the blobs of one node or rank);
* :func:`manifest_limit` for manifests (every item of every rank: a 70B model saved by
  1,024 ranks has a manifest of about 0.6 GB); ``$FMSTORE_MAX_MANIFEST_BYTES`` sets it;
* :func:`index_limit` for a dataset's ``index.json`` (about 200 bytes per shard: a million
  shards fit in 256 MiB); ``$FMSTORE_MAX_INDEX_BYTES`` sets it.
"""

from __future__ import annotations

import os

from ..errors import ConfigError, CorruptData, InvalidRange
from .base import Store

__all__ = [
    "INDEX_LIMIT",
    "LEASE_LIMIT",
    "MANIFEST_LIMIT",
    "RECORD_LIMIT",
    "index_limit",
    "manifest_limit",
    "read_bounded",
]

#: Largest export lease read.
LEASE_LIMIT = 64 << 10
#: Largest part record or rank record read.
RECORD_LIMIT = 4 << 20
#: Largest manifest read unless ``$FMSTORE_MAX_MANIFEST_BYTES`` says otherwise.
MANIFEST_LIMIT = 4 << 30
#: Largest dataset index read unless ``$FMSTORE_MAX_INDEX_BYTES`` says otherwise.
INDEX_LIMIT = 1 << 30
#: Reads of an object replaced by a shorter one between its stat and its read.
_ATTEMPTS = 3


def manifest_limit() -> int:
    """The largest manifest read: ``$FMSTORE_MAX_MANIFEST_BYTES`` (bytes), else
    :data:`MANIFEST_LIMIT`."""
    return _limit("FMSTORE_MAX_MANIFEST_BYTES", MANIFEST_LIMIT)


def index_limit() -> int:
    """The largest dataset index read: ``$FMSTORE_MAX_INDEX_BYTES`` (bytes), else
    :data:`INDEX_LIMIT`."""
    return _limit("FMSTORE_MAX_INDEX_BYTES", INDEX_LIMIT)


def _limit(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1:
        raise ConfigError(f"{name}={raw[:40]!r} is not a positive number of bytes")
    return value


async def read_bounded(store: Store, key: str, limit: int, *, what: str = "record") -> bytes:
    """The bytes of ``key`` in ``store``, at most ``limit`` of them: an object larger than
    that is refused (:class:`CorruptData` naming ``what``, the store and the key) before
    any of it is read.  ``NotFound`` when there is no such object."""
    for attempt in range(_ATTEMPTS):
        size = (await store.stat(key)).size
        if size > limit:
            raise CorruptData(
                f"{what} {store.url.rstrip('/')}/{key} is {size} bytes, more than the {limit} "
                f"fmstore reads for a {what}",
                tier=store.tier,
                key=key,
            )
        if size <= 0:
            return b""
        try:
            return await store.get_range(key, 0, size)
        except InvalidRange:
            # replaced by a shorter object between the two calls (a lease renewed): again
            if attempt == _ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
