"""Partial loads: prune an encoded tree to the entries named by ``keys`` (names or globs).

An entry's name is its path with ``.`` between parts (``model.layers.0.weight``,
``optim.state.3.exp_avg``).  A pattern selects every entry whose name matches it
(``fnmatch`` rules, ``*`` also crosses dots) and whole sub-trees by their name (``model``).
Dicts are pruned to the selected keys; a list or tuple is kept whole when anything in it is
selected (positions carry meaning).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from typing import Any

_DROP = object()


def part_name(k: Any) -> str:
    if isinstance(k, (str, int, float, bool)) or k is None:
        return str(k)
    return json.dumps(k, separators=(",", ":"))


def prune(tree: Any, patterns: Sequence[str]) -> tuple[Any, set[str]]:
    """``(pruned tree or None, patterns that matched something)``."""
    matched: set[str] = set()

    def hit(name: str) -> bool:
        ok = False
        for p in patterns:
            if name == p or fnmatch.fnmatchcase(name, p):
                matched.add(p)
                ok = True
        return ok

    def walk(n: Any, path: tuple[str, ...]) -> Any:
        if path and hit(".".join(path)):
            return n
        if isinstance(n, dict) and ("dict" in n or "odict" in n):
            tag = "dict" if "dict" in n else "odict"
            items = []
            for k, v in n[tag]:
                r = walk(v, (*path, part_name(k)))
                if r is not _DROP:
                    items.append([k, r])
            if not items:
                return _DROP
            out = {tag: items}
            if "meta" in n:
                out["meta"] = n["meta"]
            return out
        if isinstance(n, dict) and ("list" in n or "tuple" in n):
            tag = "list" if "list" in n else "tuple"
            keep = False
            for i, v in enumerate(n[tag]):
                if walk(v, (*path, str(i))) is not _DROP:
                    keep = True
            return n if keep else _DROP
        return _DROP

    r = walk(tree, ())
    return (None if r is _DROP else r), matched


def tensor_indices(node: Any) -> list[int]:
    """Indices of the tensors (and pickled leaves) an encoded sub-tree refers to."""
    out: list[int] = []

    def walk(n: Any) -> None:
        if isinstance(n, dict):
            if "tensor" in n:
                out.append(int(n["tensor"]))
            elif "pickle" in n:
                out.append(int(n["pickle"]))
            else:
                for tag in ("dict", "odict"):
                    for _k, v in n.get(tag, ()):
                        walk(v)
                for tag in ("list", "tuple"):
                    for v in n.get(tag, ()):
                        walk(v)
        # scalars hold no tensors

    walk(node)
    return out


def has_pickle(node: Any) -> bool:
    if isinstance(node, dict):
        if "pickle" in node:
            return True
        for tag in ("dict", "odict"):
            for _k, v in node.get(tag, ()):
                if has_pickle(v):
                    return True
        for tag in ("list", "tuple"):
            for v in node.get(tag, ()):
                if has_pickle(v):
                    return True
    return False
