"""Converting weights between fmstore checkpoints, ``torch.save`` files and safetensors.

The kind of each side is told by its name: ``*.safetensors`` is safetensors, ``*.pt``,
``*.pth``, ``*.bin`` and ``*.ckpt`` are ``torch.save`` files (read with
``weights_only=True``), a local directory holding ``model.safetensors`` or
``model.safetensors.index.json`` is a Hugging Face ``save_pretrained`` directory
(:mod:`.hf`), anything else is an fmstore checkpoint location.  Safetensors holds a
flat mapping of tensors: nested dicts are flattened with dotted names on the way in, and
tensors sharing storage are copied apart (safetensors refuses shared tensors).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from .. import runtime
from ..errors import AlreadyExists, ConfigError, CorruptData
from ..stores import Location, open_store
from ..units import parse_size
from .api import load, save
from .hf import is_hf_dir, read_hf_dir, read_safetensors_fd, write_hf_dir
from .loading import LazyDict, select
from .zipguard import open_regular, torch_file

TORCH_EXT = (".pt", ".pth", ".bin", ".ckpt")


def kind_of(location: str) -> str:
    if is_hf_dir(location):
        return "hf"
    low = location.lower()
    if low.endswith(".safetensors"):
        return "safetensors"
    if low.endswith(TORCH_EXT):
        return "torch"
    return "fmstore"


def read_any(location: str, keys: Sequence[str] | None = None) -> Any:
    """What ``location`` holds; ``keys``: only the entries they name (see :func:`select`)."""
    kind = kind_of(location)
    if kind == "fmstore" and keys:
        from .dcp.api import is_dcp_checkpoint

        if not is_dcp_checkpoint(location):
            # Lazily: only the selected tensors are read (the optimizer state stays on disk).
            lazy = load(location, map_location="cpu", lazy=True)
            try:
                return select(lazy, keys, location)
            finally:
                if isinstance(lazy, LazyDict):
                    lazy.close()
    obj = _read_all(location, kind)
    return select(obj, keys, location) if keys else obj


def _read_all(location: str, kind: str) -> Any:
    if kind == "hf":
        return read_hf_dir(location)
    if kind == "safetensors":
        with open_regular(location) as f:
            return read_safetensors_fd(f.fileno(), location)
    if kind == "torch":
        return _read_torch_file(location)
    from .dcp.api import is_dcp_checkpoint, load_full_state_dict

    if is_dcp_checkpoint(location):
        # A multi-rank (torch.distributed.checkpoint) checkpoint: gathered whole, on CPU.
        return load_full_state_dict(location)
    return load(location, map_location="cpu")


def _read_torch_file(location: str) -> Any:
    """A ``torch.save`` file read with ``weights_only=True``, after its zip members were
    checked (:func:`~.zipguard.check_torch_zip`: nothing inflated, nothing read twice, so
    what torch allocates is bounded by the file's size); CorruptData naming the file."""
    with torch_file(location, name=location) as checked:
        try:
            return torch.load(checked, map_location="cpu", weights_only=True)
        except MemoryError:
            raise
        except Exception as e:  # torch's message is a page of advice: keep its first line
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            why = next((ln for ln in lines if "Unpickler error" in ln), lines[0] if lines else "")
            raise CorruptData(
                f"{location} is not a torch.save file fmstore reads with weights_only=True: "
                f"{why[:300] or type(e).__name__}"
            ) from None


def flatten_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of a nested dict/list tree under dotted names; other values are dropped."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def strip_prefix(flat: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """``flat`` with ``prefix`` removed from the names that start with it."""
    out: dict[str, torch.Tensor] = {}
    for k, t in flat.items():
        name = k[len(prefix) :] if k.startswith(prefix) else k
        if not name:
            raise ConfigError(f"--strip-prefix {prefix!r} leaves the name {k!r} empty")
        if name in out:
            raise ConfigError(f"--strip-prefix {prefix!r} gives two tensors the name {name!r}")
        out[name] = t
    return out


def apart(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors sharing no storage (safetensors refuses shared tensors): later
    tensors sharing storage with earlier ones are copied."""
    seen: set[int] = set()
    out = {}
    for k, t in flat.items():
        ptr = t.untyped_storage().data_ptr()
        shared = ptr in seen and t.numel() > 0
        out[k] = t.detach().clone().contiguous() if shared or not t.is_contiguous() else t.detach()
        seen.add(ptr)
    return out


def write_any(
    obj: Any, location: str, *, overwrite: bool = False, compression: str = "auto"
) -> None:
    kind = kind_of(location)
    if kind in ("safetensors", "torch") and os.path.exists(location) and not overwrite:
        raise AlreadyExists(f"{location} exists; pass --overwrite to replace it")
    if kind in ("safetensors", "torch"):
        _make_parent(location)
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file(apart(flatten_tensors(obj)), location, metadata={"format": "pt"})
        return
    if kind == "torch":
        tmp = location + ".tmp"
        torch.save(obj, tmp)
        os.replace(tmp, location)
        return
    try:
        save(obj, location, overwrite=overwrite, compression=compression)
    except AlreadyExists:
        raise AlreadyExists(
            f"a checkpoint exists at {location}; pass --overwrite to replace it"
        ) from None


def _make_parent(location: str) -> None:
    parent = os.path.dirname(os.path.abspath(location))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {parent}: {e.strerror}") from None


def write_native_dcp(obj: Any, location: str, *, overwrite: bool = False) -> None:
    """Write ``obj`` (a dict) as a checkpoint of torch's own layout (``.metadata`` and
    ``.distcp`` files, by torch's ``FileSystemWriter``, one process) at ``location``: a
    local directory directly, any other store through a temporary directory, the
    ``.metadata`` (torch's commit) uploaded last."""
    import torch.distributed.checkpoint as dcp

    from .dcp.native import METADATA_KEY

    if not isinstance(obj, dict):
        raise ConfigError(f"a DCP checkpoint holds a dict, not a {type(obj).__name__}")
    local = Location.parse(location).local_root

    async def existing() -> bool:
        if local is not None and not os.path.isdir(local):
            return False
        store = open_store(location)
        try:
            return any([await store.exists(k) for k in (METADATA_KEY, "manifest.json")])
        finally:
            await store.close()

    if not overwrite and runtime.run(existing()):
        raise AlreadyExists(f"a checkpoint exists at {location}; pass --overwrite to replace it")
    if local is not None:
        os.makedirs(local, exist_ok=True)
        dcp.save(obj, storage_writer=dcp.FileSystemWriter(str(local), overwrite=True), no_dist=True)
        return
    with tempfile.TemporaryDirectory(prefix="fmstore-dcp-") as tmp:
        dcp.save(obj, storage_writer=dcp.FileSystemWriter(tmp, overwrite=True), no_dist=True)

        async def upload() -> None:
            store = open_store(location)
            try:
                names = sorted(os.listdir(tmp), key=lambda n: n == METADATA_KEY)
                for name in names:
                    with open(os.path.join(tmp, name), "rb") as f:
                        await store.put(name, f.read())
            finally:
                await store.close()

        runtime.run(upload())


def convert(
    src: str,
    dst: str,
    *,
    overwrite: bool = False,
    compression: str = "auto",
    to: str | None = None,
    keys: Sequence[str] | None = None,
    strip: str | None = None,
    max_shard_size: str | int | None = None,
    config: str | None = None,
) -> int:
    """Copy the weights at ``src`` to ``dst``; returns the number of tensors written.

    ``to="dcp"``: write ``dst`` as a checkpoint of torch's own DCP layout; ``to="hf"`` (implied
    by ``max_shard_size`` or ``config``, or by ``dst`` being a Hugging Face directory already):
    a ``save_pretrained`` directory of shards of at most ``max_shard_size`` (default 5GB).
    ``keys``: only the entries they name (``["model"]``); ``strip``: a prefix removed from
    the flattened names (``"model."``).
    """
    if to is None and (max_shard_size is not None or config is not None or kind_of(dst) == "hf"):
        to = "hf"
    if to not in (None, "dcp", "hf"):
        raise ConfigError(f"--to {to!r}: the formats chosen by name are 'dcp' and 'hf'")
    if config is not None and to != "hf":
        raise ConfigError("--config is for Hugging Face destinations (--to hf)")
    limit = parse_size(max_shard_size or "5GB", "--max-shard-size")
    obj = read_any(src, keys)
    flat_dst = to == "hf" or (to is None and kind_of(dst) == "safetensors")
    if strip:
        obj = strip_prefix(flatten_tensors(obj), strip)
    elif flat_dst:
        obj = flatten_tensors(obj)
    if to == "hf":
        tensors = apart(obj)
        write_hf_dir(tensors, dst, max_shard_size=limit, overwrite=overwrite, config=config)
        return len(tensors)
    if to == "dcp":
        write_native_dcp(obj, dst, overwrite=overwrite)
        return len(flatten_tensors(obj))
    write_any(obj, dst, overwrite=overwrite, compression=compression)
    return len(flatten_tensors(obj))
