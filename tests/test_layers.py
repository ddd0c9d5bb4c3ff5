"""The import rule of docs/architecture.md, checked on the source: each package imports
only from the layers below it, no two modules import each other (directly or in a circle)
at import time, and no module grows past the size one engineer can hold in mind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "fmstore"

CORE = {
    "errors",
    "units",
    "keys",
    "config",
    "runtime",
    "buffers",
    "metrics",
    "limits",
    "trust",
    "configfile",
}
#: What each package (or top-level module) may import besides itself and the core.
ALLOWED: dict[str, set[str]] = {
    **{m: set() for m in CORE},
    "stores": set(),
    "format": {"stores"},  # only the Buffer type of stores.base
    # The multi-node protocol's records and decisions, below everything that acts on them.
    "protocol": {"format", "stores"},
    "checkpoint": {"protocol", "format", "stores"},
    "loaders": {"format", "stores"},
    "tiering": {"checkpoint", "protocol", "format", "stores"},
    # The simulation (testing/sim/) drives the real exports, sweeps and policies.
    "testing": {"checkpoint", "protocol", "format", "stores", "tiering"},
    "cli": {"checkpoint", "protocol", "format", "stores", "loaders", "tiering"},
    "integrations": {"checkpoint", "protocol", "format", "stores", "loaders", "tiering"},
    "demo": {"checkpoint", "protocol", "format", "stores", "loaders", "tiering", "cli", "testing"},
    "__main__": {"cli"},
    # fmstore:// for fsspec: reads lazily staged files through, so it sits above tiering.
    "fsspec": {"stores", "tiering"},
}
#: Within ``tiering``: what each of its subpackages may import of its siblings ("" is
#: the modules directly in ``tiering/``).  The copy engine and staging know nothing of
#: policies or managers; nothing imports the managers or the service that sit on top.
TIERING: dict[str, set[str]] = {
    "copy": set(),
    "staging": {"copy"},
    "inventory": {""},
    "exports": {"", "copy", "policy"},
    "policy": {"", "copy", "exports", "inventory"},
    "service": {"", "copy", "exports", "inventory", "policy"},
    "managers": {"", "copy", "exports", "inventory", "policy", "service"},
    "": {"", "inventory", "policy"},
}
MAX_LINES = 700


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    p = ROOT.parent / Path(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """The fmstore modules ``path`` imports (never counting those under TYPE_CHECKING);
    ``top_level_only``: only those imported when the module itself is imported."""
    tree = ast.parse(path.read_text())
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("fmstore"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    out.add(sub if _is_module(sub) else target)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.startswith("fmstore"))
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):  # annotations only
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody)
                for h in node.handlers:
                    visit(h.body)
            elif not top_level_only:
                visit([n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)])

    visit(tree.body)
    out.discard(mod)
    return out


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


SOURCES = sorted(ROOT.rglob("*.py"))


def test_each_package_imports_only_from_the_layers_below():
    wrong = []
    for path in SOURCES:
        mod = _module(path)
        area = _area(mod)
        if area == "":  # the package facade imports lazily from everywhere
            continue
        allowed = ALLOWED[area] | CORE | {area, ""}
        for target in _imports(path, top_level_only=False):
            if _area(target) not in allowed:
                wrong.append(f"{mod} imports {target}")
    assert not wrong, "imports against the layering of docs/architecture.md:\n" + "\n".join(wrong)


def _tiering_sub(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 else ""


def test_tiering_is_split_by_concept():
    wrong = []
    for path in sorted((ROOT / "tiering").rglob("*.py")):
        mod = _module(path)
        if mod == "fmstore.tiering":
            continue
        sub = _tiering_sub(mod)
        assert sub in TIERING, f"{mod}: tiering/{sub}/ is in no row of TIERING"
        for target in _imports(path, top_level_only=False):
            if target.startswith("fmstore.tiering.") and _tiering_sub(target) not in (
                TIERING[sub] | {sub}
            ):
                wrong.append(f"{mod} imports {target}")
    assert not wrong, "imports against the tiering split:\n" + "\n".join(wrong)
    loose = sorted(p.name for p in (ROOT / "tiering").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 5, f"modules left directly in tiering/: {loose}"


def test_no_import_circles():
    # Every import, lazy ones included: a lazy import is still a dependency.  The package
    # facade (``fmstore``: ``__version__`` and lazy names) is not counted as a target.
    graph = {_module(p): _imports(p, top_level_only=False) - {"fmstore"} for p in SOURCES}
    # Tarjan's strongly connected components over module-level imports.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            # A package importing its own modules, which import their siblings, is not a circle.
            real = [m for m in comp if not any(m != o and o.startswith(m + ".") for o in comp)]
            if len(real) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_too_big_to_hold_in_mind(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines (at most {MAX_LINES})"


def _imports_torch_at_import(path: Path) -> bool:
    """Whether ``path`` imports torch when it is imported (lazy imports inside functions and
    annotations under TYPE_CHECKING do not count)."""

    def visit(nodes: list[ast.stmt]) -> bool:
        for node in nodes:
            if isinstance(node, ast.Import):
                inner = [] if all(a.name.split(".")[0] != "torch" for a in node.names) else None
            elif isinstance(node, ast.ImportFrom):
                torch = not node.level and (node.module or "").split(".")[0] == "torch"
                inner = None if torch else []
            elif isinstance(node, ast.If):
                lazy = "TYPE_CHECKING" in ast.unparse(node.test)  # annotations only
                inner = node.orelse if lazy else node.body + node.orelse
            elif isinstance(node, ast.Try):
                inner = node.body + node.orelse + node.finalbody
            else:
                inner = []
            if inner is None or visit(inner):
                return True
        return False

    return visit(ast.parse(path.read_text()).body)


def test_the_protocol_decides_without_torch():
    # Its decisions are pure functions of torch-free facts: the simulation, the daemon and
    # the CLI use them without loading torch, so none of its modules (nor what they import
    # within fmstore) may import torch at module level.
    protocol = sorted((ROOT / "protocol").rglob("*.py"))
    assert protocol, "fmstore/protocol/ holds no module"
    seen: set[Path] = set()
    todo = list(protocol)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for target in _imports(path, top_level_only=True):
            p = ROOT.parent / Path(*target.split("."))
            todo += [q for q in (p.with_suffix(".py"), p / "__init__.py") if q.exists()]
    heavy = sorted(str(p.relative_to(ROOT)) for p in seen if _imports_torch_at_import(p))
    assert not heavy, "the protocol loads torch at import through: " + ", ".join(heavy)
