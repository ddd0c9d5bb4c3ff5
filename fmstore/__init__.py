"""fmstore: tiered storage for foundation-model checkpoints and datasets."""

from __future__ import annotations

__version__ = "0.1.0"

from .checkpoint import SaveHandle, aload, asave, async_save, load, save  # noqa: E402
from .checkpoint.manager import CheckpointManager  # noqa: E402
from .errors import (  # noqa: E402
    AlreadyExists,
    ConfigError,
    CorruptData,
    FmstoreError,
    InvalidKey,
    NotFound,
    PermissionDenied,
    StoreUnavailable,
    TierFull,
    VersionError,
)
from .stores import open_store  # noqa: E402


def open(path: str, mode: str = "rb", **kwargs):  # type: ignore[no-untyped-def]  # noqa: A001
    """Open a local file; a file of a lazily staged dataset is fetched on first open and
    kept (see :mod:`fmstore.tiering.lazy`)."""
    from .tiering.lazy import open as _open

    return _open(path, mode, **kwargs)


__all__ = [
    "CheckpointManager",
    "__version__",
    "open",
    "open_store",
    "save",
    "load",
    "asave",
    "aload",
    "async_save",
    "SaveHandle",
    "AlreadyExists",
    "ConfigError",
    "CorruptData",
    "FmstoreError",
    "InvalidKey",
    "NotFound",
    "PermissionDenied",
    "StoreUnavailable",
    "TierFull",
    "VersionError",
]
