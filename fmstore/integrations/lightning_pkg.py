"""Which Lightning fmstore plugs into: the ``CheckpointIO`` base of the package the Trainer
comes from (``lightning.fabric`` when the unified ``lightning`` package is already imported,
or is the only one installed, else ``lightning_fabric``, what ``pytorch_lightning`` uses),
and the removal of a checkpoint both the plugin and the sharded strategies use."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING

from ..stores import open_store

__all__ = ["CheckpointIO", "remove_checkpoint_prefix"]

if TYPE_CHECKING:  # pragma: no cover
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
else:

    def _checkpoint_io_base() -> type:
        """Lightning's ``CheckpointIO`` of the Lightning the Trainer comes from (its
        plugin check is an ``isinstance`` against that very class)."""
        order = ["lightning_fabric", "lightning.fabric"]
        if "lightning" in sys.modules or importlib.util.find_spec("lightning_fabric") is None:
            order.reverse()
        for pkg in order:
            try:
                mod = importlib.import_module(f"{pkg}.plugins.io.checkpoint_io")
            except ImportError:
                continue
            return mod.CheckpointIO  # type: ignore[no-any-return]
        raise ImportError(
            "fmstore.integrations.lightning needs Lightning: pip install lightning "
            "(or pytorch-lightning)"
        )

    CheckpointIO = _checkpoint_io_base()


def remove_checkpoint_prefix(url: str) -> None:
    """Delete the fmstore checkpoint at ``url``, manifest first (it stops being one before
    its blobs go)."""
    from .. import runtime
    from ..tiering.exports.mover import delete_checkpoint

    async def go() -> None:
        store = open_store(url)
        try:
            await delete_checkpoint(store)
        finally:
            await store.close()

    runtime.run(go())
