"""The state tree <-> JSON with type tags, tensors replaced by references.

Encoded node forms (see ``docs/format.md``)::

    null, true/false, 12, 1.5, "text"            None, bool, int, finite float, str
    {"float": "nan" | "inf" | "-inf"}            non-finite float
    {"dict": [[k, v], ...]}                      dict (keys are nodes: int keys survive)
    {"odict": [[k, v], ...], "meta": node?}      OrderedDict (+ its ``_metadata``, as state_dict has)
    {"list": [...]}, {"tuple": [...]}
    {"tensor": i}                                 tensor i of the manifest (numpy arrays too)
    {"size": [...]}, {"dtype": "bfloat16"}, {"device": "cuda:0"}
    {"bytes": "<base64>"}, {"complex": [re, im]}, {"np": "float64", "v": node}
    {"pickle": i}                                 pickled object in tensor i (opt-in only)

Nothing else is accepted without ``pickle=True``: the error names the path of the offending
value, e.g. ``state['optim']['param_groups'][0]['foo']``.
"""

from __future__ import annotations

import base64
import binascii
import math
import pickle
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CorruptData, FmstoreError, describe_error
from ..format.dtypes import dtype_from_name, dtype_name


class UnsupportedValue(TypeError):
    """A value the default (no pickle) format cannot hold; the message names its path."""


class LazyMapping(dict[Any, Any]):
    """A dict whose values are built on access (a lazily loaded state, :class:`LazyDict`).

    It is saved as the plain mapping it stands for: :meth:`materialize` loads what is not
    loaded yet (in one batch of reads) and returns plain dicts over the same tensors, so a
    save holds the state once, not twice."""

    __slots__ = ()

    def materialize(self) -> Any:
        raise NotImplementedError


@dataclass
class Leaf:
    """A tensor found in the tree: its dotted name and where it came from."""

    name: str
    tensor: torch.Tensor
    numpy: bool = False
    pickled: bool = False


@dataclass
class Encoded:
    tree: Any
    leaves: list[Leaf] = field(default_factory=list)

    @property
    def pickled(self) -> bool:
        return any(leaf.pickled for leaf in self.leaves)


def _fmt_path(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


def _name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def encode_tree(obj: Any, *, allow_pickle: bool = False) -> Encoded:
    """Encode ``obj``; tensors become ``{"tensor": i}`` referring to ``Encoded.leaves[i]``."""
    enc = Encoded(tree=None)
    seen: set[int] = set()

    def leaf(
        path: tuple[Any, ...], t: torch.Tensor, *, numpy: bool = False, pickled: bool = False
    ) -> dict[str, Any]:
        enc.leaves.append(Leaf(_name(path), t, numpy=numpy, pickled=pickled))
        return {"pickle" if pickled else "tensor": len(enc.leaves) - 1}

    def fallback(path: tuple[Any, ...], x: Any, why: str) -> Any:
        if type(x).__module__.split(".")[0] == "fmstore":
            # fmstore's own objects (a SaveHandle, a Manifest, a manager) are never state:
            # pickling them would not help, so the advice is to pass the state itself.
            raise UnsupportedValue(
                f"{_fmt_path(path)} is {why}, an fmstore object, not part of a state: pass "
                "the state it stands for (tensors, dicts, lists, numbers) instead"
            )
        if not allow_pickle:
            raise UnsupportedValue(
                f"{_fmt_path(path)} is {why}, which fmstore stores without pickle only for tensors, "
                "numbers, strings, bytes, None, lists, tuples, dicts, torch.Size/dtype/device and "
                "numpy arrays; pass pickle=True to save(), and weights_only=False to load()"
            )
        try:
            data = pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise UnsupportedValue(f"{_fmt_path(path)} cannot be pickled: {e}") from None
        return leaf(path, torch.frombuffer(bytearray(data), dtype=torch.uint8), pickled=True)

    def enc_float(x: float) -> Any:
        if math.isfinite(x):
            return x
        return {"float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}

    def walk(x: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(x, LazyMapping):
            x = x.materialize()
        t = type(x)
        if x is None or t is bool or t is int or t is str:
            return x
        if t is float:
            return enc_float(x)
        if isinstance(x, torch.Tensor):
            if t not in (torch.Tensor, torch.nn.Parameter):
                return fallback(path, x, f"a tensor subclass ({t.__name__})")
            why = _tensor_problem(x)
            if why:
                return fallback(path, x, why)
            return leaf(path, x)
        if isinstance(x, np.ndarray):
            if t is not np.ndarray or x.dtype.kind not in "biufc" or x.dtype.byteorder == ">":
                return fallback(path, x, f"a numpy array of dtype {x.dtype}")
            try:
                tt = torch.from_numpy(x)
            except (TypeError, ValueError):
                return fallback(path, x, f"a numpy array of dtype {x.dtype}")
            return leaf(path, tt, numpy=True)
        if isinstance(x, np.generic) and x.dtype.kind in "biufc":
            return {"np": x.dtype.str, "v": walk(x.item(), path)}
        if t is torch.Size:
            return {"size": [int(s) for s in x]}
        if t is torch.dtype:
            name = dtype_name(x)
            return {"dtype": name} if name else fallback(path, x, f"dtype {x}")
        if t is torch.device:
            return {"device": str(x)}
        if t is bytes or t is bytearray:
            return {"bytes": base64.b64encode(bytes(x)).decode("ascii")}
        if t is complex:
            return {"complex": [enc_float(x.real), enc_float(x.imag)]}
        if t is dict or t is OrderedDict:
            if id(x) in seen:
                return fallback(path, x, "a container that contains itself")
            seen.add(id(x))
            items = [
                [
                    walk(k, (*path, k))
                    if _plain_key(k)
                    else fallback(path, k, f"a dict key of type {type(k).__name__}"),
                    walk(v, (*path, k)),
                ]
                for k, v in x.items()
            ]
            seen.discard(id(x))
            if t is dict:
                return {"dict": items}
            node: dict[str, Any] = {"odict": items}
            meta = getattr(x, "_metadata", None)
            if meta is not None:
                node["meta"] = walk(meta, (*path, "_metadata"))
            return node
        if t is list or t is tuple:
            if id(x) in seen:
                return fallback(path, x, "a container that contains itself")
            seen.add(id(x))
            items = [walk(v, (*path, i)) for i, v in enumerate(x)]
            seen.discard(id(x))
            return {"list" if t is list else "tuple": items}
        return fallback(path, x, f"a {t.__module__}.{t.__qualname__}")

    enc.tree = walk(obj, ())
    return enc


def _plain_key(k: Any) -> bool:
    return k is None or type(k) in (str, int, bool, float, tuple, bytes)


def _tensor_problem(t: torch.Tensor) -> str | None:
    if t.layout != torch.strided:
        return f"a tensor with layout {t.layout}"
    if t.is_quantized:
        return "a quantized tensor"
    if t.device.type == "meta":
        return "a meta tensor (it has no data)"
    if dtype_name(t.dtype) is None:
        return f"a tensor of dtype {t.dtype}"
    return None


def decode_tree(
    node: Any,
    tensor: Callable[[int], Any],
    pickled: Callable[[int], Any] | None = None,
) -> Any:
    """Rebuild the object; ``tensor(i)`` returns tensor i, ``pickled(i)`` unpickles leaf i.

    A node that does not decode raises :class:`CorruptData` (manifests are checked by
    :func:`fmstore.format.manifest.tree_problem` first; this is the last line).
    """

    def walk(n: Any) -> Any:
        if n is None or isinstance(n, (bool, int, float, str)):
            return n
        if isinstance(n, dict):
            if "tensor" in n:
                return tensor(n["tensor"])
            if "dict" in n:
                return {_hashable(walk(k)): walk(v) for k, v in n["dict"]}
            if "odict" in n:
                od: OrderedDict[Any, Any] = OrderedDict(
                    (_hashable(walk(k)), walk(v)) for k, v in n["odict"]
                )
                if "meta" in n:
                    od._metadata = walk(n["meta"])  # type: ignore[attr-defined]
                return od
            if "list" in n:
                return [walk(v) for v in n["list"]]
            if "tuple" in n:
                return tuple(walk(v) for v in n["tuple"])
            if "float" in n:
                return float(n["float"])
            if "size" in n:
                return torch.Size(n["size"])
            if "dtype" in n:
                return dtype_from_name(n["dtype"])
            if "device" in n:
                return torch.device(n["device"])
            if "bytes" in n:
                return base64.b64decode(n["bytes"])
            if "complex" in n:
                return complex(walk(n["complex"][0]), walk(n["complex"][1]))
            if "np" in n:
                return np.dtype(n["np"]).type(walk(n["v"]))
            if "pickle" in n:
                if pickled is None:
                    raise ValueError("pickled leaf without an unpickler")
                return pickled(n["pickle"])
        raise ValueError(f"unknown tree node {str(n)[:80]!r}")

    try:
        return walk(node)
    except FmstoreError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, binascii.Error) as e:
        # RecursionError is a RuntimeError; torch.device raises RuntimeError on bad names.
        raise CorruptData(f"checkpoint state tree does not decode: {describe_error(e)}") from None


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k
