"""Converting weights between fmstore checkpoints, ``torch.save`` files and safetensors.

The kind of each side is told by its name: ``*.safetensors`` is safetensors, ``*.pt``,
``*.pth``, ``*.bin`` and ``*.ckpt`` are ``torch.save`` files (read with
``weights_only=True``), anything else is an fmstore checkpoint location.  Safetensors holds a
flat mapping of tensors: nested dicts are flattened with dotted names on the way in, and
tensors sharing storage are copied apart (safetensors refuses shared tensors).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from .. import runtime
from ..errors import AlreadyExists, ConfigError
from ..stores import Location, open_store
from .api import load, save

TORCH_EXT = (".pt", ".pth", ".bin", ".ckpt")


def kind_of(location: str) -> str:
    low = location.lower()
    if low.endswith(".safetensors"):
        return "safetensors"
    if low.endswith(TORCH_EXT):
        return "torch"
    return "fmstore"


def read_any(location: str) -> Any:
    kind = kind_of(location)
    if kind == "safetensors":
        from safetensors.torch import load_file

        return load_file(location)
    if kind == "torch":
        return torch.load(location, map_location="cpu", weights_only=True)
    from .dcp.api import is_dcp_checkpoint, load_full_state_dict

    if is_dcp_checkpoint(location):
        # A multi-rank (torch.distributed.checkpoint) checkpoint: gathered whole, on CPU.
        return load_full_state_dict(location)
    return load(location, map_location="cpu")


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


def write_any(
    obj: Any, location: str, *, overwrite: bool = False, compression: str = "auto"
) -> None:
    kind = kind_of(location)
    if kind in ("safetensors", "torch") and os.path.exists(location) and not overwrite:
        raise FileExistsError(f"{location} exists; pass --overwrite to replace it")
    if kind == "safetensors":
        from safetensors.torch import save_file

        flat = flatten_tensors(obj)
        seen: set[int] = set()
        tensors = {}
        for k, t in flat.items():
            ptr = t.untyped_storage().data_ptr()
            tensors[k] = (
                t.detach().clone().contiguous()
                if ptr in seen or not t.is_contiguous()
                else t.detach()
            )
            seen.add(ptr)
        save_file(tensors, location)
        return
    if kind == "torch":
        tmp = location + ".tmp"
        torch.save(obj, tmp)
        os.replace(tmp, location)
        return
    save(obj, location, overwrite=overwrite, compression=compression)


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
) -> int:
    """Copy the weights at ``src`` to ``dst``; returns the number of tensors written.
    ``to="dcp"``: write ``dst`` as a checkpoint of torch's own DCP layout."""
    obj = read_any(src)
    if to is not None:
        if to != "dcp":
            raise ConfigError(f"--to {to!r}: the only format chosen by name is 'dcp'")
        write_native_dcp(obj, dst, overwrite=overwrite)
        return len(flatten_tensors(obj))
    if kind_of(dst) == "safetensors":
        obj = flatten_tensors(obj)
    write_any(obj, dst, overwrite=overwrite, compression=compression)
    return len(flatten_tensors(obj))
