"""Accelerate's ``save_state`` / ``load_state`` through fmstore: one manager checkpoint a step.

``fmstore.integrations.accelerate.attach(accelerator)``: from then on
``accelerator.save_state("nvme:runs/acc/step_N")`` and ``accelerator.load_state("nvme:runs/acc")``
(a tier URL where Accelerate takes a directory) go through fmstore; a local directory is
still Accelerate's own.  :func:`save_state` / :func:`load_state` are the same without the
attachment.  What Accelerate's ``save_state`` keeps in a folder of pickles and safetensors
files (models, optimizers, schedulers, the gradient scaler, objects registered with
``register_for_checkpointing``, each process's RNG states, the samplers' and data loaders'
positions) is one :class:`~fmstore.CheckpointManager` checkpoint, plain data only (loads
with ``weights_only``), written by the main process only: the other processes' RNG states
and data positions are gathered to it (:mod:`.rank_state`).  Every process restores
(:mod:`.rank_zero`).  See docs/integrations.md.  Importing this module imports ``accelerate``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import re
import threading
import warnings
import weakref
from typing import Any

import accelerate
from accelerate.utils import DistributedType

from ..config import get_config
from ..errors import ConfigError, CorruptData, FmstoreError, NotFound, NotSupported
from ..stores.location import decided_by_config, split_tier
from ..tiering.managers.manager import CheckpointManager, PendingSave
from ..tiering.policy.policies import from_config
from . import rank_state
from .rank_zero import TierReader, dist_group, restore_on_every_rank

__all__ = ["attach", "close", "load_state", "save_state"]

log = logging.getLogger("fmstore.integrations.accelerate")

_STEP = re.compile(r"^step_([0-9]+)\Z")
_FMSTORE_URL = re.compile(r"^fmstore://([^/]+)/(.*)\Z")
#: What Accelerate writes beside the model that fmstore has no place for.
_UNSUPPORTED = {
    DistributedType.FSDP: (
        "FSDP: the model and optimizer are sharded, and Accelerate turns FSDP on only on "
        "accelerator devices (on CPU it runs MULTI_CPU); save the shards with "
        "fmstore.ShardedCheckpointManager and torch.distributed.checkpoint.state_dict."
        "get_state_dict instead"
    ),
    DistributedType.DEEPSPEED: "DeepSpeed writes its own checkpoint files (engine.save_checkpoint)",
    DistributedType.MEGATRON_LM: "Megatron-LM writes its own checkpoint files",
    DistributedType.XLA: "XLA tensors are not supported; save from a CPU or CUDA run",
}


# ---- where: TIER:ROOT[/step_N] -------------------------------------------------------------


def _where(url: Any, step: int | None) -> tuple[str | None, str, int | None]:
    """``(tier, root, step)`` of a run root (``runs/acc``, ``TIER:runs/acc``), a step of one
    (``TIER:runs/acc/step_6``) or ``fmstore://TIER/runs/acc``.  Anything that is not a
    key on the tiers (an absolute or ``./`` path, an ``s3://`` URL) is refused: the
    checkpoint lives under the run root on every tier of ``fmstore.toml``."""
    if not isinstance(url, str | os.PathLike):
        raise TypeError(f"a run root must be a str or path, not {type(url).__name__}")
    text = os.fspath(url)
    if not isinstance(text, str):
        raise TypeError("a run root must be a str, not bytes")
    m = _FMSTORE_URL.match(text)
    if m:
        text = f"{m.group(1)}:{m.group(2)}"
    tier, rest = split_tier(text)  # an unknown TIER: raises ConfigError naming the tiers
    rest = rest.strip("/") if tier is not None else rest.rstrip("/")
    if tier is None and ("://" in rest or rest.startswith(("/", "~", "."))):
        raise ConfigError(
            f"{text!r}: an Accelerate checkpoint through fmstore is a run root below the "
            "tiers of fmstore.toml ('runs/acc', or 'nvme:runs/acc' to name the tier saves go "
            "to), not a local directory or a URL of its own"
        )
    head, _, name = rest.rpartition("/")
    sm = _STEP.match(name)
    if sm:
        named = int(sm.group(1))
        if step is not None and step != named:
            raise ValueError(f"{text!r} names step {named}, but step={step} was given")
        step, rest = named, head
    if not rest:
        raise ConfigError(f"{text!r}: no run root (give 'TIER:ROOT/step_N' or 'ROOT')")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"a step must be a whole number >= 0, not {step!r}")
    return tier, rest, step


# ---- one session per Accelerator ----------------------------------------------------------


class _Session:
    """The managers (main process) or readers (the others) of one Accelerator's runs."""

    def __init__(self, accelerator: Any) -> None:
        self.main = bool(accelerator.is_main_process)
        self.pg = dist_group() if accelerator.num_processes > 1 else None
        self.managers: dict[tuple[str | None, str], CheckpointManager] = {}
        self.readers: dict[str, TierReader] = {}
        self.lock = threading.Lock()

    def manager(self, tier: str | None, root: str) -> CheckpointManager | None:
        if not self.main:
            return None
        cfg = get_config()
        pol = from_config(cfg)
        if tier == pol.write_tier:
            tier = None  # one manager (and policy helper) per run root
        key = (tier, root)
        if key not in self.managers:
            if tier is not None:
                if tier not in pol.ladder:
                    raise ConfigError(
                        f"tier {tier!r} is not on the [policies] ladder {list(pol.ladder)}: "
                        "saves go to a tier of the ladder, so that policies carry them on"
                    )
                pol = dataclasses.replace(pol, write_tier=tier)
            self.managers[key] = CheckpointManager(root, config=cfg, policies=pol)
            _open.add(self)
        return self.managers[key]

    def reader_manager(self, root: str) -> CheckpointManager | None:
        """The manager a load reads ``root`` through: one already open for it (whatever
        tier it writes to), else the one of the config's write tier."""
        for (_, r), m in self.managers.items():
            if r == root:
                return m
        return self.manager(None, root)

    def reader(self, root: str) -> TierReader:
        if root not in self.readers:
            self.readers[root] = TierReader.of(None, root, {})
        return self.readers[root]

    def close(self) -> None:
        with self.lock:
            managers, self.managers = list(self.managers.values()), {}
            readers, self.readers = list(self.readers.values()), {}
        errors = []
        for m in managers:
            try:
                m.close()
            except Exception as e:
                errors.append(e)
        for r in readers:
            r.close()
        _open.discard(self)
        if errors:
            raise errors[0]


_sessions: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()
_open: set[_Session] = set()


def _session(accelerator: Any) -> _Session:
    s = _sessions.get(accelerator)
    if s is None:
        s = _sessions[accelerator] = _Session(accelerator)
    return s


def _close_all_at_exit() -> None:
    """The last save of a script is committed, and the policy helper stopped, before the
    thread pools the write uses shut down (threading's exit hooks run newest first)."""
    for s in list(_open):
        try:
            s.close()
        except Exception as e:  # the process is ending: say why, go on
            log.error("closing fmstore's checkpoint manager at exit failed: %s", e)


_register_exit = getattr(threading, "_register_atexit", atexit.register)
_register_exit(_close_all_at_exit)


def close(accelerator: Any) -> None:
    """Wait for this Accelerator's saves in flight and close its managers (also done when
    the process exits)."""
    s = _sessions.pop(accelerator, None)
    if s is not None:
        s.close()


# ---- what is saved ------------------------------------------------------------------------


def _check(accelerator: Any) -> None:
    """Refuse what this integration would not save faithfully (every process alike, before
    any collective)."""
    why = _UNSUPPORTED.get(accelerator.distributed_type)
    if why is None and any(_sharded(m) for m in accelerator._models):
        why = _UNSUPPORTED[DistributedType.FSDP]
    if why is not None:
        raise NotSupported(f"fmstore's Accelerate save_state/load_state: {why}")
    pc = accelerator.project_configuration
    if pc.save_on_each_node:
        raise NotSupported(
            "ProjectConfiguration(save_on_each_node=True): fmstore writes one checkpoint "
            "from the main process; other nodes read it from a shared tier once exported"
        )
    if pc.total_limit is not None:
        raise NotSupported(
            f"ProjectConfiguration(total_limit={pc.total_limit}): fmstore keeps checkpoints "
            "by the [policies.retention] rules of fmstore.toml; drop total_limit"
        )
    if accelerator._save_model_state_pre_hook or accelerator._load_model_state_pre_hook:
        raise NotSupported(
            "register_save_state_pre_hook / register_load_state_pre_hook hooks write and read "
            "files of their own in Accelerate's directory, which fmstore does not have; save "
            "what they save with register_for_checkpointing (an object with state_dict)"
        )
    for i, dl in enumerate(accelerator._dataloaders):
        if getattr(dl, "use_stateful_dataloader", False):
            raise NotSupported(
                f"data loader {i} is a torchdata StatefulDataLoader, whose state fmstore "
                "does not save yet"
            )


def _sharded(model: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if type(model).__name__ == "FullyShardedDataParallel":
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def _sampler(dl: Any) -> Any:
    from accelerate.data_loader import SeedableRandomSampler, get_sampler

    try:
        s = get_sampler(dl)
    except AttributeError:
        return None
    return s if isinstance(s, SeedableRandomSampler) else None


def _position(accelerator: Any) -> dict[str, Any]:
    """This process's data position: the gradient-accumulation step, whether the save is
    in the middle of a pass over a data loader, and each prepared data loader's pass
    number (``iteration``), seedable sampler (its seed and epoch) and synchronized
    generator (the one Accelerate broadcasts from the main process at each pass)."""
    gs = accelerator.gradient_state
    loaders = []
    for dl in accelerator._dataloaders:
        s = _sampler(dl)
        gen = getattr(dl, "synchronized_generator", None)
        loaders.append(
            {
                "iteration": int(getattr(dl, "iteration", 0)),
                "sampler": None if s is None else {"seed": int(s.initial_seed), "epoch": s.epoch},
                "generator": None if gen is None else gen.get_state(),
            }
        )
    return {
        "step": int(accelerator.step),
        "mid_pass": int(bool(gs.in_dataloader) and not bool(gs.end_of_dataloader)),
        "dataloaders": loaders,
    }


def _state(accelerator: Any, step: int, ranks: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "step": step,
        "models": [accelerator.get_state_dict(m, unwrap=False) for m in accelerator._models],
        "optimizers": [o.state_dict() for o in accelerator._optimizers],
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "custom": [o.state_dict() for o in accelerator._custom_objects],
        "world_size": len(ranks),
        "ranks": ranks,
        "accelerate": accelerate.__version__,
    }
    if accelerator.scaler is not None:
        out["scaler"] = accelerator.scaler.state_dict()
    return out


def save_state(accelerator: Any, root: Any, step: int | None = None) -> PendingSave | None:
    """Save what ``accelerator.save_state`` saves as the checkpoint ``step`` of run ``root``
    (``runs/acc``, ``nvme:runs/acc`` for the tier saves go to, or ``nvme:runs/acc/step_6``
    naming the step).  Every process calls it at the same point (as Accelerate's own); the
    main process saves, asynchronously (returns once snapshotted, with the save's handle;
    None elsewhere).  A step already saved (by an earlier launch) is not saved again."""
    tier, key, step = _where(root, step)
    if step is None:
        raise TypeError("save_state needs a step: save_state(accelerator, root, step)")
    _check(accelerator)
    s = _session(accelerator)
    record = {"rng": rank_state.rng_state(), "data": _position(accelerator)}
    ranks = rank_state.gather(s.pg, record)  # every process, at the same point
    accelerator.project_configuration.iteration += 1
    mgr = s.manager(tier, key)
    if ranks is None or mgr is None:
        return None
    if step in mgr.steps():
        return None  # a step an earlier launch saved
    return mgr.save(step, _state(accelerator, step, ranks))


# ---- restoring ----------------------------------------------------------------------------


def _fit(saved: Any, objs: list[Any], what: str) -> list[Any]:
    if not isinstance(saved, list):
        raise CorruptData(f"{what}: not a list")
    if len(saved) != len(objs):
        raise FmstoreError(
            f"the checkpoint holds {len(saved)} {what}, this Accelerator has {len(objs)} "
            "prepared / registered: load into the same set of objects as was saved"
        )
    return saved


def _load_position(accelerator: Any, data: Any, where: str) -> bool:
    """Set the data loaders' positions and ``accelerator.step``; whether the save was in
    the middle of a pass."""
    if not (isinstance(data, dict) and isinstance(data.get("step"), int)):
        raise CorruptData(f"{where}: not a data position")
    loaders = _fit(data.get("dataloaders"), accelerator._dataloaders, "data loaders")
    for i, (dl, rec) in enumerate(zip(accelerator._dataloaders, loaders)):
        it = rec.get("iteration") if isinstance(rec, dict) else None
        if not (isinstance(it, int) and it >= 0):
            raise CorruptData(f"{where}.dataloaders[{i}]: no pass number")
        if hasattr(dl, "set_epoch"):
            dl.set_epoch(it)
        s, srec = _sampler(dl), rec.get("sampler")
        if s is not None and srec is not None:
            seed, epoch = (srec.get(k) for k in ("seed", "epoch")) if isinstance(srec, dict) else (None, None)  # fmt: skip
            if not (isinstance(seed, int) and isinstance(epoch, int)):
                raise CorruptData(f"{where}.dataloaders[{i}].sampler: not a seed and an epoch")
            s.initial_seed, s.epoch = seed, epoch
        gen, grec = getattr(dl, "synchronized_generator", None), rec.get("generator")
        if gen is not None and grec is not None:
            gen.set_state(grec)
    accelerator.step = data["step"]
    return bool(data.get("mid_pass"))


def _apply_rng_later(accelerator: Any, rng: Any, where: str) -> None:
    """Set this process's RNG states at the next forward of a prepared model: a save in
    the middle of a pass resumes after the data loader has started its pass again, which
    draws its base seed from torch's RNG (the saved run drew it before the save)."""
    handles: list[Any] = []

    def hook(module: Any, args: Any) -> None:
        for h in handles:
            h.remove()
        handles.clear()
        rank_state.apply_rng(rng, where)

    handles.extend(m.register_forward_pre_hook(hook) for m in accelerator._models)


def load_state(
    accelerator: Any,
    root: Any,
    step: int | None = None,
    *,
    weights_only: bool = True,
    strict: bool = True,
) -> int | None:
    """Restore what :func:`save_state` saved into ``accelerator``'s prepared models,
    optimizers, schedulers, scaler and registered objects, each process's RNG states and
    data position.  ``step``: default (and when ``root`` names none) the newest good step
    of the run on any tier, read from the fastest tier holding a good copy (the manager's
    fallbacks).  Returns the step, None when the run has none (a fresh start).  Every
    process calls it at the same point."""
    _, key, step = _where(root, step)
    _check(accelerator)
    s = _session(accelerator)
    # The tier a URL names is where saves go; a load reads from any tier, fastest first.
    ckpt = restore_on_every_rank(
        s.reader_manager(key), s.pg, lambda: s.reader(key), weights_only, step
    )
    if ckpt is None:
        return None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("step"), int):
        raise CorruptData(f"{key}: not an Accelerate checkpoint of fmstore's")
    # Every count checked before anything is loaded: a mismatch leaves the objects as they were.
    parts = [
        (accelerator._models, _fit(ckpt.get("models"), accelerator._models, "models")),
        (accelerator._optimizers, _fit(ckpt.get("optimizers"), accelerator._optimizers, "optimizers")),
        (accelerator._schedulers, _fit(ckpt.get("schedulers"), accelerator._schedulers, "schedulers")),
        (accelerator._custom_objects, _fit(ckpt.get("custom"), accelerator._custom_objects, "registered objects")),
    ]  # fmt: skip
    for objs, states in parts:
        for o, sd in zip(objs, states):
            if objs is accelerator._models:
                o.load_state_dict(sd, strict=strict)
            else:
                o.load_state_dict(sd)
    if accelerator.scaler is not None and "scaler" in ckpt:
        accelerator.scaler.load_state_dict(ckpt["scaler"])
    _restore_rank(accelerator, ckpt)
    return int(ckpt["step"])


def _restore_rank(accelerator: Any, ckpt: dict[str, Any]) -> None:
    """This process's RNG states and data position, when saved on this world size."""
    rank = accelerator.process_index
    world = accelerator.num_processes
    ranks = ckpt.get("ranks")
    if not isinstance(ranks, dict):
        raise CorruptData("ranks: not a mapping")
    if ckpt.get("world_size") != world or str(rank) not in ranks:
        if accelerator.is_main_process:
            msg = (
                f"step {ckpt['step']} was saved on {ckpt.get('world_size')} process(es) and "
                f"resumes on {world}: no process's RNG states or data position are restored "
                "(each keeps its seeded ones)"
            )
            log.warning("%s", msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return
    rec = ranks[str(rank)]
    where = f"ranks.{rank}"
    if not isinstance(rec, dict):
        raise CorruptData(f"{where}: not a mapping")
    rank_state.apply_rng(rec.get("rng"), f"{where}.rng")  # checked (and set) now
    if _load_position(accelerator, rec.get("data"), f"{where}.data"):
        _apply_rng_later(accelerator, rec.get("rng"), f"{where}.rng")


# ---- Accelerate's own save_state / load_state, given a tier URL ---------------------------


def _fmstore_url(path: Any) -> str | None:
    """``path`` when it is an fmstore location Accelerate would make a local directory of
    (``TIER:…``, ``fmstore://…``, ``s3://…``), else None (a local directory)."""
    if not isinstance(path, str | os.PathLike):
        return None
    text = os.fspath(path)
    if not isinstance(text, str):
        return None
    return text if (decided_by_config(text) or _FMSTORE_URL.match(text)) else None


def attach(accelerator: Any) -> Any:
    """Route ``accelerator.save_state(URL)`` / ``accelerator.load_state(URL)`` through
    fmstore when URL is a tier's (``nvme:runs/acc/step_6``; ``load_state("nvme:runs/acc")``
    restores the newest good step on any tier and returns it); a local directory stays
    Accelerate's own.  Returns ``accelerator``."""
    if getattr(accelerator, "_fmstore_attached", False):
        return accelerator
    own_save, own_load = accelerator.save_state, accelerator.load_state

    def save(output_dir: Any = None, safe_serialization: bool = True, **kw: Any) -> Any:
        url = _fmstore_url(output_dir)
        if url is None:
            return own_save(output_dir, safe_serialization, **kw)
        if kw:
            raise TypeError(f"save_state({url!r}) through fmstore takes no {sorted(kw)}")
        if _where(url, None)[2] is None:
            raise ConfigError(
                f"save_state({url!r}): name the step as the last part of the URL "
                f"('{url.rstrip('/')}/step_N'), so that fmstore can name and tier it"
            )
        save_state(accelerator, url)
        return url

    def load(input_dir: Any = None, load_kwargs: Any = None, **kw: Any) -> Any:
        url = _fmstore_url(input_dir)
        if url is None:
            return own_load(input_dir, load_kwargs, **kw)
        if load_kwargs or kw:
            raise TypeError(f"load_state({url!r}) through fmstore takes no load options")
        got = load_state(accelerator, url)
        if got is None:
            raise NotFound(f"load_state({url!r}): no committed step of the run on any tier")
        return got

    accelerator.save_state, accelerator.load_state = save, load
    accelerator._fmstore_attached = True
    return accelerator
