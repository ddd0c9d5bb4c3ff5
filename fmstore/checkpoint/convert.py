"""Converting weights between fmstore checkpoints, ``torch.save`` files and safetensors.

The kind of each side is told by its name (:func:`.sources.kind_of`, the same for
``fmstore.load`` and ``ckpt inspect``); a file on a remote tier is downloaded first and read
like a local one.  Safetensors holds a flat mapping of tensors: nested dicts are flattened
with dotted names on the way in, and tensors sharing storage are copied apart (safetensors
refuses shared tensors).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .. import runtime
from ..errors import AlreadyExists, ConfigError
from ..stores import Location, open_store
from ..units import parse_size
from .api import load, save
from .hf import write_hf_dir
from .loading import LazyDict, select
from .sources import TORCH_EXT, kind_of, read_source, source_file

__all__ = ["TORCH_EXT", "convert", "kind_of", "read_any", "write_any"]


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
    obj = _read_all(location)
    return select(obj, keys, location) if keys else obj


def _read_all(location: str) -> Any:
    f = source_file(location)
    if f is not None:
        with f:
            return read_source(f)
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


#: torch's warning on a save with ``no_dist=True`` (what one process asks for on purpose).
_SINGLE_PROCESS = r"torch\.distributed is disabled, unavailable or uninitialized"


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

    def save(directory: str) -> None:
        # One process by design (no_dist=True): torch still warns that it "assumes" so.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
            dcp.save(
                obj, storage_writer=dcp.FileSystemWriter(directory, overwrite=True), no_dist=True
            )

    if local is not None:
        os.makedirs(local, exist_ok=True)
        save(str(local))
        return
    with tempfile.TemporaryDirectory(prefix="fmstore-dcp-") as tmp:
        save(tmp)

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
