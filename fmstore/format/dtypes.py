"""Stable names for torch dtypes in the manifest (independent of ``str(torch.dtype)``)."""

from __future__ import annotations

import torch

_NAMES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex32": torch.complex32,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
for _name in (
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        _NAMES[_name] = _dt

_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in _NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str | None:
    """The manifest name of ``dtype``, or None when the format does not know it."""
    return _BY_DTYPE.get(dtype)


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype named ``name``; KeyError for names this torch does not have."""
    return _NAMES[name]


def is_floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex
