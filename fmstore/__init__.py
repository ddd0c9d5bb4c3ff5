"""fmstore: tiered storage for foundation-model checkpoints and datasets."""

from __future__ import annotations

__version__ = "0.1.0"

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
