"""fmstore: tiered storage for foundation-model checkpoints and datasets."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .checkpoint import SaveHandle, aload, asave, async_save, load, prepare_async_save, save
    from .tiering.managers.manager import CheckpointManager
    from .tiering.managers.sharded import ShardedCheckpointManager

#: Names served by :mod:`fmstore.checkpoint`, imported on first use: it loads torch, which
#: the storage layer and the CLI's staging commands do not need (seconds at start-up).
_CHECKPOINT_NAMES = frozenset(
    {"SaveHandle", "aload", "asave", "async_save", "load", "prepare_async_save", "save"}
)


def __getattr__(name: str) -> Any:
    if name in _CHECKPOINT_NAMES:
        from . import checkpoint

        value = getattr(checkpoint, name)
        globals()[name] = value
        return value
    if name == "CheckpointManager":
        from .tiering.managers.manager import CheckpointManager

        globals()[name] = CheckpointManager
        return CheckpointManager
    if name == "ShardedCheckpointManager":
        from .tiering.managers.sharded import ShardedCheckpointManager

        globals()[name] = ShardedCheckpointManager
        return ShardedCheckpointManager
    raise AttributeError(f"module 'fmstore' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The names served on first use are listed too (tab completion in notebooks, dir()).
    return sorted(set(globals()) | _CHECKPOINT_NAMES | {"CheckpointManager"})


def open(path: str, mode: str = "rb", **kwargs):  # type: ignore[no-untyped-def]  # noqa: A001
    """Open a local file; a file of a lazily staged dataset is fetched on first open and
    kept (see :mod:`fmstore.tiering.staging.lazy`)."""
    from .tiering.staging.lazy import open as _open

    return _open(path, mode, **kwargs)


__all__ = [
    "CheckpointManager",
    "ShardedCheckpointManager",
    "__version__",
    "open",
    "open_store",
    "save",
    "load",
    "asave",
    "aload",
    "async_save",
    "prepare_async_save",
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
