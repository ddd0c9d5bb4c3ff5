"""One grammar for locations, resolved in one place.

Every place fmstore takes a location (``fmstore.save`` / ``load``, DCP, the checkpoint
manager, ``StreamingDataset``, the CLI) accepts the same forms:

==========================  ==============================================================
``/path``, ``./path``, ``~/p``  a local directory (a POSIX store)
``file:///path``            the same
``TIER:path``, ``TIER:``     ``path`` below the tier named in ``fmstore.toml`` (any kind)
``s3://bucket/prefix``      S3, with endpoint, region and addressing from ``[s3]`` of
                            ``fmstore.toml``, then ``AWS_ENDPOINT_URL_S3`` /
                            ``AWS_ENDPOINT_URL``, then botocore's own chain (the
                            profile's ``services`` section or ``endpoint_url``)
``memory://name``           fsspec's in-memory file system (tests, scratch)
any other fsspec URL        that fsspec protocol (``file::``-chained URLs included)
==========================  ==============================================================

:meth:`Location.parse` answers, before anything is opened (opening a POSIX store creates
its directory): which tier, which backend, and the local directory where there is one.
Whatever reads a location, or only looks (a dry run), opens it with :func:`open_existing`,
which never creates anything.

A bare word that is the name of a configured tier (``nvme``, no colon, no slash) is refused
with :class:`ConfigError` wherever a location is taken: it could mean the tier or a directory
of that name below the working directory, and guessing wrong sweeps or deletes the wrong
thing.  ``nvme:`` is the tier, ``./nvme`` the directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import Config, get_config
from ..errors import ConfigError, NotFound, PermissionDenied

if TYPE_CHECKING:
    from .base import Store

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_TIER = re.compile(r"^([A-Za-z0-9_-]+):(?!//)(.*)$")
_BARE = re.compile(r"^[A-Za-z0-9_-]+$")
_POSIX_KEYS = frozenset({"direct_io", "stripe_count", "stripe_size", "fsync", "read_threads"})
#: Environment variables naming an S3 endpoint, in botocore's order of precedence.
_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def split_tier(url: str, config: Config | None = None) -> tuple[str | None, str]:
    """``"nvme:ckpts/a"`` → ``("nvme", "ckpts/a")`` when ``nvme`` is a configured tier;
    ``(None, url)`` for every other form.  ``NAME:path`` with an unknown ``NAME`` raises
    :class:`ConfigError` naming the configured tiers, and so does a bare word that is a
    tier's name (``nvme``: the tier, ``nvme:``, or the directory, ``./nvme``?)."""
    if _BARE.match(url):
        try:
            cfg = config or get_config()
        except ConfigError:  # a plain relative path needs no config: its error comes later
            return None, url
        if url in cfg.tiers:
            raise ConfigError(
                f"{url!r} is the name of a configured tier: write '{url}:' for the tier "
                f"(or '{url}:PATH' below it), or './{url}' for a directory of that name here"
            )
        return None, url
    m = _TIER.match(url)
    if m and not _SCHEME.match(url) and "::" not in url.split("/", 1)[0]:
        cfg = config or get_config()
        name = m.group(1)
        if name in cfg.tiers:
            return name, m.group(2)
        cfg.tier(name)  # raises ConfigError naming the configured tiers
    return None, url


def decided_by_config(url: str) -> bool:
    """Whether the config decides where ``url`` is: a tier's location (``TIER:path``) or an
    S3 URL (``[s3] endpoint_url``); judged from the text alone, loading nothing."""
    if _SCHEME.match(url):
        return scheme_of(url) in ("s3", "s3a")
    return _TIER.match(url) is not None and "::" not in url.split("/", 1)[0]


def scheme_of(url: str) -> str | None:
    """The lower-cased URL scheme (``s3``, ``file``, ``memory``…), None for a plain path."""
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else None


@dataclass(frozen=True)
class Location:
    """A location string resolved against the config, not yet opened.

    ``tier``: the configured tier it names (``TIER:path``), else None.  ``base``: the URL of
    the backend store (the tier's URL for ``TIER:path``) and ``sub`` the prefix below it.
    ``scheme``: ``file``, ``s3`` or the fsspec protocol of ``base``.  ``local_root``: the
    absolute directory on this machine for POSIX locations, else None (the same answer an
    opened store gives as :attr:`Store.local_root`).  ``options``: the backend's options
    (a tier's keys; ``[s3]`` defaults and the endpoint for S3).
    """

    url: str
    base: str
    scheme: str
    tier: str | None = None
    sub: str = ""
    local_root: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    #: for a tier's location: the config that named the tier (its file, or the embedded
    #: default), for messages
    origin: str | None = None

    @property
    def is_local(self) -> bool:
        return self.local_root is not None

    def described(self) -> str:
        """``'nvme:ds' (/local/nvme/ds: tier nvme of /proj/fmstore.toml)`` for a tier's
        location, ``'./x' (/abs/x)`` for a relative path: what a "does not exist" names."""
        where = self.local_root or (
            self.base.rstrip("/") + "/" + self.sub if self.sub else self.base
        )
        if self.tier is not None:
            return f"{self.url!r} ({where}: tier {self.tier} of {self.origin})"
        if self.local_root is not None and os.path.expanduser(self.url) != self.local_root:
            return f"{self.url!r} ({self.local_root})"
        return repr(self.url)

    def check_exists(self, role: str = "location") -> None:
        """Raise unless a location on this machine is an existing, readable directory:
        :class:`NotFound` (naming the directory a tier's location resolved to), or
        :class:`ConfigError` for a file, :class:`PermissionDenied` for an unreadable one.
        Remote locations pass: an S3 prefix is there as long as objects are under it,
        which the caller's listing finds out."""
        path = self.local_root
        if path is None:
            return
        if os.path.isfile(path):
            raise ConfigError(f"{role} {self.url!r} is a file: use 'fmstore cp' for single objects")
        if not os.path.isdir(path):
            # Name the directory a tier's location resolved to (nvme:ds → /local/nvme/ds),
            # and the config that said so.
            raise NotFound(f"{role} {self.described()} does not exist")
        if not os.access(path, os.R_OK | os.X_OK):
            raise PermissionDenied(f"{role} {self.url!r} is not readable")

    @classmethod
    def parse(cls, url: str, config: Config | None = None) -> Location:
        """Resolve ``url``; raises :class:`ConfigError` for an unknown tier or scheme."""
        if not isinstance(url, str) or not url:
            raise ConfigError(f"a location must be a non-empty path or URL, not {url!r}")
        if "::" in url.split("/", 1)[0]:  # an fsspec chain: simplecache::s3://…, file::/p
            proto = url.split("::", 1)[0].lower()
            return cls(url=url, base=url, scheme=proto)
        name, rest = split_tier(url, config)
        if name is not None:
            cfg = config or get_config()
            t = cfg.tier(name)
            base = cls._backend(t.url, t.options, cfg)
            sub = rest.strip("/")
            local = base.local_root
            return cls(
                url=url,
                base=base.base,
                scheme=base.scheme,
                tier=name,
                sub=sub,
                local_root=os.path.join(local, sub) if local is not None and sub else local,
                options=base.options,
                origin=cfg.origin,
            )
        return cls._backend(url, {}, config)

    @classmethod
    def _backend(cls, url: str, options: Mapping[str, Any], config: Config | None) -> Location:
        scheme = scheme_of(url)
        if scheme is None or scheme == "file":
            path = url[len("file://") :] if scheme == "file" else url
            root = os.path.abspath(os.path.expanduser(path))
            return cls(url=url, base=url, scheme="file", local_root=root, options=options)
        if scheme in ("s3", "s3a"):
            cfg = config or get_config()
            merged = {**dict(cfg.section("s3")), **dict(options)}
            ignore = os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true"
            if not merged.get("endpoint_url") and not ignore:
                env = next((os.environ[v] for v in _ENDPOINT_VARS if os.environ.get(v)), None)
                if env:
                    merged["endpoint_url"] = env
            return cls(url=url, base=url, scheme="s3", options=merged)
        return cls(url=url, base=url, scheme=scheme, options=options)

    def open(
        self,
        *,
        tier: str | None = None,
        metered: bool = False,
        concurrency: int | None = None,
        **options: Any,
    ) -> Store:
        """The store of this location, rooted at ``sub``; ``options`` override the
        location's own.  ``metered`` wraps the backend, below the prefix, so every location
        on a tier records one set of series.

        ``concurrency``: how many requests the caller keeps in flight (a copy's files and
        parts).  A backend with a request limit of its own is opened with this one, so the
        caller's figure is the one that holds: S3's ``max_concurrency`` (16 by default)
        unless the tier's options or ``options`` set it explicitly.  Backends without such
        a limit ignore it."""
        merged = {**dict(self.options), **options}
        if concurrency is not None:
            if concurrency < 1:
                raise ConfigError(f"concurrency must be at least 1, not {concurrency}")
            if self.scheme == "s3":
                merged.setdefault("max_concurrency", concurrency)
        store = _open_backend(self, tier or self.tier, merged)
        if metered:
            from .metered import MeteredStore

            store = MeteredStore(store)
        return store.sub(self.sub) if self.sub else store


def _open_backend(loc: Location, tier: str | None, options: dict[str, Any]) -> Store:
    if loc.scheme == "file":
        from .posix import PosixOptions, PosixStore

        unknown = set(options) - _POSIX_KEYS
        if unknown:
            raise ConfigError(f"unknown option(s) for a POSIX store: {', '.join(sorted(unknown))}")
        root = os.path.abspath(os.path.expanduser(_strip_file(loc.base)))
        return PosixStore(root, tier=tier or "file", options=PosixOptions(**options))
    if loc.scheme == "s3":
        from .s3 import S3Store

        return S3Store.from_url(loc.base, tier=tier or "s3", **options)
    import fsspec

    if loc.scheme not in fsspec.available_protocols():
        raise ConfigError(
            f"unknown URL scheme {loc.scheme!r} in {loc.url!r}: use a path, file://, s3://, "
            "TIER:path or an fsspec protocol"
        )
    from .fsspec_store import FsspecStore

    return FsspecStore(loc.base, tier=tier, **options)


def _strip_file(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def open_existing(
    url: str,
    *,
    role: str = "location",
    config: Config | None = None,
    **kwargs: Any,
) -> Store:
    """:func:`~fmstore.stores.open_store` for a location that must already exist: a missing
    local directory is :class:`NotFound` (``role`` names it in the message: ``source``,
    ``location``), never created.  For reads, listings and dry runs."""
    from . import open_store

    Location.parse(url, config).check_exists(role)
    return open_store(url, config=config, **kwargs)
