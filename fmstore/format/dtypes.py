"""Stable names for torch dtypes in the manifest (independent of ``str(torch.dtype)``).

The names and their element sizes are a plain table, so a manifest is checked without
importing torch (the tiering daemon and the CLI read manifests and never build a tensor);
the torch dtypes themselves are looked up on first use.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from ..errors import NotSupported

if TYPE_CHECKING:
    import torch

#: Every dtype name the format knows, with its element size in bytes.
ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


@cache
def _torch_names() -> dict[str, torch.dtype]:
    """The known names this torch has (the newer ones are missing from older releases)."""
    import torch

    out = {}
    for name in ITEMSIZES:
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            out[name] = dt
    return out


@cache
def _by_dtype() -> dict[torch.dtype, str]:
    return {v: k for k, v in _torch_names().items()}


def dtype_itemsize(name: str) -> int:
    """The element size of the dtype named ``name``; KeyError for names the format does
    not know.  Needs no torch."""
    return ITEMSIZES[name]


def dtype_name(dtype: torch.dtype) -> str | None:
    """The manifest name of ``dtype``, or None when the format does not know it."""
    return _by_dtype().get(dtype)


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype named ``name``; KeyError for names the format does not know,
    NotSupported for a known name this torch does not have."""
    dt = _torch_names().get(name)
    if dt is None:
        if name in ITEMSIZES:
            raise NotSupported(f"dtype {name!r} is not in this torch: a newer torch reads it")
        raise KeyError(name)
    return dt
