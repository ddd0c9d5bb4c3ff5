"""Where bytes live: one async Store interface and its backends.

``open_store(url)`` picks the backend from the URL:

* ``/path``, ``./path``, ``file:///path`` → :class:`PosixStore` (the ``nvme`` / ``lustre`` tiers)
* ``s3://bucket/prefix`` → :class:`~fmstore.stores.s3.S3Store`
* ``TIER:sub/path`` → the tier named in ``fmstore.toml``, rooted at ``sub/path``
* any other fsspec URL (``memory://``, ``gs://``…) → :class:`FsspecStore`
"""

from __future__ import annotations

import re
from typing import Any

from ..config import Config, get_config
from ..errors import ConfigError
from .base import ByteRange, ObjectMeta, PutOptions, Store, Writer
from .posix import PosixOptions, PosixStore
from .prefix import PrefixStore

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
    "split_tier",
]

#: Whether :func:`open_store` wraps stores in :class:`MeteredStore` unless told otherwise.
#: The CLI turns it off for every command but the daemon: only the daemon serves metrics,
#: and not loading prometheus_client takes 50 ms off each command's start.
METERED_BY_DEFAULT = True


def __getattr__(name: str) -> Any:
    if name == "MeteredStore":  # imported on demand: it loads prometheus_client
        from .metered import MeteredStore

        return MeteredStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_TIER = re.compile(r"^([A-Za-z0-9_-]+):(?!//)(.*)$")
_POSIX_KEYS = {"direct_io", "stripe_count", "stripe_size", "fsync", "read_threads"}


def split_tier(url: str, config: Config | None = None) -> tuple[str | None, str]:
    """``"nvme:ckpts/a"`` → ``("nvme", "ckpts/a")`` when ``nvme`` is a configured tier."""
    m = _TIER.match(url)
    if m and not _SCHEME.match(url):
        cfg = config or get_config()
        name = m.group(1)
        if name in cfg.tiers:
            return name, m.group(2)
        cfg.tier(name)  # raises ConfigError naming the configured tiers
    return None, url


def open_store(
    url: str,
    *,
    tier: str | None = None,
    metered: bool | None = None,
    config: Config | None = None,
    **options: Any,
) -> Store:
    """Open the store behind ``url``; ``options`` go to the backend (see each backend's
    options).  ``metered``: record Prometheus metrics (see :class:`MeteredStore`); None
    means :data:`METERED_BY_DEFAULT`."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"store URL must be a non-empty string, not {url!r}")
    name, rest = split_tier(url, config)
    if name is not None:
        t = (config or get_config()).tier(name)
        base = open_store(
            t.url, tier=name, metered=metered, config=config, **{**t.options, **options}
        )
        return base.sub(rest) if rest.strip("/") else base
    store = _open_backend(url, tier, options)
    if metered is None:
        metered = METERED_BY_DEFAULT
    if not metered:
        return store
    from .metered import MeteredStore

    return MeteredStore(store)


def _open_backend(url: str, tier: str | None, options: dict[str, Any]) -> Store:
    m = _SCHEME.match(url)
    scheme = m.group(1).lower() if m else None
    if scheme is None or scheme == "file":
        path = url[len("file://") :] if scheme == "file" else url
        unknown = set(options) - _POSIX_KEYS
        if unknown:
            raise ConfigError(f"unknown option(s) for a POSIX store: {', '.join(sorted(unknown))}")
        return PosixStore(path, tier=tier or "file", options=PosixOptions(**options))
    if scheme in ("s3", "s3a"):
        from .s3 import S3Store

        return S3Store.from_url(url, tier=tier or "s3", **options)
    import fsspec

    if scheme not in fsspec.available_protocols():
        raise ConfigError(
            f"unknown URL scheme {scheme!r} in {url!r}: use a path, file://, s3:// or an fsspec protocol"
        )
    from .fsspec_store import FsspecStore

    return FsspecStore(url, tier=tier, **options)
