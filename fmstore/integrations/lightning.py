"""A Lightning ``CheckpointIO`` that saves and loads through fmstore.

``Trainer(plugins=[FmstoreCheckpointIO()])``: every checkpoint Lightning writes (through
``ModelCheckpoint`` or ``trainer.save_checkpoint``) becomes an fmstore checkpoint at the
path it names (a directory holding ``manifest.json`` and blobs), written in the background
once snapshotted.  Paths may be any fmstore location: a local path, ``file://``,
``TIER:path`` (a tier of ``fmstore.toml``), ``s3://bucket/key``.  See docs/integrations.md.

Importing this module imports Lightning's ``CheckpointIO`` base class: from
``lightning.fabric`` when the unified ``lightning`` package is already imported (or is the
only one installed), else from ``lightning_fabric`` (what ``pytorch_lightning`` uses).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import threading
import warnings
from typing import Any

from ..checkpoint import SaveHandle, async_save, load, prepare_async_save, save
from ..checkpoint.api import TorchSuffixWarning
from ..errors import NotSupported
from ..stores import Location
from .lightning_pkg import CheckpointIO, remove_checkpoint_prefix

__all__ = [
    "FmstoreBypassedWarning",
    "FmstoreCheckpointIO",
    "prepare_callback",
]  # and, imported on first use, the names of _SHARDED (fmstore.integrations.lightning_sharded)


def _url(path: Any) -> str:
    return str(os.fspath(path))


def _local_path(url: str) -> str | None:
    return Location.parse(url).local_root


#: What Lightning's own sharded strategies write, going around any ``CheckpointIO``: torch's
#: DCP files and the rest of the checkpoint pickled beside them.
_NATIVE_SHARDED = (".metadata", "meta.pt")


class FmstoreBypassedWarning(UserWarning):
    """A checkpoint at a path this plugin was handed was written without it."""


def _bypassed(local: str | None) -> bool:
    """Whether ``local`` is a checkpoint Lightning's ``ModelParallelStrategy`` or
    ``FSDPStrategy(state_dict_type="sharded")`` wrote itself (never calling the plugin)."""
    return (
        local is not None
        and os.path.isdir(local)
        and not os.path.exists(os.path.join(local, "manifest.json"))
        and any(os.path.isfile(os.path.join(local, n)) for n in _NATIVE_SHARDED)
    )


def _bypass_text(path: str) -> str:
    return (
        f"{path} was written by Lightning's sharded strategy itself (torch's .metadata and a "
        "meta.pt pickle, no fmstore checkpoint): ModelParallelStrategy and "
        "FSDPStrategy(state_dict_type='sharded') never call a CheckpointIO plugin, so "
        "FmstoreCheckpointIO was bypassed. Use strategy=FmstoreModelParallelStrategy(...) "
        "or FmstoreFSDPStrategy(...) from fmstore.integrations.lightning instead"
    )


class FmstoreCheckpointIO(CheckpointIO):  # type: ignore[misc]
    """Saves Lightning checkpoints with :func:`fmstore.async_save`, loads them with
    :func:`fmstore.load`.

    ``save_checkpoint`` returns once the checkpoint is snapshotted (every tensor copied to
    a host staging buffer); the write runs in the background, one at a time, like
    Lightning's ``AsyncCheckpointIO``.  A failed write is raised by the next
    ``save_checkpoint``, ``load_checkpoint``, ``remove_checkpoint`` or by ``teardown``
    (which Lightning calls at the end of ``fit``), which waits for the last write.
    ``async_save=False`` writes synchronously.

    ``pickle``: Lightning checkpoints hold plain data (numbers, strings, dicts, tensors) as
    long as the module's hyper-parameters are plain data; values fmstore cannot store
    natively (a ``Namespace`` in ``hparams``, a callback's custom object) raise TypeError
    naming their path unless ``pickle=True``.  ``weights_only``: the default for loading
    when Lightning passes none (``trainer.fit(ckpt_path=..., weights_only=None)``, its
    default): True, as in ``torch.load``, refuses pickled values; a checkpoint saved with
    ``pickle=True`` needs ``weights_only=False`` here or in ``trainer.fit``.  An explicit
    ``weights_only`` from Lightning wins.

    Lightning's sharded strategies (``ModelParallelStrategy``,
    ``FSDPStrategy(state_dict_type="sharded")``) never call a ``CheckpointIO``: use
    ``FmstoreModelParallelStrategy`` / ``FmstoreFSDPStrategy`` for them.  A checkpoint such
    a strategy wrote itself is refused by ``load_checkpoint`` (``NotSupported``, saying so)
    and warned about (:class:`FmstoreBypassedWarning`) by ``remove_checkpoint``, the first
    call this plugin gets from such a run.

    ``overwrite`` (default True, as ``torch.save`` overwrites files): Lightning saves
    ``last.ckpt`` again and again; each overwrite is atomic.  ``save_options`` go to
    :func:`fmstore.save` (``compression``, ``chunk_size``, ...); a checkpoint's
    ``storage_options`` (``trainer.save_checkpoint(path, storage_options=...)``) must be a
    dict of the same and override them for that save.

    Loading a plain file (a ``torch.save`` checkpoint written before switching to fmstore)
    goes through ``torch.load`` with the same ``weights_only``.
    """

    def __init__(
        self,
        *,
        async_save: bool = True,
        weights_only: bool = True,
        pickle: bool = False,
        overwrite: bool = True,
        save_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.async_save = async_save
        self.weights_only = weights_only
        self.pickle = pickle
        self.overwrite = overwrite
        self.save_options = dict(save_options or {})
        self._lock = threading.Lock()
        self._pending: list[SaveHandle] = []

    # ---- saving ---------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(
                f"{type(self).__name__}: storage_options must be a dict of fmstore.save "
                f"options, not {type(storage_options).__name__}"
            )
        options = {**self.save_options, **(storage_options or {})}
        options.setdefault("overwrite", self.overwrite)
        options.setdefault("pickle", self.pickle)
        url = _url(path)
        self._raise_failed()
        with warnings.catch_warnings():
            # A ".ckpt" that is a directory is what this plugin is documented to write.
            warnings.simplefilter("ignore", TorchSuffixWarning)
            if not self.async_save:
                save(checkpoint, url, **options)
                return
            handle = async_save(checkpoint, url, **options)
        with self._lock:
            self._pending.append(handle)

    def prepare(self, state: Any) -> Any:
        """Allocate and fault in the staging buffer of a checkpoint like ``state`` in the
        background (:func:`fmstore.prepare_async_save`), so the first save stalls no longer
        than the later ones; returns its future.  :func:`prepare_callback` calls it."""
        if not self.async_save:
            return None
        return prepare_async_save(state)

    def _raise_failed(self, *, wait: bool = False) -> None:
        """Forget finished saves; raise the first failure among them (all of them, waiting
        for those in flight, with ``wait``)."""
        with self._lock:
            finished = [h for h in self._pending if wait or h.done()]
            self._pending = [h for h in self._pending if h not in finished]
        error: BaseException | None = None
        for h in finished:
            e = h.exception()  # waits for one still in flight
            if e is not None and error is None:
                error = e
        if error is not None:
            raise error

    def wait(self) -> None:
        """Wait for every save in flight; raise the first failure."""
        self._raise_failed(wait=True)

    def teardown(self) -> None:
        self.wait()

    # ---- loading --------------------------------------------------------------------------

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.wait()  # the checkpoint asked for may still be being written
        url = _url(path)
        wo = self.weights_only if weights_only is None else weights_only
        local = _local_path(url)
        if _bypassed(local):
            raise NotSupported(_bypass_text(url))
        if local is not None and os.path.isfile(local):
            import torch

            return torch.load(local, map_location=map_location, weights_only=wo)  # type: ignore[no-any-return]
        return load(url, map_location=map_location, weights_only=wo)  # type: ignore[no-any-return]

    # ---- removing -------------------------------------------------------------------------

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (manifest first, so a half-removed checkpoint is
        never mistaken for one); a plain file is removed too.  Nothing there: nothing done."""
        self.wait()
        url = _url(path)
        local = _local_path(url)
        if _bypassed(local):
            # Only rank 0 removes: raising here would leave the other ranks waiting.
            warnings.warn(_bypass_text(url), FmstoreBypassedWarning, stacklevel=2)
        if local is not None:
            if os.path.isfile(local) or os.path.islink(local):
                os.remove(local)
            elif os.path.isdir(local):
                remove_checkpoint_prefix(url)
                shutil.rmtree(local, ignore_errors=True)  # the directories left empty
            return
        remove_checkpoint_prefix(url)


def prepare_callback() -> Any:
    """A Lightning ``Callback`` (``Trainer(callbacks=[prepare_callback()])``) that, after
    the first training batch (the optimizer's state exists then), has the trainer's
    :class:`FmstoreCheckpointIO` prepare its staging for the module's and optimizers' state
    off the training loop (see :meth:`FmstoreCheckpointIO.prepare`).  Its ``future``
    attribute is the preparation's (None before, or without an fmstore plugin)."""
    pkg = "lightning.pytorch" if CheckpointIO.__module__.startswith("lightning.") else None
    base = importlib.import_module(pkg or "pytorch_lightning").Callback

    class FmstorePrepare(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.future: Any = None
            self._done = False

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if self._done:
                return
            self._done = True
            io = getattr(trainer.strategy, "checkpoint_io", None)
            if isinstance(io, FmstoreCheckpointIO):
                state = {
                    "state_dict": pl_module.state_dict(),
                    "optimizer_states": [o.state_dict() for o in trainer.optimizers],
                }
                self.future = io.prepare(state)

    return FmstorePrepare()


_SHARDED = ("FmstoreFSDPStrategy", "FmstoreModelCheckpoint", "FmstoreModelParallelStrategy")


def __getattr__(name: str) -> Any:
    # The strategies import Lightning's trainer package: only when asked for.
    if name in _SHARDED:
        from . import lightning_sharded

        return getattr(lightning_sharded, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
