"""Megatron-core's ``dist_checkpointing`` saving and loading through fmstore.

``dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=("fmstore", 1))``
(registered when this module is imported, beside megatron-core's own ``("torch_dist", 1)``)
writes every rank's ShardedTensors and ShardedObjects, and the common state megatron-core
has just written to ``ckpt_dir/common.pt``, as one fmstore DCP checkpoint.  ``ckpt_dir`` is
the local directory of a tier location (``<nvme dir>/runs/gpt/step_N``: the step of
``nvme:runs/gpt``, saved through a ``ShardedCheckpointManager`` so the daemon tiers it) or
any other local directory.  :func:`resume_dir` gives the directory to hand
``dist_checkpointing.load(..., sharded_strategy=("fmstore", 1))``, restored from the fastest
tier that holds the step.  See docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from dataclasses import asdict
from typing import Any

import torch
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig
from megatron.core.dist_checkpointing.strategies.base import (
    LoadShardedStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.torch import (
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)

from ..checkpoint.dcp import Stager
from ..checkpoint.dcp import load as dcp_load
from ..checkpoint.dcp import save as dcp_save
from ..checkpoint.layout import parse_step
from ..config import Config, get_config
from ..errors import CorruptData, NotSupported
from ..stores import Location
from ..stores.location import split_tier

__all__ = ["BACKEND", "VERSION", "FmstoreLoadStrategy", "FmstoreSaveStrategy", "resume_dir"]

BACKEND = "fmstore"
VERSION = 1
#: The DCP keys of megatron-core's own two files, inside the checkpoint.
COMMON_KEY = "__megatron__.common.pt"
CONFIG_KEY = "__megatron__.metadata.json"


class _Unstaged(Stager):
    """Hands the state to the save as it is: the strategy returns only once the step is
    committed, so nothing changes it meanwhile, and megatron-core's tensor wrappers
    (``CheckpointableShardedTensor``: a global-shaped view of a local shard) are not
    tensors a stager could copy."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict


class _Place:
    """Where a megatron-core checkpoint directory is in fmstore's terms."""

    def __init__(self, checkpoint_dir: Any, config: Config) -> None:
        path = os.fspath(checkpoint_dir)
        if not isinstance(path, str):
            raise TypeError(f"a checkpoint directory must be a str or path, not {path!r:.80}")
        if split_tier(path, config)[0] is not None:
            # megatron-core writes common.pt and metadata.json into it with plain open():
            # a tier URL would become a local directory named "nvme:…".
            raise NotSupported(
                f"{path!r} is a tier URL; megatron-core writes into its checkpoint directory "
                "with open(): pass the tier's local directory "
                "(fmstore.integrations.megatron.local_dir(url))"
            )
        self.path = os.path.abspath(path)
        self.tier: str | None = None
        self.root = ""
        self.step: int | None = None
        self.url = self.path
        best = ""
        for name in config.tiers:
            base = Location.parse(f"{name}:", config).local_root
            if base is None:
                continue
            base = os.path.realpath(base)
            real = os.path.realpath(self.path)
            if (real == base or real.startswith(base + os.sep)) and len(base) > len(best):
                best, rel = base, os.path.relpath(real, base)
                self.tier, self.url = name, f"{name}:{'' if rel == '.' else rel}"
                parent, _, leaf = rel.rpartition(os.sep)
                self.step = parse_step(leaf) if parent else None
                self.root = parent.replace(os.sep, "/")


def local_dir(url: str, *, config: Config | None = None) -> str:
    """The local directory of ``url`` (``nvme:runs/gpt/step_N``) on a tier that has one,
    for megatron-core, which writes its ``metadata.json`` itself with ``open()``."""
    cfg = config or get_config()
    loc = Location.parse(url, cfg)
    if loc.tier is None or loc.local_root is None:
        raise NotSupported(
            f"{url!r} is not on a tier with a local directory; megatron-core writes its "
            "checkpoint directory with open() (use an nvme or lustre tier)"
        )
    return loc.local_root


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _writes_local_files(tier: str | None, config: Config) -> bool:
    """Whether this rank writes megatron-core's files back: each node's first rank on a
    node-local tier (every rank reads them from its own node), rank 0 elsewhere."""
    if tier is not None and config.tier(tier).scope == "node":
        return os.environ.get("LOCAL_RANK", "0") == "0"
    return _rank() == 0


def _megatron_config(backend: str, version: int) -> bytes:
    """The bytes megatron-core writes as ``metadata.json`` after the strategy returns
    (``serialization.save``'s ``save_config``)."""
    return json.dumps(asdict(CheckpointingConfig(backend, version))).encode()


class _Managers:
    """One ``ShardedCheckpointManager`` per (tier, run root), shared by the strategies."""

    def __init__(self) -> None:
        self.by_root: dict[tuple[str, str], Any] = {}

    def get(self, tier: str, root: str, config: Config, write_options: dict[str, Any]) -> Any:
        from ..tiering.managers.sharded import ShardedCheckpointManager
        from ..tiering.policy.rules import from_config

        key = (tier, root)
        if key not in self.by_root:
            ladder = list(from_config(config).ladder)
            self.by_root[key] = ShardedCheckpointManager(
                root,
                config=config,
                write_tier=tier,
                ladder=ladder if tier in ladder else [tier, *ladder],
                stager=_Unstaged(),
                write_options=write_options,
                handle_sigterm=False,  # the training loop decides when to save
            )
        return self.by_root[key]

    def close(self) -> None:
        managers, self.by_root = list(self.by_root.values()), {}
        for m in managers:
            m.close()


_managers = _Managers()


def close() -> None:
    """Wait for and close the managers the strategies opened (every rank, at the end of
    training): raises a failure of this rank's catalog records."""
    _managers.close()


def _config_of(config: Config | str | None) -> Config:
    if config is None:
        return get_config()
    if isinstance(config, Config):
        return config
    from ..config import load_config

    return load_config(config)


class FmstoreSaveStrategy(SaveShardedStrategy):
    """``("fmstore", 1)``: megatron-core's sharded state, and its ``common.pt``, as one
    fmstore DCP checkpoint.  ``write_options``: :class:`~fmstore.checkpoint.dcp.WriteOptions`
    fields; ``config``: a :class:`~fmstore.config.Config` or ``fmstore.toml`` path."""

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        *,
        config: Config | str | None = None,
        write_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(backend, version)
        self._config = config
        self.write_options = dict(write_options or {})

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        cfg = _config_of(self._config)
        place = _Place(checkpoint_dir, cfg)
        flat, _mapping, _rename = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, keep_only_main_replica=True
        )
        state: dict[str, Any] = {}
        for key, value in mcore_to_pyt_state_dict(flat, is_loading=False).items():
            # ShardedObjects come as BytesIO (torch.save of their data): stored as bytes.
            state[key] = value.getvalue() if isinstance(value, io.BytesIO) else value
        if COMMON_KEY in state or CONFIG_KEY in state:
            raise ValueError(
                f"the sharded state may not use the keys {COMMON_KEY!r}, {CONFIG_KEY!r}"
            )
        common = os.path.join(place.path, COMMON_STATE_FNAME)
        if _rank() == 0:
            # What serialization.save has just written with torch.save (rank 0 only),
            # and what it writes as metadata.json once this returns.
            if os.path.isfile(common):
                with open(common, "rb") as f:
                    state[COMMON_KEY] = f.read()
            state[CONFIG_KEY] = _megatron_config(self.backend, self.version)
        if place.step is not None:
            assert place.tier is not None
            mgr = _managers.get(place.tier, place.root, cfg, self.write_options)
            mgr.save(place.step, state)
            mgr.wait()  # committed before megatron-core marks the directory done
        else:
            dcp_save(state, place.url, **{"overwrite": True, **self.write_options})
        if _rank() == 0 and os.path.isfile(common):
            os.remove(common)  # it is in the checkpoint now, checksummed and committed


class FmstoreLoadStrategy(LoadShardedStrategy):
    """``("fmstore", 1)``: loads what :class:`FmstoreSaveStrategy` saved, resharded by DCP,
    from the fastest tier holding the step.  ``weights_only`` (default True) decodes the
    ShardedObjects without running pickled code."""

    def __init__(self, *, config: Config | str | None = None, weights_only: bool = True) -> None:
        super().__init__()
        self._config = config
        self.weights_only = weights_only
        #: the files :func:`resume_dir` wrote back, removed once the load is done
        self._written_back: dict[str, list[str]] = {}

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: Any) -> None:
        if loaded_backend != BACKEND:
            raise NotSupported(
                f"this checkpoint was written with megatron-core's {loaded_backend!r} backend, "
                f"not {BACKEND!r}: load it without sharded_strategy=({BACKEND!r}, {VERSION})"
            )

    def check_version_compatibility(self, loaded_version: Any) -> None:
        if loaded_version != VERSION:
            raise NotSupported(
                f"{BACKEND!r} checkpoint version {loaded_version!r} is not {VERSION}"
            )

    def _read(self, state: dict[str, Any], place: _Place, cfg: Config) -> None:
        if place.step is not None:
            assert place.tier is not None
            mgr = _managers.get(place.tier, place.root, cfg, {})
            if mgr.restore(state, step=place.step) is None:
                from ..errors import NotFound

                raise NotFound(f"no committed checkpoint at {place.url} on any tier")
        else:
            dcp_load(state, place.url)

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        cfg = _config_of(self._config)
        place = _Place(checkpoint_dir, cfg)
        flat, mapping, rename = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        state = mcore_to_pyt_state_dict(flat, is_loading=True)
        objects = [k for k, v in state.items() if isinstance(v, io.BytesIO)]
        for k in objects:
            state[k] = b""
        try:
            self._read(state, place, cfg)
        finally:
            self._drop_written_back(place.path)
        for k in objects:
            state[k] = self._objects(state[k], k, place.url)
        out = {k: _unwrap_pyt_sharded_tensor(v) for k, v in state.items()}
        out = _replace_sharded_keys_with_state_dict_keys(out, mapping, rename)
        _restore_dict_types(out, sharded_state_dict)
        return out

    def _objects(self, data: Any, key: str, url: str) -> list[Any]:
        if not isinstance(data, bytes):
            raise CorruptData(f"{url}: ShardedObject {key!r} is not stored as bytes")
        try:
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=self.weights_only)
        except Exception as e:
            if not self.weights_only:
                raise
            raise CorruptData(
                f"{url}: ShardedObject {key!r} holds values weights_only refuses ({e}); pass "
                "sharded_strategy=FmstoreLoadStrategy(weights_only=False) if you trust it"
            ) from None
        if not isinstance(value, list):
            raise CorruptData(f"{url}: ShardedObject {key!r} is not a list of shards")
        return value

    def _drop_written_back(self, path: str) -> None:
        """After the load (every rank has read megatron-core's files by then): remove what
        :func:`resume_dir` wrote back, so no copy outside the checkpoint stays."""
        if path not in self._written_back:
            return
        files = self._written_back.pop(path)  # empty on the ranks that wrote nothing
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                os.remove(f)
        with contextlib.suppress(OSError):
            os.rmdir(path)  # only a directory resume_dir made, left empty

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Any:
        raise NotSupported(f"{BACKEND!r} checkpoints: load_tensors_metadata is not supported")

    def load_sharded_metadata(self, checkpoint_dir: Any) -> Any:
        raise NotSupported(
            f"{BACKEND!r} checkpoints: load_sharded_metadata (and a strict= that needs it) "
            "is not supported"
        )


def resume_dir(
    root: str, step: int | None = None, *, config: Config | str | None = None
) -> str | None:
    """Every rank: the local directory to hand ``dist_checkpointing.load(...,
    sharded_strategy=("fmstore", 1))`` for ``step`` (default: the newest committed step on
    any tier of the ladder) of the run ``root`` (``nvme:runs/gpt``, or that tier's local
    directory); None when the run has no checkpoint.

    megatron-core reads ``metadata.json`` and ``common.pt`` from that directory before it
    calls any strategy; they are written back from the checkpoint (read from the fastest
    tier that holds it), by each node's first rank on a node-local tier, and removed again
    by the load (``metadata.json`` stays where the save left it)."""
    cfg = _config_of(config)
    tier, rest = split_tier(root, cfg)
    if tier is None:
        place = _Place(os.path.join(root, "step_000000000000"), cfg)
        if place.tier is None:
            raise NotSupported(f"{root!r} is not on a configured tier")
        tier, rest = place.tier, place.root
    run = rest.strip("/")
    mgr = _managers.get(tier, run, cfg, {})
    if step is None:
        step = mgr.latest_step()
        if step is None:
            return None
    path = local_dir(mgr.uri(tier, step), config=cfg)
    state: dict[str, Any] = {COMMON_KEY: b"", CONFIG_KEY: b""}
    if mgr.restore(state, step=step) is None:
        return None
    loader = get_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION)
    written: list[str] = []
    if _writes_local_files(tier, cfg):
        os.makedirs(path, exist_ok=True)
        for name, key in ((COMMON_STATE_FNAME, COMMON_KEY), (CONFIG_FNAME, CONFIG_KEY)):
            target = os.path.join(path, name)
            data = state[key]
            if not isinstance(data, bytes) or not data:
                raise CorruptData(f"{mgr.uri(tier, step)}: no {name} of megatron-core in it")
            if name == CONFIG_FNAME and os.path.isfile(target):
                continue  # the save's own marker
            tmp = f"{target}.fmstore-tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
            written.append(target)
    if isinstance(loader, FmstoreLoadStrategy):
        loader._written_back[path] = written  # on every rank: the load's barrier is collective
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return path


def register() -> None:
    """Register ``("fmstore", 1)`` for sharded saves and loads (done on import; megatron-core
    re-registers only its own ``("torch_dist", 1)`` at each look-up)."""
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, BACKEND, VERSION, FmstoreSaveStrategy(BACKEND, VERSION)
    )
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, FmstoreLoadStrategy())


register()
