"""Where bytes live: one async Store interface and its backends.

``open_store(url)`` picks the backend from the URL:

* ``/path``, ``./path``, ``file:///path`` → :class:`PosixStore` (the ``nvme`` / ``lustre`` tiers)
* ``s3://bucket/prefix`` → :class:`~fmstore.stores.s3.S3Store`
* ``TIER:sub/path`` → the tier named in ``fmstore.toml``, rooted at ``sub/path``
* any other fsspec URL (``memory://``, ``gs://``…) → :class:`FsspecStore`

The grammar lives in :mod:`.location` (:class:`Location`), resolved in one place.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config import Config
from .base import ByteRange, ObjectMeta, PrefixStore, PutOptions, Store, Writer
from .location import Location, split_tier
from .posix import PosixOptions, PosixStore

__all__ = [
    "ByteRange",
    "ObjectMeta",
    "PutOptions",
    "Store",
    "Writer",
    "PosixStore",
    "PosixOptions",
    "PrefixStore",
    "MeteredStore",
    "open_store",
    "Location",
    "split_tier",
]

#: Whether :func:`open_store` wraps stores in :class:`MeteredStore` unless told otherwise.
#: The CLI turns it off for every command but the daemon: only the daemon serves metrics,
#: and not loading prometheus_client takes 50 ms off each command's start.
log = logging.getLogger(__name__)

METERED_BY_DEFAULT = True


def __getattr__(name: str) -> Any:
    if name == "MeteredStore":  # imported on demand: it loads prometheus_client
        from .metered import MeteredStore

        return MeteredStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(
    url: str,
    *,
    tier: str | None = None,
    metered: bool | None = None,
    config: Config | None = None,
    concurrency: int | None = None,
    **options: Any,
) -> Store:
    """Open the store behind ``url``; ``options`` go to the backend (see each backend's
    options).  ``metered``: record Prometheus metrics (see :class:`MeteredStore`); None
    means :data:`METERED_BY_DEFAULT`.  ``concurrency``: the requests the caller keeps in
    flight, which a backend's own request limit then allows (:meth:`Location.open`)."""
    if metered is None:
        metered = METERED_BY_DEFAULT
    loc = Location.parse(url, config)
    log.debug("opening %s: %s store at %s", url, loc.scheme, loc.local_root or loc.base)
    return loc.open(tier=tier, metered=metered, concurrency=concurrency, **options)
