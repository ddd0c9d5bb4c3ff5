"""What the fuzzing tests (tests/test_fuzz_*.py) share: the hypothesis profile, the hostile
values and mutations of bytes and JSON documents, the guard a load runs under (only fmstore
errors, nothing written outside its target, no planted code run, bounded address space), the
in-process console entry, and the pickle that plants a file when it runs."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import resource
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.strategies import DrawFn

from fmstore.cli.main import main
from fmstore.errors import FmstoreError

#: Examples per test: 15 in ``make test`` (derandomized: the same ones every run); ``make
#: fuzz`` runs 2000.
EXAMPLES = int(os.environ.get("FMSTORE_FUZZ_EXAMPLES", "15"))
# A named profile, applied per test (loading it globally would change every other module's
# hypothesis settings in the same run).
settings.register_profile(
    "fmstore-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)  # fmt: skip
FUZZ = settings.get_profile("fmstore-fuzz")
#: Address space a load may take beyond the process's size when it starts.
HEADROOM = 3 << 30


# ---- guards: memory, files written, code run --------------------------------------------


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def address_space_limit(headroom: int = HEADROOM) -> Iterator[None]:
    """Cap the soft RLIMIT_AS at the process's size plus ``headroom`` for the duration of
    one load (the hard limit is untouched, so it is restored afterwards): an allocation a
    hostile size asks for fails loudly as MemoryError / RuntimeError, which the property
    then reports."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + headroom
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def files_below(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def check_load(root: Path, allowed: tuple[str, ...], marker: Path, load: Callable[[], Any]) -> None:
    """Run ``load``: only fmstore errors, nothing new under ``root`` outside ``allowed``
    (relative directory names), and the planted ``marker`` never created."""
    before = files_below(root)
    try:
        with address_space_limit():
            load()
    except FmstoreError:
        pass
    new = {p for p in files_below(root) - before if p.split(os.sep)[0] not in allowed}
    assert not new, f"files written outside {allowed}: {sorted(new)[:5]}"
    assert not marker.exists(), "a planted pickle ran"


def cli_one_line(*args: str) -> None:
    """The console entry in-process: fmstore errors end in SystemExit(1) with one line;
    anything else propagates (and fails the property)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            assert e.code in (0, 1, None), e.code
    lines = err.getvalue().splitlines()
    assert len(lines) <= 1 and "Traceback" not in err.getvalue(), err.getvalue()[-2000:]


class Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


# ---- mutations ------------------------------------------------------------------------------


def _deep(n: int) -> Any:
    v: Any = 0
    for _ in range(n):
        v = [v]
    return v


HOSTILE = st.one_of(
    st.integers(-(2**70), -1),
    st.sampled_from([0, 1, 2**31, 2**32 + 1, 2**63, 2**64 + 7, 10**30, 6 << 30, 3_000_000_000]),
    st.sampled_from([float("nan"), float("inf"), -1.5, 1e308, 0.5]),
    st.sampled_from(["", "object", "../../escape", "/etc/passwd", "zstd", "pkl", "\x00", "9" * 40]),
    st.sampled_from([None, True, False, [], {}, [1, -1], {"tensor": 10**9}, {"pickle": 0},
                     {"__pickle__": "gASVAAAAAA=="}, {"dict": 5}, {"list": None}]),
    st.sampled_from([_deep(60), _deep(300)]),
)  # fmt: skip


def _paths(doc: Any, prefix: tuple[Any, ...] = (), depth: int = 0) -> list[tuple[Any, ...]]:
    """Every path to a value inside a JSON document (bounded, to keep draws cheap)."""
    out: list[tuple[Any, ...]] = []
    if depth > 12:
        return out
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((*prefix, k))
            out += _paths(v, (*prefix, k), depth + 1)
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:40]):
            out.append((*prefix, i))
            out += _paths(v, (*prefix, i), depth + 1)
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any, delete: bool) -> None:
    for p in path[:-1]:
        doc = doc[p]
    if delete and isinstance(doc, dict):
        del doc[path[-1]]
    else:
        doc[path[-1]] = value


@st.composite
def json_mutation(draw: DrawFn, doc: Any) -> Any:
    """``doc`` with one to three fields replaced by hostile values (or removed)."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        # A copy: the strategy's sample objects must never be edited by a later mutation.
        value = copy.deepcopy(draw(HOSTILE))
        _set(doc, path, value, draw(st.booleans()) and draw(st.booleans()))
    return doc


@st.composite
def byte_mutation(draw: DrawFn, size: int) -> tuple[str, int, bytes]:
    """``(kind, position, payload)``: flip bits at, truncate to, or extend after a position."""
    kind = draw(st.sampled_from(["flip", "truncate", "extend", "zero"]))
    pos = draw(st.integers(0, max(0, size - 1)))
    payload = draw(st.binary(min_size=1, max_size=64))
    return kind, pos, payload


def apply_bytes(path: Path, mutation: tuple[str, int, bytes]) -> None:
    kind, pos, payload = mutation
    data = bytearray(path.read_bytes())
    if kind == "flip" and data:
        for i, b in enumerate(payload[:8]):
            data[(pos + i) % len(data)] ^= b or 0x01
    elif kind == "truncate":
        del data[pos:]
    elif kind == "extend":
        data[pos:pos] = payload
    elif kind == "zero":
        data[pos : pos + len(payload)] = bytes(min(len(payload), len(data) - pos))
    path.write_bytes(bytes(data))
