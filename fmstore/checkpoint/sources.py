"""What a location holds, told once for every reader: ``fmstore.load``, ``ckpt inspect`` and
``ckpt convert``.

The kind is told by the name: ``*.safetensors`` is safetensors, ``*.pt``, ``*.pth``,
``*.bin`` and ``*.ckpt`` are ``torch.save`` files, a local directory holding
``model.safetensors`` or ``model.safetensors.index.json`` is a Hugging Face
``save_pretrained`` directory (:mod:`.hf`), anything else is a checkpoint location (fmstore's
or torch.distributed.checkpoint's).  A local file of any other name is read as a
``torch.save`` file, as ``torch.load`` would.

A file on a remote tier (S3) is downloaded to a temporary file first (at most ``[checkpoint]
private_copy_limit`` bytes, and only when they fit), then read like a local one: through the zip guard (``torch.save`` files) or the header check (safetensors), never
trusted because of where it lies.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from .. import runtime
from ..errors import ConfigError, CorruptData, NotFound
from ..stores import Location, open_store
from .hf import INDEX, SINGLE, is_hf_dir, read_hf_dir, read_safetensors_fd
from .private import check_copy_size
from .zipguard import load_refusal, open_regular, torch_file

TORCH_EXT = (".pt", ".pth", ".bin", ".ckpt")


def kind_of(location: str) -> str:
    """``hf``, ``safetensors``, ``torch`` or ``fmstore`` (a checkpoint location), by name."""
    if is_hf_dir(location):
        return "hf"
    low = location.lower()
    if low.endswith(".safetensors"):
        return "safetensors"
    if low.endswith(TORCH_EXT):
        return "torch"
    return "fmstore"


@dataclass
class SourceFile:
    """A file to read: ``kind`` (``hf``, ``safetensors`` or ``torch``), ``path`` on this
    machine (a temporary copy for a remote object, removed by :meth:`close`) and ``name``,
    the location as given (what errors name)."""

    kind: str
    path: str
    name: str
    tmpdir: str | None = None

    def close(self) -> None:
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def __enter__(self) -> SourceFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def source_file(location: str) -> SourceFile | None:
    """The file at ``location`` to read (downloaded when remote), or None when
    ``location`` is a checkpoint location (a directory or prefix)."""
    kind = kind_of(location)
    if kind == "hf":
        return SourceFile("hf", location, location)
    local = Location.parse(location).local_root
    if local is not None:
        if os.path.isfile(local):
            return SourceFile("safetensors" if kind == "safetensors" else "torch", local, location)
        return None
    if kind == "fmstore":
        return None
    tmpdir = tempfile.mkdtemp(prefix="fmstore-src-")
    path = os.path.join(tmpdir, "file")
    try:
        if not runtime.run(_download(location, path)):
            shutil.rmtree(tmpdir, ignore_errors=True)
            return None  # no object of that name: a checkpoint prefix named like a file
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return SourceFile(kind, path, location, tmpdir)


def _split(location: str) -> tuple[str, str]:
    """``s3://b/models/x.pt`` → (``s3://b/models``, ``x.pt``); ``s3:x.pt`` → (``s3:``, ``x.pt``)."""
    head, sep, name = location.rstrip("/").rpartition("/")
    if sep and not head.endswith((":", "/")):
        return head, name
    tier, colon, name = location.partition(":")
    if colon and "/" not in name:
        return tier + ":", name
    raise ConfigError(f"{location}: not the location of a file")


async def _download(location: str, path: str) -> bool:
    """Copy the object at ``location`` to ``path`` (a new local file), one version of it;
    False when there is no such object."""
    head, name = _split(location)
    store = open_store(head)
    try:
        try:
            meta = await store.stat(name)
        except NotFound:
            return False
        check_copy_size(
            meta.size,
            location,
            os.path.dirname(path),
            "is downloaded",
            "copy it to a local file yourself (fmstore cp) and load that",
        )
        out = await runtime.to_io(open, path, "xb")
        written = 0

        async def write(piece: memoryview) -> None:
            nonlocal written
            written += len(piece)
            if written > meta.size:  # never more than the size checked above
                raise CorruptData(
                    f"{location}: more than the {meta.size} bytes its size says", tier=store.tier
                )
            await runtime.to_io(out.write, piece)

        try:
            await store.read_to(name, 0, meta.size, write, etag=meta.etag)
        finally:
            await runtime.to_io(out.close)
        got = os.path.getsize(path)
        if got != meta.size:
            raise CorruptData(f"{location}: read {got} bytes of {meta.size}", tier=store.tier)
        return True
    finally:
        await store.close()


def read_source(f: SourceFile) -> Any:
    """What ``f`` holds, on the CPU: ``torch.save`` files with ``weights_only=True`` after
    the zip guard; safetensors and Hugging Face directories as a flat dict of tensors."""
    if f.kind == "hf":
        return read_hf_dir(f.path)
    if f.kind == "safetensors":
        with open_regular(f.path, name=f.name) as fh:
            return read_safetensors_fd(fh.fileno(), f.name)
    # one open, no symbolic link followed: the guard checks the bytes torch then reads
    with torch_file(f.path, name=f.name) as checked:
        try:
            return torch.load(checked, map_location="cpu", weights_only=True, mmap=True)
        except MemoryError:
            raise
        except Exception as e:
            raise CorruptData(
                f"{f.name} is not a torch.save file fmstore reads with weights_only=True: "
                f"{load_refusal(e, 300)}"
            ) from None


#: Names of a Hugging Face ``save_pretrained`` directory, to say what a remote one needs.
HF_NAMES = (SINGLE, INDEX)
