"""Hugging Face ``save_pretrained`` directories: weights in ``model.safetensors``, or in
shards ``model-00001-of-0000N.safetensors`` named by ``model.safetensors.index.json``.

Reading one is reading hostile input: the index is bounded in size and strictly shaped, every
file it names must be a plain name in the same directory (no ``..``, no ``/``, no symbolic
link), each shard's header size is checked against the file before safetensors parses it,
and safetensors' own checks (offsets, dtypes, shapes against the data) do the rest; every
failure is one :class:`CorruptData` naming the file.

Writing one writes only the weights: shards of at most ``max_shard_size`` bytes (a tensor
bigger than that gets a shard of its own), the index when there is more than one shard, and
optionally a ``config.json`` copied from the caller.  Each file is written under a temporary
name and renamed; the index (or the single file) comes last.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

import torch

from ..errors import AlreadyExists, ConfigError, CorruptData, NotFound, NotSupported
from ..stores import Location
from ..stores.bounded import decode_json

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: The index of a model with tens of thousands of tensors is a few MiB.
MAX_INDEX_BYTES = 64 << 20
#: safetensors itself refuses headers over 100 MB.
MAX_HEADER_BYTES = 100_000_000
MAX_CONFIG_BYTES = 16 << 20


def local_dir(location: str) -> str | None:
    """The local directory ``location`` names, or None for a remote location."""
    try:
        root = Location.parse(location).local_root
    except Exception:
        return None
    return None if root is None else str(root)


def is_hf_dir(location: str) -> bool:
    """Whether ``location`` is a local directory holding a ``save_pretrained`` layout
    (and not an fmstore checkpoint)."""
    d = local_dir(location)
    if d is None or not os.path.isdir(d) or os.path.exists(os.path.join(d, "manifest.json")):
        return False
    return any(os.path.lexists(os.path.join(d, n)) for n in (SINGLE, INDEX))


def _open_in(dirfd: int, name: str, where: str) -> int:
    """A descriptor of the regular file ``name`` directly inside ``dirfd``; links refused."""
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or any(ord(c) < 32 for c in name)
    ):
        raise CorruptData(f"{where}: {name!r} is not a plain file name in the same directory")
    try:
        # O_NONBLOCK: a FIFO would make the open wait for a writer; refused below.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except FileNotFoundError:
        raise NotFound(f"{where}: {name} does not exist") from None
    except OSError as e:
        raise CorruptData(
            f"{where}: {name} cannot be opened ({e.strerror}; links are refused)"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptData(f"{where}: {name} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def _read_bounded(fd: int, limit: int, where: str) -> bytes:
    size = os.fstat(fd).st_size
    if size > limit:
        raise CorruptData(f"{where} is {size} bytes, more than the {limit} allowed")
    data = os.read(fd, limit + 1)
    if len(data) > limit:
        raise CorruptData(f"{where} is more than the {limit} bytes allowed")
    return data


def read_index(dirfd: int, where: str) -> dict[str, str]:
    """``weight_map`` of the index: tensor name -> shard file name, validated."""
    fd = _open_in(dirfd, INDEX, where)
    try:
        data = _read_bounded(fd, MAX_INDEX_BYTES, f"{where}/{INDEX}")
    finally:
        os.close(fd)
    try:
        doc = decode_json(data)
    except ValueError as e:  # decode_json's own: short, never quoting the input
        raise CorruptData(f"{where}/{INDEX} is not valid JSON: {e}") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise CorruptData(f"{where}/{INDEX}: 'weight_map' must be a non-empty object")
    for k, v in wm.items():
        if not isinstance(v, str):
            raise CorruptData(f"{where}/{INDEX}: weight_map[{k[:100]!r}] is not a file name")
        if v in ("", ".", "..") or "/" in v or "\\" in v or "\0" in v:
            raise CorruptData(
                f"{where}/{INDEX}: weight_map[{k[:100]!r}] = {v[:100]!r} is not a plain file name "
                "in the same directory"
            )
    return dict(wm)


def _read_shard(dirfd: int, name: str, where: str) -> dict[str, torch.Tensor]:
    fd = _open_in(dirfd, name, where)
    try:
        return read_safetensors_fd(fd, f"{where}/{name}")
    finally:
        os.close(fd)


def read_safetensors_fd(fd: int, where: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file open at ``fd`` (a regular file), its header
    size checked against the file before safetensors parses it (and maps it): a private
    copy of it when someone else could rewrite it (:func:`.private.stable_fd`);
    CorruptData naming ``where`` when it does not parse."""
    from .private import stable_fd

    with stable_fd(fd, where) as own:
        return _read_safetensors(own, where)


def _read_safetensors(fd: int, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise CorruptData(f"{where}: {size} bytes, too short for a safetensors file")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CorruptData(
            f"{where}: header declares {n} bytes; the file holds {size} "
            f"(at most {MAX_HEADER_BYTES} allowed)"
        )
    # Opened through this descriptor, so the file checked is the file read.
    path = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else where
    try:
        out: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt") as f:  # type: ignore[no-untyped-call]
            for k in f.keys():
                out[k] = f.get_tensor(k)
        return out
    except (SafetensorError, ValueError, OSError, RuntimeError) as e:
        why = " ".join(str(e).split())[:300]
        raise CorruptData(f"{where} is not a valid safetensors file: {why}") from None


def read_hf_dir(location: str) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` directory, by its name."""
    d = local_dir(location)
    if d is None:
        raise NotSupported(f"{location}: Hugging Face directories are read from local paths only")
    dirfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.stat(INDEX, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return _read_shard(dirfd, SINGLE, d)
        wm = read_index(dirfd, d)
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(wm.values())):
            for k, t in _read_shard(dirfd, shard, d).items():
                if wm.get(k) != shard:
                    raise CorruptData(
                        f"{d}/{shard} holds {k[:100]!r}, which {INDEX} places in "
                        f"{str(wm.get(k))[:100]!r}"
                    )
                out[k] = t
        missing = [k for k in wm if k not in out]
        if missing:
            raise CorruptData(
                f"{d}/{INDEX} names {len(missing)} tensors its shards lack, like {missing[0]!r}"
            )
        return {k: out[k] for k in wm}
    finally:
        os.close(dirfd)


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and used + n > limit:
            shards.append({})
            used = 0
        shards[-1][k] = t
        used += n
    return shards


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _ours(name: str) -> bool:
    return name in (SINGLE, INDEX) or bool(SHARD_RE.fullmatch(name))


def write_hf_dir(
    tensors: dict[str, torch.Tensor],
    location: str,
    *,
    max_shard_size: int,
    overwrite: bool = False,
    config: str | None = None,
) -> int:
    """Write ``tensors`` (flat, contiguous, sharing no storage) as a ``save_pretrained``
    directory at ``location``; returns the number of shards."""
    from safetensors.torch import save_file

    d = local_dir(location)
    if d is None:
        raise NotSupported(f"{location}: Hugging Face directories are written to local paths only")
    if not tensors:
        raise ConfigError(f"nothing to write to {location}: no tensors selected")
    if os.path.lexists(d) and not os.path.isdir(d):
        raise AlreadyExists(f"{d} exists and is not a directory")
    old = [n for n in os.listdir(d) if _ours(n)] if os.path.isdir(d) else []
    if os.path.exists(os.path.join(d, "manifest.json")):
        old.append("manifest.json")
    if old and not overwrite:
        raise AlreadyExists(f"{d} already holds {old[0]}; pass --overwrite to replace it")
    if old and "manifest.json" in old:
        raise AlreadyExists(f"{d} is an fmstore checkpoint; write the Hugging Face copy elsewhere")
    cfg = None
    if config is not None:
        try:
            with open(config, "rb") as f:
                cfg = f.read(MAX_CONFIG_BYTES + 1)
            if len(cfg) > MAX_CONFIG_BYTES or not isinstance(json.loads(cfg), dict):
                raise ValueError("not a JSON object of a sensible size")
        except OSError as e:
            raise ConfigError(f"--config {config}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"--config {config}: {e}") from None
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {d}: {e.strerror}") from None
    for n in old:
        os.unlink(os.path.join(d, n))
    shards = _shards(tensors, max_shard_size)
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )

    def put(name: str, write: Any) -> None:  # under a temporary name, then renamed
        tmp = os.path.join(d, f".{name}.tmp")
        write(tmp)
        os.replace(tmp, os.path.join(d, name))

    if cfg is not None:
        put("config.json", lambda p: _write_bytes(p, cfg))
    for name, shard in zip(names, shards, strict=True):
        put(name, lambda p, s=shard: save_file(s, p, metadata={"format": "pt"}))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: n for n, s in zip(names, shards, strict=True) for k in sorted(s)},
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        put(INDEX, lambda p: _write_bytes(p, text.encode()))
    return len(shards)
