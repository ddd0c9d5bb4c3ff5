"""Checking a checkpoint's encoded state tree (``docs/format.md``, "The tree") before it is
decoded: only known node tags, tensor references in range, hashable dict keys, bounded
nesting.  Iterative, so hostile nesting cannot exhaust the stack."""

from __future__ import annotations

from typing import Any

from ..errors import short_repr
from .bounds import MAX_DEPTH, is_int
from .dtypes import dtype_itemsize

#: Tags of the state tree's nodes (docs/format.md) that hold one value of a JSON type.
_SCALAR_TAGS: dict[str, type] = {"dtype": str, "device": str, "bytes": str, "np": str}
_FLOATS = ("nan", "inf", "-inf")


def tree_problem(tree: Any, ntensors: int) -> str | None:
    """Why an encoded state tree is malformed (None: well-formed): unknown tags, tensor
    references out of range, unhashable dict keys, nesting deeper than ``MAX_DEPTH``.
    Iterative, so hostile nesting cannot exhaust the stack."""
    stack: list[tuple[Any, str, int, bool]] = [(tree, "tree", 0, False)]
    while stack:
        n, path, depth, in_key = stack.pop()
        if depth > MAX_DEPTH:
            return f"{path}: nested deeper than {MAX_DEPTH} levels"
        if n is None or isinstance(n, (bool, int, str)):
            continue
        if isinstance(n, float):
            continue
        if not isinstance(n, dict):
            return f"{path}: {type(n).__name__} is not a tree node"
        for tag in ("tensor", "pickle"):
            if tag in n:
                if in_key:
                    return f"{path}: a dict key refers to a tensor"
                if not is_int(n[tag]) or not 0 <= n[tag] < ntensors:
                    return f"{path}.{tag}: {short_repr(n[tag], 40)} is not a tensor index (0..{ntensors - 1})"
                break
        else:
            why = _node_children(n, path, depth, in_key, stack)
            if why:
                return why
    return None


def _node_children(
    n: dict[str, Any], path: str, depth: int, in_key: bool, stack: list[tuple[Any, str, int, bool]]
) -> str | None:
    for tag in ("dict", "odict"):
        if tag in n:
            if in_key:
                return f"{path}: a dict key is a dict"
            items = n[tag]
            if not isinstance(items, list):
                return f"{path}.{tag}: not a list"
            for i, kv in enumerate(items):
                if not isinstance(kv, list) or len(kv) != 2:
                    return f"{path}.{tag}[{i}]: not a [key, value] pair"
                stack.append((kv[0], f"{path}.{tag}[{i}].key", depth + 1, True))
                stack.append((kv[1], f"{path}.{tag}[{i}]", depth + 1, False))
            if "meta" in n:
                stack.append((n["meta"], f"{path}.meta", depth + 1, False))
            return None
    for tag in ("list", "tuple", "size", "complex"):
        if tag in n:
            items = n[tag]
            if not isinstance(items, list):
                return f"{path}.{tag}: not a list"
            if tag == "size" and not all(is_int(x) and x >= 0 for x in items):
                return f"{path}.size: not a list of non-negative ints"
            if tag == "complex" and len(items) != 2:
                return f"{path}.complex: not [re, im]"
            for i, v in enumerate(items):
                stack.append((v, f"{path}.{tag}[{i}]", depth + 1, in_key))
            return None
    if "float" in n:
        return None if n["float"] in _FLOATS else f"{path}.float: {short_repr(n['float'], 40)}"
    for tag, typ in _SCALAR_TAGS.items():
        if tag in n:
            if not isinstance(n[tag], typ):
                return f"{path}.{tag}: not a {typ.__name__}"
            if tag == "dtype":
                try:
                    dtype_itemsize(n[tag])
                except KeyError:
                    return f"{path}.dtype: unknown dtype {short_repr(n[tag], 40)}"
            if tag == "np":
                if n[tag].lstrip("<>=|")[:1] not in ("b", "i", "u", "f", "c"):
                    return f"{path}.np: {short_repr(n[tag], 40)} is not a numeric numpy dtype"
                stack.append((n.get("v"), f"{path}.v", depth + 1, in_key))
            return None
    return f"{path}: unknown tree node with keys {sorted(n)[:5]!r}"
