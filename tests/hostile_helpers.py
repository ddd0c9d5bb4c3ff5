"""Crafting hostile checkpoints and datasets, running loads under a memory limit, and the
one ``error:`` line a refused command prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zstandard

from fmstore.format.checksum import crc32c

REPO = Path(__file__).resolve().parents[1]
#: Address space a limited load may take beyond what the interpreter holds after its imports:
#: far below the 1 GiB and larger allocations the hostile inputs ask for.
HEADROOM = 640 << 20

_PRELUDE = """
import os, resource, sys, json, traceback
import torch, numpy, zstandard
import fmstore
from fmstore.errors import FmstoreError

def _vm():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")

resource.setrlimit(resource.RLIMIT_AS, (_vm() + {headroom}, resource.RLIM_INFINITY))

def report(fn):
    try:
        fn()
    except FmstoreError as e:
        print("RESULT", json.dumps({{"error": type(e).__name__, "fmstore": True, "msg": str(e)}}))
    except BaseException as e:
        print("RESULT", json.dumps({{"error": type(e).__name__, "fmstore": False, "msg": str(e)[:300]}}))
    else:
        print("RESULT", json.dumps({{"error": None}}))
    sys.stdout.flush()
"""


def run_limited(
    body: str, *, headroom: int = HEADROOM, timeout: float = 120
) -> list[dict[str, Any]]:
    """Run ``body`` in a fresh interpreter whose address space is capped at ``headroom``
    bytes above its size after importing torch and fmstore; ``body`` calls
    ``report(callable)`` for each load and gets back one result dict per call."""
    code = _PRELUDE.format(headroom=headroom) + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=str(REPO), MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )
    results = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"no result (rc {p.returncode}):\n{p.stdout}\n{p.stderr[-3000:]}"
    return results


def zstd_bomb(n: int = 1 << 30, *, declare: bool = True) -> bytes:
    """A real zstd frame of ``n`` zero bytes (1 GiB compresses to ~33 KB)."""
    c = zstandard.ZstdCompressor(level=3, write_content_size=declare)
    piece = bytes(1 << 20)
    out = c.compressobj(size=n if declare else -1)
    parts = [out.compress(piece[: min(len(piece), n - lo)]) for lo in range(0, n, len(piece))]
    parts.append(out.flush())
    return b"".join(parts)


def read_json(path: str | Path) -> Any:
    with open(path) as f:
        return json.load(f)


def write_json(path: str | Path, doc: Any) -> None:
    with open(path, "w") as f:
        json.dump(doc, f)


def replace_blob_bytes(ckpt: str | Path, doc: dict[str, Any], si: int, data: bytes) -> None:
    """Store ``data`` as storage ``si``'s only chunk, in a blob of its own, with a matching
    checksum (so only the size and content checks can catch it); ``doc`` is the manifest."""
    gen = Path(ckpt) / doc["generation"]
    name = f"crafted-{si}.bin"
    (gen / name).write_bytes(data)
    doc["blobs"].append({"name": name, "size": len(data)})
    st = doc["storages"][si]
    c = dict(st["chunks"][0])
    c.update(blob=len(doc["blobs"]) - 1, offset=0, length=len(data), crc32c=crc32c(data))
    st["chunks"] = [c]


class LimitedCases:
    """Hostile loads of one test module run under a memory limit, all in one fresh
    interpreter (starting one costs seconds): name -> a function preparing the input in a
    directory of its own and returning the ``report(...)`` calls to run there (see
    :func:`run_limited`).  Register with ``@CASES.case`` (``_case_NAME``: ``NAME``); a
    module-scoped fixture returns :meth:`run`."""

    def __init__(self) -> None:
        self.cases: dict[str, Callable[[Path, bytes], str]] = {}

    def case(self, fn: Callable[[Path, bytes], str]) -> Callable[[Path, bytes], str]:
        self.cases[fn.__name__.removeprefix("_case_")] = fn
        return fn

    def run(self, tmp_path_factory: Any, bomb: bytes) -> dict[str, tuple[Path, list[dict]]]:
        """name -> (its directory, one result per ``report`` call) of every case; ``bomb``
        is handed to each preparing function."""
        dirs, bodies, counts = {}, [], []
        for name, prepare in self.cases.items():
            dirs[name] = tmp_path_factory.mktemp(name)
            body = textwrap.dedent(prepare(dirs[name], bomb))
            bodies.append(body)
            counts.append((name, body.count("report(")))
        res = run_limited("\n".join(bodies), timeout=240)
        out, at = {}, 0
        for name, n in counts:
            out[name] = (dirs[name], res[at : at + n])
            at += n
        assert at == len(res), res
        return out


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    """The one ``error:`` line a command that failed with exit status 1 printed (no
    traceback, nothing else on stderr)."""
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    return lines[0]
