"""Property-based fuzzing of the files fmstore reads that other programs wrote: native DCP
checkpoints (torch's ``.metadata`` pickle and the ``torch.save`` zip archives of its
``.distcp`` items), ``torch.save`` files given to ``ckpt convert``, Hugging Face
``save_pretrained`` indexes, Parquet footers, and the resume journals of ``fmstore stage``.

Each test mutates a real file (written by torch, safetensors, pyarrow or fmstore itself)
and then reads it every way fmstore does, with the assertions of ``test_fuzz_input.py``:
only fmstore errors (one ``error:`` line on the command line), nothing written outside the
target, no planted code run, within a hard address-space limit.  Time stays bounded by
construction: every input is a few hundred KiB, and FIFOs planted beside them are opened
only with ``O_NONBLOCK``.

Budget: ``FMSTORE_FUZZ_EXAMPLES`` examples per test (15 by default, derandomized; ``make fuzz``: 2000).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import shutil
import stat
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fuzz_support import (
    FUZZ,
    HOSTILE,
    Evil,
    apply_bytes,
    byte_mutation,
    check_load,
    cli_one_line,
    json_mutation,
)
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.strategies import DrawFn
from thrift_compact import BINARY, I16, I32, I64, LIST, STRUCT, join_parquet, split_parquet
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from zip_support import deflated, listed_again, torch_bytes

import fmstore
from fmstore.checkpoint.dcp import Reader
from fmstore.checkpoint.dcp.api import inspect_checkpoint, load_full_state_dict, verify_checkpoint
from fmstore.checkpoint.hf import read_hf_dir, write_hf_dir
from fmstore.checkpoint.zipguard import check_torch_zip
from fmstore.errors import FmstoreError

pytestmark = [pytest.mark.fuzz, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {"model": {"w": torch.randn(32, 16, generator=g), "b": torch.arange(9)},
            "step": 7, "tags": ["a", "b"]}  # fmt: skip


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = tmp_path_factory.mktemp("originals")
    out = {k: base / k for k in ("native", "hf", "parquet", "stage")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(out["native"])))
    tensors = {f"layer.{i}.w": torch.randn(8, 8) for i in range(6)}
    write_hf_dir(tensors, str(out["hf"]), max_shard_size=600)
    out["parquet"].mkdir()
    for name, rows in (("a", 300), ("b", 170)):
        table = pa.table({"id": list(range(rows)), "text": [f"t{i}" for i in range(rows)],
                          "vec": [[float(i)] * 3 for i in range(rows)]})  # fmt: skip
        pq.write_table(table, out["parquet"] / f"{name}.parquet", row_group_size=64)
    src = out["stage"] / "src"
    (src / "c").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(3 << 20))
    (src / "b.txt").write_bytes(b"b" * 1000)
    (src / "c" / "d.txt").write_bytes(b"d" * 3000)
    return out


@pytest.fixture
def work(tmp_path: Path) -> Path:
    return tmp_path


def _fresh(work: Path, original: Path) -> tuple[Path, Path]:
    ex = work / "ex"
    shutil.rmtree(ex, ignore_errors=True)
    ex.mkdir()
    shutil.copytree(original, ex / "target", symlinks=True)
    return ex, ex / "target"


# ---- native DCP: the .metadata pickle ------------------------------------------------------


def _spots(x: Any, depth: int = 0) -> list[tuple[Callable[[Any], None], Callable[[], None]]]:
    """``(set, delete)`` for every attribute, dict entry and list element inside ``x``."""
    out: list[tuple[Callable[[Any], None], Callable[[], None]]] = []
    if depth > 8:
        return out
    if isinstance(x, dict):
        for k, v in list(x.items()):
            out.append((lambda v, k=k: x.__setitem__(k, v), lambda k=k: x.pop(k, None)))
            out += _spots(v, depth + 1)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out.append((lambda v, i=i: x.__setitem__(i, v), lambda i=i: x.__setitem__(i, None)))
            out += _spots(v, depth + 1)
    elif isinstance(getattr(x, "__dict__", None), dict) and not isinstance(x, type):
        for k, v in list(vars(x).items()):
            if k == "memory_format":  # pickled as an enum by TensorProperties itself
                continue
            out.append((lambda v, k=k: setattr(x, k, v), lambda k=k: delattr(x, k)))
            out += _spots(v, depth + 1)
    return out


def _dag(n: int) -> list[Any]:
    v: list[Any] = []
    for _ in range(n):
        v = [v, v]
    return v


NATIVE_HOSTILE = st.one_of(
    HOSTILE,
    st.sampled_from(
        [
            _dag(40),
            torch.Size([1 << 40, 1 << 40]),
            torch.Size([-1]),
            torch.float64,
            torch.bool,
            "__0_0.distcp",
            ".metadata",
            "../../x",
            (1 << 40, 3),
            [0, 0],
        ]
    ),  # fmt: skip
    st.builds(lambda: pickle.loads(pickle.dumps(_hollow()))),
)


def _hollow() -> Any:
    from torch.distributed.checkpoint import metadata as dmd

    return dmd.TensorStorageMetadata.__new__(dmd.TensorStorageMetadata)


def _read_native_every_way(uri: str, out: Path) -> Callable[[], None]:
    def go() -> None:
        for fn in (
            lambda: fmstore.load(uri),
            lambda: fmstore.load(uri, verify=False),
            lambda: load_full_state_dict(uri),
            lambda: verify_checkpoint(uri),
            lambda: inspect_checkpoint(uri),
            lambda: _read_with_planner(uri),
        ):
            with contextlib.suppress(FmstoreError):
                fn()
        cli_one_line("ckpt", "inspect", uri)
        cli_one_line("ckpt", "verify", uri)
        cli_one_line("ckpt", "convert", "--overwrite", uri, str(out / "w.safetensors"))

    return go


def _read_with_planner(uri: str) -> None:
    """torch's DefaultLoadPlanner over the Reader, without DCP's exception wrapping."""
    st_ = _state()
    target = {"model": {k: torch.zeros_like(v) for k, v in st_["model"].items()},
              "step": 0, "tags": ["", ""]}  # fmt: skip
    reader = Reader(uri)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    planner = DefaultLoadPlanner()
    try:
        planner.set_up_planner(target, md, True)
        plan = planner.create_local_plan()
    except Exception:
        return  # torch's planner refused the metadata before anything was read
    reader.read_data(plan, planner).wait()


@FUZZ
@given(data=st.data())
def test_native_dcp_with_hostile_metadata_objects(originals, work, data):
    ex, target = _fresh(work, originals["native"])
    (ex / "out").mkdir()
    md = pickle.loads((target / ".metadata").read_bytes())  # written by torch above
    for _ in range(data.draw(st.integers(1, 3))):
        spots = _spots(md)
        put, drop = data.draw(st.sampled_from(spots))
        if data.draw(st.integers(0, 4)) == 0:
            with contextlib.suppress(Exception):
                drop()
        else:
            put(copy.deepcopy(data.draw(NATIVE_HOSTILE)))  # strategies' values stay as they are
    try:
        raw = pickle.dumps(md)
    except Exception:  # DCP's own __getstate__ needs some fields: no file can lack them
        assume(False)
    if data.draw(st.booleans()):  # a planted global, refused without allow_pickle
        raw = pickle.dumps({"md": md, "evil": Evil(str(ex / "pwned"))})
    (target / ".metadata").write_bytes(raw)
    check_load(ex, ("target", "out"), ex / "pwned", _read_native_every_way(str(target), ex / "out"))


@FUZZ
@given(data=st.data())
def test_native_dcp_with_damaged_metadata_bytes(originals, work, data):
    ex, target = _fresh(work, originals["native"])
    (ex / "out").mkdir()
    f = target / ".metadata"
    apply_bytes(f, data.draw(byte_mutation(f.stat().st_size)))
    check_load(ex, ("target", "out"), ex / "pwned", _read_native_every_way(str(target), ex / "out"))


# ---- zip members: .distcp items and .pt files ----------------------------------------------


@st.composite
def zip_mutation(draw: DrawFn, data: bytes) -> bytes:
    """A torch.save archive made hostile: a member listed again, every member deflated,
    bytes of its central directory (the last few hundred bytes) damaged, or its members'
    names and sizes swapped around, or bytes added before or after it (so that the
    directory its end record declares is not the one before that record)."""
    kind = draw(st.sampled_from(["listed", "deflated", "tail", "bytes", "before", "after"]))
    if kind in ("before", "after"):
        extra = draw(st.binary(min_size=1, max_size=64))
        return extra + data if kind == "before" else data + extra
    if kind == "listed":
        suffix = draw(st.sampled_from(["data.pkl", "data/0", "version", "byteorder"]))
        try:
            return listed_again(data, suffix, draw(st.integers(1, 3000)))
        except StopIteration:
            return data
    if kind == "deflated":
        return deflated(data)
    b = bytearray(data)
    lo = max(0, len(b) - 600) if kind == "tail" else 0
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(lo, len(b) - 1))
        b[i] = draw(st.integers(0, 255))
    return bytes(b)


def _replace_item(path: Path, index: int, make: Callable[[bytes], bytes]) -> None:
    md = pickle.loads((path / ".metadata").read_bytes())  # written by torch in this test
    info = list(md.storage_data.values())[index]
    f = path / info.relative_path
    data = f.read_bytes()
    new = make(data[info.offset : info.offset + info.length])
    info.offset, info.length = len(data), len(new)
    f.write_bytes(data + new)
    (path / ".metadata").write_bytes(pickle.dumps(md))


@FUZZ
@given(data=st.data())
def test_native_dcp_with_hostile_zip_members(originals, work, data):
    ex, target = _fresh(work, originals["native"])
    (ex / "out").mkdir()
    n = len(pickle.loads((target / ".metadata").read_bytes()).storage_data)
    index = data.draw(st.integers(0, n - 1))
    _replace_item(target, index, lambda b: data.draw(zip_mutation(b)))
    check_load(ex, ("target", "out"), ex / "pwned", _read_native_every_way(str(target), ex / "out"))


@FUZZ
@given(data=st.data())
def test_torch_save_file_with_hostile_zip_members(work, data):
    ex = work / "ex"
    shutil.rmtree(ex, ignore_errors=True)
    (ex / "out").mkdir(parents=True)
    original = torch_bytes({"w": torch.randn(16, 4), "n": torch.arange(5), "s": 3})
    (ex / "x.pt").write_bytes(data.draw(zip_mutation(original)))

    def go() -> None:
        with contextlib.suppress(FmstoreError):
            check_torch_zip(ex / "x.pt", name="x.pt")
        cli_one_line(
            "ckpt", "convert", "--overwrite", str(ex / "x.pt"), str(ex / "out" / "y.safetensors")
        )
        cli_one_line("ckpt", "convert", "--overwrite", str(ex / "x.pt"), str(ex / "out" / "y"))

    check_load(ex, ("out",), ex / "pwned", go)


# ---- Hugging Face indexes --------------------------------------------------------------------

#: Names planted beside the shards, for the index to point at.
PLANTED = ["fifo.safetensors", "link.safetensors", "dir.safetensors", "model.safetensors.index.json",
           "../hf", "/etc/passwd", "model-00001-of-00009.safetensors"]  # fmt: skip


def _plant(target: Path) -> None:
    os.mkfifo(target / "fifo.safetensors")
    os.symlink("/dev/zero", target / "link.safetensors")
    (target / "dir.safetensors").mkdir()


@FUZZ
@given(data=st.data())
def test_hugging_face_dir_with_a_hostile_index(originals, work, data):
    ex, target = _fresh(work, originals["hf"])
    _plant(target)
    (ex / "out").mkdir()
    index = target / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    if data.draw(st.booleans()):
        names = list(doc["weight_map"])
        for _ in range(data.draw(st.integers(1, 3))):
            doc["weight_map"][data.draw(st.sampled_from(names))] = data.draw(
                st.sampled_from(PLANTED)
            )
    else:
        doc = data.draw(json_mutation(doc))
    index.write_text(json.dumps(doc, allow_nan=True))
    if data.draw(st.integers(0, 3)) == 0:  # a shard damaged too
        shard = data.draw(st.sampled_from(sorted(target.glob("model-*.safetensors"))))
        apply_bytes(shard, data.draw(byte_mutation(shard.stat().st_size)))

    def go() -> None:
        with contextlib.suppress(FmstoreError):
            read_hf_dir(str(target))
        cli_one_line("ckpt", "convert", "--overwrite", str(target), str(ex / "out" / "w.pt"))

    check_load(ex, ("target", "out"), ex / "pwned", go)
    assert stat.S_ISFIFO(os.lstat(target / "fifo.safetensors").st_mode)


# ---- Parquet footers -------------------------------------------------------------------------

INT64_HOSTILE = st.one_of(
    st.sampled_from([-1, 0, 1, 2**31 - 1, 2**31, 2**40, 2**62, 2**63 - 1, -(2**63)]),
    st.integers(-(2**63), 2**63 - 1),
)


def _thrift_spots(fields: list[list[Any]], depth: int = 0) -> list[tuple[list[Any], int]]:
    """``(container, index)`` of every value in a decoded footer: a struct's field entry
    (index 2 of ``[id, type, value]``) or a list element."""
    out: list[tuple[list[Any], int]] = []
    for i, f in enumerate(fields):
        out.append((fields, i))
        _fid, t, v = f
        if t == STRUCT and depth < 8:
            out += _thrift_spots(v, depth + 1)
        elif t == LIST and depth < 8:
            et, items = v
            for k, item in enumerate(items[:64]):
                out.append((items, k))
                if et == STRUCT:
                    out += _thrift_spots(item, depth + 1)
    return out


@st.composite
def footer_mutation(draw: DrawFn, footer: list[list[Any]]) -> None:
    """Change one to three values of a decoded footer: numbers to hostile numbers, strings
    to random bytes, lists cut or repeated, fields dropped."""
    for _ in range(draw(st.integers(1, 3))):
        container, i = draw(st.sampled_from(_thrift_spots(footer)))
        entry = container[i]
        if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int):
            _fid, t, v = entry
            if draw(st.integers(0, 5)) == 0:
                del container[i]
            elif t in (I16, I32, I64):
                entry[2] = (
                    draw(INT64_HOSTILE) if t == I64 else draw(st.integers(-(2**31), 2**31 - 1))
                )
            elif t == BINARY:
                entry[2] = draw(st.binary(max_size=40))
            elif t == LIST:
                et, items = v
                entry[2] = (et, items[: draw(st.integers(0, len(items)))] * draw(st.integers(1, 3)))
        elif isinstance(entry, int):
            container[i] = draw(INT64_HOSTILE)


def _read_dataset(remote: Path, cache: Path) -> Callable[[], None]:
    from fmstore.loaders import StreamingDataset

    def go() -> None:
        for shuffle in (False, True):
            try:
                ds = StreamingDataset(str(remote), local=str(cache), shuffle=shuffle)
                for n, _sample in enumerate(ds):
                    if n >= 200:
                        break
            except FmstoreError:
                pass
        cli_one_line("dataset", "inspect", str(remote))

    return go


@FUZZ
@given(data=st.data())
def test_parquet_with_a_hostile_footer(originals, work, data):
    ex, target = _fresh(work, originals["parquet"])
    f = target / data.draw(st.sampled_from(["a.parquet", "b.parquet"]))
    if data.draw(st.integers(0, 3)):
        body, footer = split_parquet(f.read_bytes())
        data.draw(footer_mutation(footer))
        f.write_bytes(join_parquet(body, footer))
    else:  # bytes of the footer and its length
        size = f.stat().st_size
        mutation = data.draw(byte_mutation(600))
        apply_bytes(f, (mutation[0], size - 600 + mutation[1], mutation[2]))
    check_load(ex, ("target", "cache"), ex / "pwned", _read_dataset(target, ex / "cache"))


# ---- resume journals -------------------------------------------------------------------------


@pytest.fixture
def home(work: Path, monkeypatch: pytest.MonkeyPatch):
    from fmstore.config import set_config

    monkeypatch.setenv("FMSTORE_HOME", str(work / "ex" / "home"))
    monkeypatch.delenv("FMSTORE_CONFIG", raising=False)
    set_config(None)
    yield
    set_config(None)


JOURNAL_HOSTILE = st.one_of(
    HOSTILE,
    st.sampled_from(
        [
            ".fmstore-tmp." + "ab" * 16 + ".b.txt",
            ".fmstore-tmp." + "cd" * 16 + ".a.bin",
            ".fmstore-tmp.x",
            "a.bin",
            "../a.bin",
            "c/d.txt",
            "ffffffff",
            "zz",
        ]
    ),  # fmt: skip
)


@FUZZ
@given(data=st.data())
def test_stage_with_a_hostile_resume_journal(originals, work, home, data):
    ex = work / "ex"
    shutil.rmtree(ex, ignore_errors=True)
    ex.mkdir()
    src, dst = ex / "src", ex / "dst"
    shutil.copytree(originals["stage"] / "src", src)
    args = ("stage", str(src), str(dst), "--part-size", "1MiB", "--no-progress")
    cli_one_line(*args)
    (journal,) = (ex / "home" / "state" / "transfers").glob("*.jsonl")
    lines = journal.read_text().splitlines()
    for name in ("a.bin", "b.txt", "c/d.txt"):
        (dst / name).unlink()
    # A write in parts left by an earlier run (its token a temp file of a.bin), and
    # temp files of other writes that no journal may remove.
    token = ".fmstore-tmp." + "cd" * 16 + ".a.bin"
    (dst / token).write_bytes(bytes(3 << 20))
    lines += [json.dumps({"u": "a.bin", "t": token, "v": None, "z": 1 << 20}),
              json.dumps({"p": "a.bin", "t": token, "i": 1, "c": "00000000", "n": 1 << 20})]  # fmt: skip
    others = [dst / (".fmstore-tmp." + "ab" * 16 + ".b.txt"), dst / "c" / ".fmstore-tmp.x"]
    for p in others:
        p.write_bytes(b"another write's bytes")
    recs = [json.loads(ln) for ln in lines]
    kind = data.draw(st.sampled_from(["field", "json", "lines", "bytes"]))
    if kind == "field":
        rec = data.draw(st.sampled_from(recs))
        rec[data.draw(st.sampled_from(sorted(rec)))] = data.draw(JOURNAL_HOSTILE)
    elif kind == "json":
        i = data.draw(st.integers(0, len(recs) - 1))
        recs[i] = data.draw(json_mutation(recs[i]))
    elif kind == "lines":
        recs = data.draw(st.lists(st.sampled_from(recs), max_size=12))
    journal.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in recs))
    if kind == "bytes":
        apply_bytes(journal, data.draw(byte_mutation(journal.stat().st_size)))
    check_load(ex, ("dst", "home"), ex / "pwned", lambda: cli_one_line(*args))
    for p in others:
        assert p.read_bytes() == b"another write's bytes", p
