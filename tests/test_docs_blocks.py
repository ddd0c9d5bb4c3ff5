"""Every ```python and ```bash block of README.md and docs/*.md runs, or says why not.

A block is one of three kinds, decided by what it carries:

- its first line is ``# not run: <reason>`` (a cluster, GPUs, Slurm, a real AWS account, a
  long run): nothing runs it, and the reason must not be empty;
- the HTML comment just above it reads ``<!-- run by tests/test_x.py: "KEY" -->``: that test
  runs it.  Checked here: the file exists and names the doc and ``KEY``, and ``KEY`` is
  found in this block (or the comments just above it) and in no other block of the doc;
- anything else is run here, as written: the docs in three groups (:data:`GROUPS`; the
  multi-rank docs' blocks as rank 0 of a gloo world of one), each group's blocks one
  after another in a fresh interpreter of its own (each block in its own namespace), cwd
  under ``tmp_path``, with a temporary ``FMSTORE_CONFIG`` whose ``nvme`` and ``lustre``
  tiers are directories under ``tmp_path`` and whose ``s3`` tier (and ``[s3]`` endpoint,
  for ``s3://`` URLs) is a prefix of a bucket named ``bucket`` on the session's
  SeaweedFS.  Nothing may appear at the file system's root.

The names a block takes from the program around it (``model``, ``opt``, ``step``, a
dataset the example reads…) are the placeholders of :data:`GIVEN`, defined before the block
runs; a block that uses a name it defines nowhere and :data:`GIVEN` does not hold fails
here.  Nothing of a block's text is changed.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import os
import re
import socket
import subprocess
import symtable
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
FENCE = re.compile(r"^(\s*)```([A-Za-z]*)\s*$")
NOT_RUN = re.compile(r"^#\s*not run:(.*)$")
RUN_BY = re.compile(r'^<!--\s*run by (tests/[\w/]+\.py):\s*"([^"]+)"\s*-->$')


@dataclass
class Block:
    doc: Path
    line: int  # the fence's line (1-based); the code starts on the next one
    lang: str
    code: str
    comments: list[str]  # the HTML comment lines just above the fence, top first

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def not_run(self) -> str | None:
        first = self.code.lstrip("\n").splitlines()[0] if self.code.strip() else ""
        m = NOT_RUN.match(first.strip())
        return None if m is None else m.group(1).strip()

    def run_by(self) -> tuple[str, str] | None:
        for c in self.comments:
            m = RUN_BY.match(c.strip())
            if m:
                return m.group(1), m.group(2)
        return None


def blocks(doc: Path) -> list[Block]:
    """The ```python / ```bash blocks of ``doc`` (other fences are skipped whole)."""
    lines = doc.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2).lower()
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if lang in LANGS:
            body = "\n".join(
                ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : j]
            )
            k, comments = i - 1, []
            while (
                k >= 0 and lines[k].strip().startswith("<!--") and lines[k].strip().endswith("-->")
            ):
                comments.insert(0, lines[k])
                k -= 1
            out.append(Block(doc, i + 1, LANGS[lang], body + "\n", comments))
        i = j + 1
    return out


ALL = [b for d in DOCS for b in blocks(d)]


def free_names(code: str) -> set[str]:
    """Names ``code`` reads at module level (or as globals of its functions) and defines
    nowhere: what the program around the block must provide."""
    top = symtable.symtable(code, "<block>", "exec")
    defined = {
        s.get_name()
        for s in top.get_symbols()
        if s.is_assigned() or s.is_imported() or s.is_namespace()
    }
    used: set[str] = set()

    def walk(t: symtable.SymbolTable) -> None:
        for s in t.get_symbols():
            if s.is_referenced() and (t is top or s.is_global()):
                used.add(s.get_name())
        for c in t.get_children():
            walk(c)

    walk(top)
    return (used - defined - set(dir(builtins))) | used_before_set(code, used & defined)


def _names(node: ast.AST, ctx: type) -> set[str]:
    """Names of ``node`` in context ``ctx`` (Load or Store), functions' bodies left out:
    they run when called."""
    out: set[str] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Name) and isinstance(n.ctx, ctx):
            out.add(n.id)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            if ctx is ast.Store and not isinstance(n, ast.Lambda):
                out.add(n.name)
            continue
        if isinstance(n, (ast.Import, ast.ImportFrom)) and ctx is ast.Store:
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
        todo += ast.iter_child_nodes(n)
    return out


def used_before_set(code: str, names: set[str]) -> set[str]:
    """Of ``names``, those a top-level statement reads before one sets them (``df.x()``
    then ``df = ...``; ``x = f(x)`` reads first)."""
    out, stored = set(), set()
    for stmt in ast.parse(code).body:
        reads = (
            _names(stmt.value, ast.Load) if isinstance(stmt, (ast.Assign, ast.AugAssign)) else set()
        )
        if not isinstance(stmt, (ast.Assign, ast.AugAssign)):
            reads = _names(stmt, ast.Load) - _names(stmt, ast.Store)
        out |= (reads & names) - stored
        stored |= _names(stmt, ast.Store)
    return out


#: The placeholders of the docs' examples: name -> the code that defines it (which may use
#: other names of this table: they are defined first, in this order).  Small and real: a
#: model that has taken one optimizer step, a step number, the data an example reads.
GIVEN: dict[str, str] = {
    "torch": "import torch",
    "dist": "import torch.distributed as dist",
    "fmstore": "import fmstore",
    "model": "import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(8, 4)",
    "opt": (
        "import torch\nopt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
        "model(torch.randn(2, 8)).square().mean().backward()\nopt.step()"
    ),
    "optimizer": "optimizer = opt",
    "step": "step = 1000",
    "steps": "steps = 3",
    "total_steps": "total_steps = 3",
    "start_epoch": "start_epoch = 0",
    "epochs": "epochs = 1",
    "state": 'state = {"model": model.state_dict(), "optim": opt.state_dict()}',
    "init": 'def init():\n    return {"model": model.state_dict(), "step": 0}',
    "init_state": 'def init_state():\n    return {"model": model.state_dict(), "step": 0}',
    "train_step": "def train_step(*args):\n    pass",
    "saved": "saved = {}",
    "save": "def save(obj):\n    saved.update(obj)",
    "uri": 'uri = "nvme:run/step_000000003000"',
    "ckpt_pg": 'ckpt_pg = dist.new_group(backend="gloo")',
    "data": "data = bytes(range(256)) * 32",
    "chunks": "chunks = [bytes(1024)] * 4",
    "df": (
        "import pandas as pd\n"
        'df = pd.DataFrame({"step": [500, 1000, 1500], "loss": [2.5, 2.0, 1.75]})'
    ),
}


def prelude(code: str) -> str:
    """The :data:`GIVEN` definitions ``code`` needs, with theirs, in the table's order."""
    want, todo = set(), list(free_names(code))
    while todo:
        name = todo.pop()
        if name in want:
            continue
        if name not in GIVEN:
            raise LookupError(f"uses {name!r}, which it does not define and GIVEN does not hold")
        want.add(name)
        todo += free_names(GIVEN[name])
    return "\n".join(GIVEN[n] for n in GIVEN if n in want) + "\n"


def needs_dist(code: str) -> bool:
    """A block of a multi-rank job: it runs as rank 0 of a world of one (gloo), as torchrun
    would start it."""
    return bool(re.search(r"\bdist\.|process_group|ShardedCheckpointManager", code))


# ---- the rules every block follows ---------------------------------------------------------


def test_every_block_is_run_or_says_why_not():
    assert len(ALL) >= 20, "the fences were not found"
    wrong = []
    for b in ALL:
        reason, by = b.not_run(), b.run_by()
        if reason is not None and by is not None:
            wrong.append(f"{b.where}: both '# not run' and run by {by[0]}")
        elif reason is not None and not reason:
            wrong.append(f"{b.where}: '# not run:' without a reason")
        elif reason is None and by is None and b.lang == "python":
            try:
                compile(b.code, b.where, "exec")
            except SyntaxError as e:
                wrong.append(f"{b.where}: not valid as a script: {e}")
                continue
            try:
                prelude(b.code)
            except LookupError as e:
                wrong.append(f"{b.where}: {e.args[0]}")
    assert not wrong, "\n".join(wrong)


def test_a_block_run_by_another_test_is_found_by_it():
    registered = [(b, b.run_by()) for b in ALL if b.run_by() is not None]
    assert registered, "no block names the test that runs it"
    wrong = []
    for b, (test, key) in registered:
        path = ROOT / test
        if not path.is_file():
            wrong.append(f"{b.where}: {test} does not exist")
            continue
        text = path.read_text()
        if b.doc.name not in text or key not in text:
            wrong.append(f"{b.where}: {test} names neither {b.doc.name!r} nor {key!r}")
        holders = [
            o.where for o in blocks(b.doc) if key in o.code or any(key in c for c in o.comments)
        ]
        if holders != [b.where]:
            wrong.append(f"{b.where}: key {key!r} must be in this block alone, found in {holders}")
    assert not wrong, "\n".join(wrong)


# ---- running them --------------------------------------------------------------------------

#: Runs each block of ``sys.argv[1]`` (JSON) in its own namespace, its line numbers the doc's.
DRIVER = textwrap.dedent(
    """
    import json, sys, time, traceback
    failed = []
    for s in json.loads(sys.argv[1]):
        if s["dist"]:
            import torch.distributed as dist
            if not dist.is_initialized():
                dist.init_process_group("gloo")
        ns = {"__name__": "__main__"}
        t0 = time.monotonic()
        try:
            exec(compile(s["prelude"], "<GIVEN of " + s["where"] + ">", "exec"), ns)
            exec(compile("\\n" * s["line"] + s["code"], s["where"], "exec"), ns)
            print("ran", s["where"], "in %.1f s" % (time.monotonic() - t0), flush=True)
        except BaseException:
            traceback.print_exc()
            failed.append(s["where"])
    if failed:
        sys.exit("failed: " + ", ".join(failed))
    """
)


#: Docs whose blocks share an interpreter (each its own config, tiers and state; the s3 tiers
#: under their own prefix of one bucket); the groups run at once.  A doc of a multi-rank
#: job's blocks is in the group whose interpreter is rank 0 of a world of one.
GROUPS = (
    ("README.md", "dataloader.md", "staging.md"),
    ("checkpoint.md", "stores.md", "tiering.md"),
)


def setup_data(group: int, s3_server, tmp_path: Path) -> None:
    """What the examples read, put where they say it is (through fmstore, on the group's s3
    tier): a token dataset, a directory of Parquet files, a staging source."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fmstore import runtime
    from fmstore.loaders.writer import write_dataset
    from fmstore.stores import open_store

    def s3(prefix: str):
        return open_store(f"s3://bucket/g{group}/{prefix}", **s3_server.store_options())

    np.save(tmp_path / f"tok{group}.npy", (np.arange(70_000) % 50_000).astype(np.uint16))
    tokens = s3("datasets/tokens")
    write_dataset(tmp_path / f"tok{group}.npy", tokens)
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(64)]}), tmp_path / "p.parquet")
    stores = [tokens, s3("datasets/fineweb/data"), s3("ds")]
    runtime.run(stores[1].put("part-0.parquet", (tmp_path / "p.parquet").read_bytes()))
    runtime.run(stores[2].put("train/a.bin", b"a" * 1000))
    runtime.run(stores[2].put("val/b.bin", b"b" * 10))
    for st in stores:
        runtime.run(st.close())


def group_env(group: int, s3_server, tmp_path: Path) -> tuple[dict[str, str], Path]:
    top = tmp_path / f"g{group}"
    cwd = top / "work"
    cwd.mkdir(parents=True)
    cfg = top / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{top / "state"}"\n'
        f'[tiers.nvme]\nurl = "{top / "nvme"}"\n'
        f'[tiers.lustre]\nurl = "{top / "lustre"}"\n'
        f'[tiers.s3]\nurl = "s3://bucket/g{group}"\n'
        f'[s3]\nendpoint_url = "{s3_server.endpoint_url}"\naddressing_style = "path"\n'
        f'region = "{s3_server.region}"\n'
    )
    (cwd / "run.toml").write_text(cfg.read_text())  # the config an example names
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {
        **os.environ,
        **s3_server.env(),
        "PYTHONPATH": str(ROOT),
        "FMSTORE_CONFIG": str(cfg),
        "HOME": str(top / "home"),
        "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "FMSTORE_NODE_ID": "n0",
    }, cwd


def to_run() -> list[list[Block]]:
    """The blocks run here, by group: every doc's unmarked blocks, each in one group."""
    here = [b for b in ALL if b.not_run() is None and b.run_by() is None]
    docs = {b.doc.name for b in here}
    multi = sorted(d for d in docs if any(needs_dist(b.code) for b in here if b.doc.name == d))
    rest = docs - set(multi) - {d for g in GROUPS for d in g}
    groups = [*GROUPS[:-1], (*GROUPS[-1], *sorted(rest)), tuple(multi)]
    return [[b for b in here if b.doc.name in g] for g in groups]


def test_the_blocks_run_as_written(tmp_path, s3_server):
    groups = to_run()
    assert sum(map(len, groups)) == sum(
        1 for b in ALL if b.not_run() is None and b.run_by() is None
    )
    root_before = {p.name for p in Path("/").iterdir()}
    s3_server.create_bucket("bucket")
    try:
        procs = []
        for g, mine in enumerate(groups):
            env, cwd = group_env(g, s3_server, tmp_path)
            setup_data(g, s3_server, tmp_path)
            for b in mine:
                if b.lang == "bash":  # none yet: run before the group's interpreter
                    r = subprocess.run(["bash", "-euo", "pipefail", "-c", b.code], cwd=cwd,
                                       env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
                    assert r.returncode == 0, f"{b.where}:\n{r.stdout}{r.stderr}"
            py = [
                {
                    "where": b.where,
                    "line": b.line,
                    "code": b.code,
                    "prelude": prelude(b.code),
                    "dist": needs_dist(b.code),
                }  # fmt: skip
                for b in mine
                if b.lang == "python"
            ]
            procs.append(subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(py)], cwd=cwd,
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))  # fmt: skip
        outs = [p.communicate(timeout=300)[0] for p in procs]
        failed = [out for p, out in zip(procs, outs) if p.returncode != 0]
        assert not failed, "\n".join(failed)
        print("\n".join(outs))
        # Everything an example wrote is under tmp_path: nothing at the file system's root.
        assert {p.name for p in Path("/").iterdir()} == root_before
    finally:
        s3_server.delete_bucket("bucket")


# ---- the reference tables of the docs, together --------------------------------------------


def toml_block(doc: str, marker: str) -> str:
    text = (ROOT / "docs" / doc).read_text()
    found = [b for b in re.findall(r"```toml\n(.*?)```", text, re.S) if marker in b]
    assert len(found) == 1, f"{doc}: {len(found)} toml blocks hold {marker!r}"
    return found[0]


def test_the_reference_tiers_and_the_reference_policies_load_together():
    """configuration.md's reference tiers (a node-local nvme among them) with tiering.md's
    reference ``[policies]``: what a user who copies both gets, validated as a
    CheckpointManager or the daemon validates it when it starts."""
    import tomllib

    from fmstore.config import from_dict
    from fmstore.tiering.policy.rules import from_config

    tiers = toml_block("configuration.md", 'state_dir = "/var/lib/fmstore"')
    policies = toml_block("tiering.md", "[policies]\nladder")
    cfg = from_dict(tomllib.loads(tiers + "\n" + policies), source="the two reference blocks")
    assert cfg.tier("nvme").scope == "node"
    p = from_config(cfg)
    assert [e.to for e in p.exports] == ["lustre", "s3"] and p.node_tiers == ("nvme",)


_DOC_IMPORT = re.compile(r"from (fmstore[\w.]*) import ([\w, ]+)")


def test_every_import_the_docs_show_works():
    # The blocks that are not run (a cluster, GPUs) and the imports named in prose must
    # still name what exists: a module moved without its docs fails here.
    wrong, seen = [], 0
    for doc in DOCS:
        for mod, names in _DOC_IMPORT.findall(doc.read_text()):
            seen += 1
            try:
                m = importlib.import_module(mod)
            except ImportError as e:
                wrong.append(f"{doc.name}: from {mod}: {e}")
                continue
            for name in (n.strip() for n in names.split(",")):
                if name and not hasattr(m, name):
                    try:
                        importlib.import_module(f"{mod}.{name}")
                    except ImportError:
                        wrong.append(f"{doc.name}: {mod} has no {name}")
    assert seen > 10, "the docs show almost no imports: the pattern is out of date"
    assert not wrong, "\n".join(wrong)
