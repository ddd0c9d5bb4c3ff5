"""fmstore: tiered storage for foundation-model checkpoints and datasets."""

from __future__ import annotations

__version__ = "0.1.0"

from .checkpoint import SaveHandle, aload, asave, async_save, load, save  # noqa: E402
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

__all__ = [
    "__version__",
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
