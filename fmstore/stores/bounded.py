"""Reading a record or a manifest from a store, bounded before a byte is read.

Records and manifests come from a tier anyone with write access may have filled: a 1.5 GiB
sparse "lease" costs no disk but, read whole, gigabytes of memory in every ``gc`` and
sweep that meets it.  :func:`read_bounded` is the one way fmstore reads them: it asks the
object's size first (``stat``), refuses it when over the limit of its kind, and reads at
most that many bytes (a ranged get), so an object that grows between the two calls is
still read bounded.

Every kind is a JSON object, and it is judged as its bytes arrive: a first byte other than
whitespace or ``{``, or a NUL anywhere (never in JSON text; what a sparse file's holes read
as), is :class:`CorruptData` at the first window that shows it, so a sparse 4 GiB
"manifest" is refused after its first MiB, never read whole.  The file's block count is
never consulted (compressed file systems make good manifests look sparse).
:func:`decode_json` then decodes the bytes as UTF-8 (never letting ``json`` guess UTF-16 or
UTF-32 from NULs) and describes an error by its kind and position only.

The limits:

* :data:`LEASE_LIMIT` for export leases (a node name, a pid and a time);
* :data:`RECORD_LIMIT` for part records and rank records (the blobs of one node or rank);
* :func:`manifest_limit` for manifests (every item of every rank: a 70B model saved by
  1,024 ranks has a manifest of about 0.6 GB); ``$FMSTORE_MAX_MANIFEST_BYTES`` sets it;
* :func:`index_limit` for a dataset's ``index.json`` (about 200 bytes per shard: a million
  shards fit in 256 MiB); ``$FMSTORE_MAX_INDEX_BYTES`` sets it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import ConfigError, CorruptData, InvalidRange, describe_error
from .base import Store

__all__ = [
    "INDEX_LIMIT",
    "LEASE_LIMIT",
    "MANIFEST_LIMIT",
    "RECORD_LIMIT",
    "decode_json",
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
#: The first read of an object: every lease and most records and manifests in one request.
FIRST_WINDOW = 1 << 20
#: Each later read of a large object, judged before the next is asked for.
WINDOW = 64 << 20
#: JSON's whitespace, which may come before the ``{``.
_SPACE = b" \t\r\n"
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


async def read_bounded(
    store: Store, key: str, limit: int, *, what: str = "record", json_object: bool = True
) -> bytes:
    """The bytes of ``key`` in ``store``, at most ``limit`` of them: an object larger than
    that is refused (:class:`CorruptData` naming ``what``, the store and the key) before
    any of it is read.  With ``json_object`` (every kind fmstore reads this way), bytes that
    cannot begin a JSON object or that hold a NUL are refused as they are read.
    ``NotFound`` when there is no such object."""
    where = f"{what} {store.url.rstrip('/')}/{key}"
    for attempt in range(_ATTEMPTS):
        meta = await store.stat(key)
        size = meta.size
        if size > limit:
            raise CorruptData(
                f"{where} is {size} bytes, more than the {limit} fmstore reads for a {what}",
                tier=store.tier,
                key=key,
            )
        if size <= 0:
            return b""
        try:
            return await _read_windows(store, key, size, meta.etag, where, json_object)
        except InvalidRange:
            # replaced by a shorter object between the two calls (a lease renewed): again
            if attempt == _ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


async def _read_windows(
    store: Store, key: str, size: int, etag: str | None, where: str, json_object: bool
) -> bytes:
    """``size`` bytes of ``key``, read a window at a time, each judged before the next."""
    pieces: list[bytes] = []
    off = 0
    while off < size:
        end = min(size, off + (FIRST_WINDOW if off == 0 else WINDOW))
        piece = await store.get_range(key, off, end)
        if json_object:
            why = json_bytes_problem(piece, off)
            if why:
                raise CorruptData(f"{where} is not JSON text: {why}", tier=store.tier, key=key)
        pieces.append(piece)
        off = end
    if len(pieces) == 1:
        return pieces[0]
    if etag is not None and (await store.stat(key)).etag != etag:
        # replaced while it was read in windows: never splice two versions
        raise InvalidRange("object changed while it was read", tier=store.tier, key=key)
    return b"".join(pieces)


def json_bytes_problem(piece: bytes, offset: int) -> str | None:
    """Why ``piece``, the bytes at ``offset`` of a JSON object's text, cannot be part of one
    (None: it may be)."""
    nul = piece.find(0)
    if nul >= 0:
        return f"a NUL byte at byte {offset + nul}"
    if offset == 0:
        head = piece.lstrip(_SPACE)[:1]
        if head and head != b"{":
            return f"it begins with {head!r}, not '{{'"
    return None


def decode_json(data: bytes | bytearray | memoryview) -> Any:
    """``data`` decoded as UTF-8 and parsed as JSON; a ``ValueError`` that says what is
    wrong and where (never one quoting the input) otherwise."""
    why = None
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError too
        why = describe_error(e)
    # raised outside the handler: the error carries no context holding the input
    raise ValueError(why)
