"""Each rank's RNG states and data position, kept in a checkpoint that one rank writes.

Under DDP one rank saves for all, but every rank has RNGs of its own (dropout, its
DataLoader's base seed): :func:`gather` brings every rank's :func:`capture` to rank 0 over
the checkpoint group (JSON over tensors, bounded, never a pickle), where they become plain
checkpoint values (tensors, ints, floats, strings) under the rank's number.  A restore
validates what it reads (the checkpoint is outside input) before setting any RNG.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from ..errors import CorruptData, FmstoreError

__all__ = ["apply_rng", "capture", "gather", "rng_state"]

#: Largest message one rank sends (its RNG states are about 12 KB; CUDA adds 16 B a device).
_LIMIT = 256 << 10
_MT_WORDS = 624


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch CPU (and CUDA, per device) RNG states, as
    checkpoint values that load with ``weights_only``."""
    version, words, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": {
            "version": int(version),
            "state": torch.tensor(words, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "kind": str(kind),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def capture(data: dict[str, int]) -> dict[str, Any]:
    """This rank's record: its RNG states and its data position (``data``: ints)."""
    return {"rng": rng_state(), "data": dict(data)}


# ---- over the wire: tensors as base64 of their bytes -----------------------------------

_WIRE_DTYPES = {"int64": torch.int64, "uint8": torch.uint8}


def _to_wire(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        dt = str(v.dtype).removeprefix("torch.")
        raw = v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        return {"tensor": dt, "b64": base64.b64encode(raw).decode()}
    if isinstance(v, dict):
        return {k: _to_wire(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_to_wire(x) for x in v]
    return v


def _from_wire(v: Any, like: Any, where: str) -> Any:
    """``v`` as received, shaped like this rank's own ``like`` (same keys, dtypes and sizes:
    any other shape is refused, before anything is allocated for it)."""
    if isinstance(like, torch.Tensor):
        dt = str(like.dtype).removeprefix("torch.")
        if not (isinstance(v, dict) and v.get("tensor") == dt and isinstance(v.get("b64"), str)):
            raise FmstoreError(f"{where}: not a {dt} tensor")
        raw = base64.b64decode(v["b64"], validate=True)
        if len(raw) != like.numel() * like.element_size():
            raise FmstoreError(f"{where}: {len(raw)} bytes, expected {like.nbytes}")
        return torch.frombuffer(bytearray(raw), dtype=_WIRE_DTYPES[dt]).clone()
    if isinstance(like, dict):
        if not isinstance(v, dict) or set(v) != set(like):
            raise FmstoreError(f"{where}: keys differ from this rank's")
        return {k: _from_wire(v[k], like[k], f"{where}.{k}") for k in like}
    if isinstance(like, list):
        if not isinstance(v, list) or len(v) != len(like):
            raise FmstoreError(f"{where}: not a list of {len(like)}")
        return [_from_wire(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(v, like))]
    if like is None or isinstance(like, float):
        if not (v is None or isinstance(v, int | float)):
            raise FmstoreError(f"{where}: not a number")
        return v
    if type(v) is not type(like):
        raise FmstoreError(f"{where}: not a {type(like).__name__}")
    return v


def gather(pg: Any, record: dict[str, Any]) -> dict[str, Any] | None:
    """Every rank's ``record`` (:func:`capture`) on rank 0, keyed by rank number as a string
    (None on the other ranks).  A collective of ``pg``: every rank calls it at the same
    point.  Without ``pg`` (one process) this process's record as rank 0's."""
    if pg is None:
        return {"0": record}
    import torch.distributed as dist

    from ..protocol.wire import gather_json_to

    got = gather_json_to(pg, 0, _to_wire(record), limit=_LIMIT)
    if got is None:
        return None
    ranks = dist.get_process_group_ranks(pg)
    return {str(r): _from_wire(g, record, f"rank {r}'s state") for r, g in zip(ranks, got)}


# ---- restoring ---------------------------------------------------------------------------


def _ints(t: Any, n: int, top: int, where: str) -> list[int]:
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.shape == (n,)):
        raise CorruptData(f"{where}: not {n} int64 values")
    vals = t.tolist()
    if any(not 0 <= x < top for x in vals):
        raise CorruptData(f"{where}: a value out of range")
    return vals


def _num(v: Any, where: str, none: bool = False) -> Any:
    if (v is None and none) or (isinstance(v, int | float) and not isinstance(v, bool)):
        return v
    raise CorruptData(f"{where}: not a number")


def apply_rng(rng: Any, where: str = "rng") -> None:
    """Set this process's RNGs from ``rng`` (:func:`rng_state`'s layout, or the older one
    of a single-process checkpoint: ``random.getstate()``, ``np.random.get_state()``, a
    torch state), after checking every part; a part that does not fit raises
    :class:`~fmstore.errors.CorruptData` before any RNG is set."""
    if not isinstance(rng, dict):
        raise CorruptData(f"{where}: not a mapping")
    py, npy, cpu = rng.get("python"), rng.get("numpy"), rng.get("torch")
    if isinstance(py, dict):
        words = _ints(py.get("state"), _MT_WORDS + 1, 1 << 32, f"{where}.python.state")
        py_state: Any = (
            _num(py.get("version"), where),
            tuple(words),
            _num(py.get("gauss"), where, True),
        )
    else:
        py_state = py  # the older layout: random.getstate() as saved
    if isinstance(npy, dict):
        if npy.get("kind") != "MT19937":
            raise CorruptData(f"{where}.numpy.kind: not 'MT19937'")
        key = _ints(npy.get("key"), _MT_WORDS, 1 << 32, f"{where}.numpy.key")
        np_state: Any = (
            "MT19937",
            np.asarray(key, dtype=np.uint32),
            _num(npy.get("pos"), where),
            _num(npy.get("has_gauss"), where),
            _num(npy.get("gauss"), where),
        )
    else:
        np_state = npy
    if not (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8):
        raise CorruptData(f"{where}.torch: not a uint8 tensor")
    cuda = rng.get("cuda")
    if cuda is not None and not (
        isinstance(cuda, list)
        and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda)
    ):
        raise CorruptData(f"{where}.cuda: not a list of uint8 tensors")
    before = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    except (TypeError, ValueError, RuntimeError) as e:
        random.setstate(before[0])
        np.random.set_state(before[1])
        torch.set_rng_state(before[2])
        raise CorruptData(f"{where}: {e}"[:300]) from None
