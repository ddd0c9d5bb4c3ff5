"""Lightning's sharded strategies, saving and loading through fmstore.

``Trainer(strategy=FmstoreModelParallelStrategy(...))`` (FSDP2 / DTensor) or
``Trainer(strategy=FmstoreFSDPStrategy(...))`` (FSDP1, ``state_dict_type="sharded"``):
every checkpoint the strategy writes is one fmstore DCP checkpoint (``manifest.json`` and
blobs, committed last), holding the sharded model and optimizer state *and* the rest of
Lightning's checkpoint (loops, callbacks, hyper-parameters, schedulers), which Lightning's
own strategies write as a separate ``meta.pt`` pickle beside torch's ``.metadata`` files.

``FmstoreModelCheckpoint`` (a ``ModelCheckpoint`` with the same arguments) names the steps
``step_NNNNNNNNNNNN`` so the daemon tiers them, takes tier URLs as ``dirpath``
(``"nvme:runs/a"``), and resolves ``trainer.fit(ckpt_path="last")`` to the newest committed
step on any tier of the ladder.  See docs/integrations.md.
"""

from __future__ import annotations

import importlib
import io
import os
import re
from typing import Any

import torch

from ..checkpoint.dcp import load as dcp_load
from ..checkpoint.dcp import save as dcp_save
from ..checkpoint.layout import MANIFEST_KEY, parse_step, step_name
from ..config import get_config
from ..stores import Location
from ..stores.location import split_tier
from .lightning_pkg import CheckpointIO, remove_checkpoint_prefix

# The trainer package of the Lightning the plugin's base class comes from.
_pl: Any = importlib.import_module(
    "lightning.pytorch" if CheckpointIO.__module__.startswith("lightning.") else "pytorch_lightning"
)

__all__ = ["FmstoreFSDPStrategy", "FmstoreModelCheckpoint", "FmstoreModelParallelStrategy"]

#: The key of Lightning's non-tensor state (loops, callbacks, hparams) in the DCP state.
LIGHTNING_KEY = "lightning"
_FMSTORE_URL = re.compile(r"^fmstore://([^/]+)/(.*)\Z")


def checkpoint_url(path: Any) -> str:
    """The fmstore location of the checkpoint Lightning names ``path``: ``fmstore://T/K``
    (what :class:`FmstoreModelCheckpoint` hands Lightning for ``ckpt_path="last"``, so that
    its file system can tell the time) becomes ``T:K``; a trailing ``manifest.json`` goes."""
    url = os.fspath(path)
    if not isinstance(url, str):
        raise TypeError(f"a checkpoint path must be a str or path, not {type(url).__name__}")
    m = _FMSTORE_URL.match(url)
    if m:
        url = f"{m.group(1)}:{m.group(2)}"
    url = url.rstrip("/")
    if url.endswith("/" + MANIFEST_KEY):
        url = url[: -len(MANIFEST_KEY) - 1]
    return url


def _step_of(url: str) -> tuple[str, str, int] | None:
    """``(tier, root, step)`` when ``url`` is ``TIER:ROOT/step_NNNNNNNNNNNN``."""
    tier, rest = split_tier(url)
    if tier is None:
        return None
    root, _, name = rest.strip("/").rpartition("/")
    step = parse_step(name)
    return None if step is None or not root else (tier, root, step)


class _FmstoreSharded:
    """What the fmstore strategies share: ``save_checkpoint`` / ``load_checkpoint`` /
    ``remove_checkpoint`` through fmstore's DCP entry points (or a
    :class:`~fmstore.tiering.managers.sharded.ShardedCheckpointManager` for a step on a tier)."""

    #: the key Lightning's strategy files the model's state under in the DCP state
    _model_key = "state_dict"
    _fmstore_weights_only: bool = True
    _fmstore_write_options: dict[str, Any]
    _fmstore_managers: dict[tuple[str, str], Any]

    def _fmstore_setup(self, weights_only: bool, write_options: dict[str, Any] | None) -> None:
        self._fmstore_weights_only = weights_only
        self._fmstore_write_options = dict(write_options or {})
        self._fmstore_managers = {}

    def _fmstore_sharded(self) -> bool:
        raise NotImplementedError

    def _manager(self, tier: str, root: str) -> Any:
        from ..tiering.managers.sharded import ShardedCheckpointManager
        from ..tiering.policy.rules import from_config

        key = (tier, root)
        if key not in self._fmstore_managers:
            cfg = get_config()
            ladder = list(from_config(cfg).ladder)
            self._fmstore_managers[key] = ShardedCheckpointManager(
                root,
                config=cfg,
                write_tier=tier,
                ladder=ladder if tier in ladder else [tier, *ladder],
                write_options=self._fmstore_write_options,
                handle_sigterm=False,  # Lightning's own SIGTERM handling saves, not fmstore's
            )
        return self._fmstore_managers[key]

    # ---- saving ----------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not "
                "supported: pass write options to the strategy (write_options=...)"
            )
        url = checkpoint_url(self.broadcast(os.fspath(filepath)))  # type: ignore[attr-defined]
        state: dict[str, Any] = {self._model_key: checkpoint.pop("state_dict")}
        for i, o in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = o
        # The rest (plain data and small tensors: loops, callbacks, hparams) as one
        # checksummed blob of the same checkpoint, read back with weights_only.  As bytes:
        # a dict would be flattened by DCP, and loading it back needs its exact keys.
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        state[LIGHTNING_KEY] = buf.getvalue()
        where = _step_of(url)
        gstep = checkpoint.get("global_step")
        if where is not None and where[2] == gstep:
            mgr = self._manager(where[0], where[1])
            mgr.save(where[2], state)
            mgr.wait()  # Lightning may remove the previous checkpoint right after
            return
        dcp_save(state, url, **{"overwrite": True, **self._fmstore_write_options})

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the checkpoint (manifest first); rank 0, as Lightning removes."""
        if not self.is_global_zero:  # type: ignore[attr-defined]
            return
        url = checkpoint_url(filepath)
        local = Location.parse(url).local_root
        if local is not None and os.path.isfile(local):
            os.remove(local)
            return
        remove_checkpoint_prefix(url)
        if local is not None and os.path.isdir(local):
            import shutil

            shutil.rmtree(local, ignore_errors=True)  # the directories left empty

    # ---- loading ---------------------------------------------------------------------

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        url = checkpoint_url(self.broadcast(os.fspath(checkpoint_path)))  # type: ignore[attr-defined]
        model = self.model  # type: ignore[attr-defined]
        module = self.lightning_module  # type: ignore[attr-defined]
        assert model is not None and module is not None
        fitting = module.trainer.state.fn == _pl.trainer.states.TrainerFn.FITTING
        optimizers = list(self.optimizers) if fitting else []  # type: ignore[attr-defined]
        state: dict[str, Any] = {self._model_key: get_model_state_dict(model)}
        for i, o in enumerate(optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(model, o)
        state[LIGHTNING_KEY] = b""
        wo = self._fmstore_weights_only if weights_only is None else weights_only
        where = _step_of(url)
        if where is not None:
            # the step from the fastest tier that holds it for every rank
            self._manager(where[0], where[1]).restore(state, step=where[2])
        else:
            dcp_load(state, url)
        strict = module.strict_loading
        set_model_state_dict(model, state[self._model_key], options=StateDictOptions(strict=strict))
        for i, o in enumerate(optimizers):
            set_optimizer_state_dict(
                model, o, state[f"optimizer_{i}"], options=StateDictOptions(cpu_offload=True)
            )
        return _lightning_state(state[LIGHTNING_KEY], url, weights_only=wo)

    def teardown(self) -> None:
        for m in self._fmstore_managers.values():
            m.close()
        self._fmstore_managers.clear()
        super().teardown()  # type: ignore[misc]


def _lightning_state(data: Any, url: str, *, weights_only: bool) -> dict[str, Any]:
    """Lightning's non-tensor state from its blob (weights_only: no code runs)."""
    from ..errors import CorruptData

    if not isinstance(data, bytes) or not data:
        raise CorruptData(f"{url}: no Lightning state in this checkpoint (not one Lightning saved)")
    try:
        meta = torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except Exception as e:
        if not weights_only:
            raise
        raise CorruptData(
            f"{url}: Lightning's state holds values weights_only refuses ({e}); pass "
            "trainer.fit(..., weights_only=False) if you trust this checkpoint"
        ) from None
    if not isinstance(meta, dict):
        raise CorruptData(f"{url}: Lightning's state in this checkpoint is not a dict")
    return meta


def _refuse_unsharded(name: str) -> None:
    raise ValueError(
        f"{name} writes sharded checkpoints only; for a full state dict on rank 0 use "
        "Lightning's strategy with plugins=[FmstoreCheckpointIO()]"
    )


class FmstoreModelParallelStrategy(_FmstoreSharded, _pl.strategies.ModelParallelStrategy):  # type: ignore[misc, name-defined]
    """``ModelParallelStrategy`` (FSDP2 / tensor parallel) whose checkpoints are fmstore
    DCP checkpoints holding the whole Lightning checkpoint.  Takes the same arguments, plus
    ``weights_only`` (default True: Lightning's non-tensor state is decoded without running
    pickled code; ``trainer.fit(..., weights_only=False)`` or ``weights_only=False`` here
    opts out) and ``write_options`` (:class:`~fmstore.checkpoint.dcp.WriteOptions` fields)."""

    def __init__(
        self,
        *args: Any,
        weights_only: bool = True,
        write_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            _refuse_unsharded(type(self).__name__)
        self._fmstore_setup(weights_only, write_options)

    def _fmstore_sharded(self) -> bool:
        return True


class FmstoreFSDPStrategy(_FmstoreSharded, _pl.strategies.FSDPStrategy):  # type: ignore[misc, name-defined]
    """``FSDPStrategy`` (FSDP1) with ``state_dict_type="sharded"`` (the default here) whose
    checkpoints are fmstore DCP checkpoints holding the whole Lightning checkpoint; the
    same extra arguments as :class:`FmstoreModelParallelStrategy`."""

    _model_key = "model"

    def __init__(
        self,
        *args: Any,
        weights_only: bool = True,
        write_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("state_dict_type", "sharded")
        super().__init__(*args, **kwargs)
        if self._state_dict_type != "sharded":
            _refuse_unsharded(type(self).__name__)
        self._fmstore_setup(weights_only, write_options)

    def _fmstore_sharded(self) -> bool:
        return True


class FmstoreModelCheckpoint(_pl.callbacks.ModelCheckpoint):  # type: ignore[misc, name-defined]
    """``ModelCheckpoint`` (same arguments) for the fmstore strategies.

    * Each checkpoint is saved as ``DIRPATH/step_NNNNNNNNNNNN`` (the trainer's global step),
      the name the daemon tiers; the name Lightning would have given it
      (``epoch=0-step=4.ckpt``, ``last.ckpt``) is kept in this callback's state in the
      checkpoint (``lightning_names``).  A ``save_last`` checkpoint of the step a top-k
      checkpoint just saved is that same checkpoint: saved once.
    * ``dirpath`` may be a tier URL (``"nvme:runs/a"``): used as is, never made a local path.
    * Lightning's removals are of one name: a step also saved under another name still
      kept (a top-k step that was also "last") stays.
    * ``trainer.fit(ckpt_path="last")`` resumes from the newest committed step on any tier
      of the ladder (``[policies]``), the write tier first; the strategy restores it from
      the fastest tier that holds it.
    """

    def __init__(self, dirpath: Any = None, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_last") == "link":
            raise ValueError("FmstoreModelCheckpoint: save_last='link' is not supported")
        kwargs["enable_version_counter"] = False  # a step has one name
        super().__init__(dirpath, *args, **kwargs)
        if dirpath is not None and split_tier(os.fspath(dirpath))[0] is not None:
            self.dirpath = os.fspath(dirpath).rstrip("/")  # not realpath'd into ./nvme:…
        #: step path -> the names Lightning gave it
        self.lightning_names: dict[str, list[str]] = {}

    def format_checkpoint_name(
        self,
        metrics: dict[str, Any],
        filename: str | None = None,
        ver: int | None = None,
        prefix: str | None = None,
    ) -> str:
        name = super().format_checkpoint_name(metrics, filename, ver, prefix)
        step = metrics.get("step")
        if step is None or self.dirpath is None:
            return name  # type: ignore[no-any-return]
        path = f"{os.fspath(self.dirpath).rstrip('/')}/{step_name(int(step))}"
        names = self.lightning_names.setdefault(path, [])
        if os.path.basename(name) not in names:
            names.append(os.path.basename(name))
        return path

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        if filepath == self._last_checkpoint_saved and (
            trainer.global_step == self._last_global_step_saved
        ):
            return  # this step is saved already (top-k, then last)
        super()._save_checkpoint(trainer, filepath)

    def _live(self) -> set[str]:
        return {
            *self.best_k_models,
            self.best_model_path,
            self.kth_best_model_path,
            self.last_model_path,
        } - {""}

    def _save_last_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        self._for_last = True  # a removal from here is of the previous "last" name only
        try:
            super()._save_last_checkpoint(trainer, monitor_candidates)
        finally:
            self._for_last = False

    def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
        """Lightning removes one name (a previous "last", a top-k it dropped); the step goes
        once no other name it was saved under is kept."""
        names = self.lightning_names.get(filepath, [])
        is_last = [n for n in names if n.startswith(self.CHECKPOINT_NAME_LAST)]
        others = [n for n in names if n not in is_last]
        keep = others if getattr(self, "_for_last", False) else is_last
        if keep:
            self.lightning_names[filepath] = keep
            return
        if filepath in self._live():
            return  # a kept path (best, top-k, last) is this step
        self.lightning_names.pop(filepath, None)
        super()._remove_checkpoint(trainer, filepath)

    def state_dict(self) -> dict[str, Any]:
        out = dict(super().state_dict())
        out["lightning_names"] = {p: list(n) for p, n in self.lightning_names.items()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        names = state_dict.get("lightning_names")
        if isinstance(names, dict):
            self.lightning_names.update({str(k): list(v) for k, v in names.items()})

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """The newest committed step under ``dirpath`` on any tier of the ladder (this
        rank's listing: the strategy broadcasts rank 0's choice and restores that step from
        the fastest tier holding it for every rank)."""
        if self.dirpath is None:
            return set()  # type: ignore[no-any-return]
        from .. import runtime

        url = os.fspath(self.dirpath).rstrip("/")
        tier, root = split_tier(url)
        if tier is None:
            best = _newest_local(url)
            return {best} if best else set()
        from ..tiering.policy.rules import from_config
        from ..tiering.tiers import Tiers

        cfg = get_config()
        ladder = list(from_config(cfg).ladder)
        tiers = Tiers(cfg)
        found: tuple[int, str] | None = None
        for t in [tier, *[x for x in ladder if x != tier]]:
            step = runtime.run(_newest_on(tiers.store(t), root.strip("/")))
            if step is not None and (found is None or step > found[0]):
                found = (step, t)
        if found is None:
            return set()
        step, t = found
        # fmstore:// so that Lightning's file system look-up can stat it on any tier
        return {f"fmstore://{t}/{root.strip('/')}/{step_name(step)}/{MANIFEST_KEY}"}


def _newest_local(path: str) -> str | None:
    try:
        names = os.listdir(path)
    except OSError:
        return None
    steps = [
        s
        for n in names
        if (s := parse_step(n)) is not None and os.path.isfile(os.path.join(path, n, MANIFEST_KEY))
    ]
    return os.path.join(path, step_name(max(steps))) if steps else None


async def _newest_on(store: Any, root: str) -> int | None:
    from .. import keys as _keys
    from ..errors import NotFound

    prefix = _keys.validate_prefix(root)
    best: int | None = None
    try:
        async for meta in store.list(prefix, recursive=False):
            step = parse_step(meta.key[len(prefix) :]) if meta.is_dir else None
            if step is None or (best is not None and step <= best):
                continue
            if await store.exists(_keys.join(root, step_name(step), MANIFEST_KEY)):
                best = step
    except NotFound:
        pass
    return best
