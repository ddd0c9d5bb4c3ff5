"""Property-based fuzzing of every on-disk format fmstore reads.

Real checkpoints (fmstore's own format, and the DCP format written through fmstore's
``Writer``) and real datasets of every supported format are mutated: bytes of blobs and
shards flipped, truncated or extended; fields of manifests and indexes replaced by hostile
values (negative, huge, wrong types, deep nesting, NaN) or removed; pickles planted where a
loader might run them.  Every load must then either succeed or raise an fmstore error
(``FmstoreError``), write nothing outside its target and cache, run no planted code, and stay
within a hard address-space limit (``RLIMIT_AS``, a few GiB above the process's size).

Budget: ``FMSTORE_FUZZ_EXAMPLES`` examples per test (15 by default, ``make fuzz``: 2000;
derandomized so CI runs are reproducible); set it higher for a longer search.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from fuzz_support import (
    FUZZ,
    Evil,
    apply_bytes,
    byte_mutation,
    check_load,
    cli_one_line,
    json_mutation,
)
from hypothesis import given
from hypothesis import strategies as st
from loader_helpers import write_jsonl
from peer_libs import import_mds_writer
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import fmstore
from fmstore.checkpoint.dcp import Reader, Writer
from fmstore.checkpoint.dcp.api import inspect_checkpoint, load_full_state_dict, verify_checkpoint
from fmstore.errors import FmstoreError
from fmstore.format.checksum import crc32c
from fmstore.loaders import StreamingDataset, write_dataset
from fmstore.protocol.env import Env

pytestmark = pytest.mark.fuzz


def _write_json(path: Path, doc: Any) -> None:
    # allow_nan: hostile manifests carry bare NaN tokens too.
    path.write_text(json.dumps(doc, allow_nan=True))


def _data_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json"
                  and p.name != "index.json")  # fmt: skip


# ---- the real inputs, written once ---------------------------------------------------------


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("originals")
    out: dict[str, Path] = {}
    shared = torch.randn(32, 16)
    state = {
        "model": {"w": shared, "tied": shared, "view": shared[2:5, 1:], "b": torch.arange(7),
                  "h": torch.randn(40, dtype=torch.float64).to(torch.bfloat16)},
        "optim": {"step": 3, "lr": 0.1, "betas": (0.9, 0.99), "name": "adam", "raw": b"\x00\x01",
                  "nan": float("nan"), "dtype": torch.float16, "size": torch.Size([2, 3])},
        "np": np.arange(6, dtype=np.int32),
        "lst": [1, "two", None, [3.5]],
    }  # fmt: skip
    for comp in ("raw", "zstd", "bytegroup+zstd"):
        out[f"ckpt-{comp}"] = base / f"ckpt-{comp}"
        fmstore.save(state, str(out[f"ckpt-{comp}"]), compression=comp, chunk_size=4096)
    out["dcp"] = base / "dcp"
    dcp.save(
        {"w": torch.randn(64, 8), "b": torch.arange(10, dtype=torch.int64),
         "meta": {"step": 5, "tags": ["a", "b"]}},
        storage_writer=Writer(str(out["dcp"]), chunk_size=4096, compression="zstd"),
        no_dist=True,
    )  # fmt: skip
    src = write_jsonl(base / "src.jsonl", 120)
    for comp in (None, "zstd"):
        out[f"fmsds-{comp}"] = base / f"fmsds-{comp}"
        write_dataset(src, str(out[f"fmsds-{comp}"]), shard_size=1500, compression=comp)
    np.save(base / "tok.npy", (np.arange(4000) % 50_000).astype(np.uint16))
    out["tokens"] = base / "tokens"
    write_dataset(base / "tok.npy", str(out["tokens"]), shard_size=2000)
    out["npy"] = base / "npy"
    out["npy"].mkdir()
    np.save(out["npy"] / "a.npy", np.arange(3000, dtype=np.uint16))
    (np.arange(2000, dtype=np.uint16) * 3).tofile(out["npy"] / "b.bin")
    out["wds"] = base / "wds"
    out["wds"].mkdir()
    for shard in range(2):
        with tarfile.open(out["wds"] / f"data-{shard}.tar", "w") as tf:
            for j in range(12):
                for ext, data in (("txt", f"text {shard} {j}".encode()), ("bin", bytes(j + 1))):
                    info = tarfile.TarInfo(f"s{shard}_{j:03d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    MDSWriter = import_mds_writer()
    if MDSWriter is not None:
        for comp in (None, "zstd"):
            out[f"mds-{comp}"] = base / f"mds-{comp}"
            cols = {"id": "int", "text": "str", "arr": "ndarray:int32:2,3", "meta": "json"}
            with MDSWriter(out=str(out[f"mds-{comp}"]), columns=cols, compression=comp,
                           size_limit=1500) as w:  # fmt: skip
                for i in range(60):
                    w.write({"id": i, "text": "t" * (i % 9), "meta": {"i": i},
                             "arr": np.full((2, 3), i, dtype=np.int32)})  # fmt: skip
    return out


@pytest.fixture
def work(tmp_path: Path) -> Path:
    return tmp_path


def _fresh(work: Path, original: Path) -> tuple[Path, Path]:
    """A clean example directory holding a copy of ``original`` as ``target``."""
    ex = work / "ex"
    shutil.rmtree(ex, ignore_errors=True)
    ex.mkdir()
    shutil.copytree(original, ex / "target")
    return ex, ex / "target"


# ---- fmstore checkpoints ------------------------------------------------------------------


def _load_fmstore_every_way(uri: str) -> Callable[[], None]:
    def go() -> None:
        for kw in ({}, {"mmap": True}, {"keys": "model*"}, {"lazy": True}):
            try:
                x = fmstore.load(uri, **kw)
                if kw.get("lazy") and hasattr(x, "materialize"):
                    x.materialize()
            except FmstoreError:
                pass
        cli_one_line("ckpt", "verify", uri)
        cli_one_line("ckpt", "inspect", uri)

    return go


CKPTS = ["ckpt-raw", "ckpt-zstd", "ckpt-bytegroup+zstd"]


@pytest.mark.parametrize("which", CKPTS)
@FUZZ
@given(data=st.data())
def test_fmstore_checkpoint_with_hostile_manifest_fields(originals, work, which, data):
    ex, target = _fresh(work, originals[which])
    doc = json.loads((target / "manifest.json").read_text())
    _write_json(target / "manifest.json", data.draw(json_mutation(doc)))
    check_load(ex, ("target",), ex / "pwned", _load_fmstore_every_way(str(target)))


@pytest.mark.parametrize("which", CKPTS)
@FUZZ
@given(data=st.data())
def test_fmstore_checkpoint_with_damaged_blobs(originals, work, which, data):
    ex, target = _fresh(work, originals[which])
    f = data.draw(st.sampled_from(_data_files(target)))
    apply_bytes(f, data.draw(byte_mutation(f.stat().st_size)))
    check_load(ex, ("target",), ex / "pwned", _load_fmstore_every_way(str(target)))


@FUZZ
@given(data=st.data())
def test_fmstore_checkpoint_with_a_planted_pickle(originals, work, data):
    """A tree leaf turned into a pickle reference whose bytes would run code: refused by
    default, so nothing runs, whatever else the manifest says."""
    ex, target = _fresh(work, originals["ckpt-raw"])
    doc = json.loads((target / "manifest.json").read_text())
    evil = __import__("pickle").dumps(Evil(str(ex / "pwned")))
    name = "planted.bin"
    (target / doc["generation"] / name).write_bytes(evil)
    doc["blobs"].append({"name": name, "size": len(evil)})
    doc["storages"].append({"nbytes": len(evil), "device": "cpu", "chunks": [
        {"blob": len(doc["blobs"]) - 1, "offset": 0, "length": len(evil), "raw_offset": 0,
         "raw": len(evil), "codec": "raw", "crc32c": crc32c(evil)}]})  # fmt: skip
    doc["tensors"].append({"name": "planted", "storage": len(doc["storages"]) - 1,
                           "dtype": "uint8", "shape": [len(evil)], "stride": [1], "offset": 0})  # fmt: skip
    doc["pickled"] = data.draw(st.booleans())
    doc["tree"]["dict"].append(["planted", {"pickle": len(doc["tensors"]) - 1}])
    if data.draw(st.booleans()):
        doc = data.draw(json_mutation(doc))
    _write_json(target / "manifest.json", doc)
    check_load(ex, ("target",), ex / "pwned", _load_fmstore_every_way(str(target)))


# ---- DCP checkpoints -------------------------------------------------------------------------


def _load_dcp_every_way(uri: str) -> Callable[[], None]:
    def go() -> None:
        for fn in (
            lambda: load_full_state_dict(uri),
            lambda: _read_with_default_planner(uri),
            lambda: verify_checkpoint(uri),
            lambda: inspect_checkpoint(uri),
        ):
            with contextlib.suppress(FmstoreError):
                fn()
        cli_one_line("ckpt", "inspect", uri)
        cli_one_line("ckpt", "verify", uri)

    return go


def _read_with_default_planner(uri: str) -> None:
    """torch's DefaultLoadPlanner over the Reader (the planner that torch.load()s BYTE_IO
    values with weights_only=False), without DCP's exception wrapping."""
    target = {"w": torch.zeros(64, 8), "b": torch.zeros(10, dtype=torch.int64),
              "meta": {"step": 0, "tags": ["", ""]}}  # fmt: skip
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
def test_dcp_checkpoint_with_hostile_manifest_fields(originals, work, data):
    ex, target = _fresh(work, originals["dcp"])
    doc = json.loads((target / "manifest.json").read_text())
    _write_json(target / "manifest.json", data.draw(json_mutation(doc)))
    check_load(ex, ("target",), ex / "pwned", _load_dcp_every_way(str(target)))


@FUZZ
@given(data=st.data())
def test_dcp_checkpoint_with_damaged_blobs(originals, work, data):
    ex, target = _fresh(work, originals["dcp"])
    f = data.draw(st.sampled_from(_data_files(target)))
    apply_bytes(f, data.draw(byte_mutation(f.stat().st_size)))
    check_load(ex, ("target",), ex / "pwned", _load_dcp_every_way(str(target)))


@FUZZ
@given(data=st.data())
def test_dcp_checkpoint_with_planted_pickles(originals, work, data):
    """Pickles in a BYTE_IO item (torch.save'd, as DCP writes them) and in the planner data."""
    ex, target = _fresh(work, originals["dcp"])
    doc = json.loads((target / "manifest.json").read_text())
    marker = str(ex / "pwned")
    buf = io.BytesIO()
    torch.save(Evil(marker), buf)
    evil = buf.getvalue()
    name = "planted.bin"
    (target / doc["generation"] / name).write_bytes(evil)
    doc["blobs"].append({"name": name, "size": len(evil), "rank": 0})
    items = [it for it in doc["items"] if it["kind"] == "bytes"]
    item = data.draw(st.sampled_from(items))
    item["nbytes"] = len(evil)
    item["chunks"] = [{"blob": len(doc["blobs"]) - 1, "offset": 0, "length": len(evil),
                       "raw_offset": 0, "raw": len(evil), "codec": "raw", "crc32c": crc32c(evil)}]  # fmt: skip
    if data.draw(st.booleans()):
        raw = __import__("pickle").dumps(Evil(marker))
        doc["planner_data"] = {"__pickle__": __import__("base64").b64encode(raw).decode()}
    if data.draw(st.booleans()):
        doc = data.draw(json_mutation(doc))
    _write_json(target / "manifest.json", doc)
    check_load(ex, ("target",), ex / "pwned", _load_dcp_every_way(str(target)))


# ---- datasets -------------------------------------------------------------------------------

#: Dataset originals and the options that read them.
DATASETS: dict[str, dict[str, Any]] = {
    "fmsds-None": {},
    "fmsds-zstd": {},
    "tokens": {"seq_len": 16},
    "npy": {"seq_len": 16, "dtype": "uint16"},
    "wds": {},
    "mds-None": {},
    "mds-zstd": {},
}


def _need(originals: dict[str, Path], which: str) -> Path:
    if which not in originals:
        pytest.skip(f"{which}: its writer is not installed")
    return originals[which]


def _read_dataset(remote: str, cache: str, kw: dict[str, Any]) -> Callable[[], None]:
    def go() -> None:
        try:
            ds = StreamingDataset(remote, cache, shuffle=False, batch_size=4, **kw)
            for _ in ds:
                pass
        except FmstoreError:
            pass
        cli_one_line("dataset", "inspect", remote)

    return go


@pytest.mark.parametrize("which", [w for w in DATASETS if w not in ("wds", "npy")])
@FUZZ
@given(data=st.data())
def test_dataset_with_hostile_index_fields(originals, work, which, data):
    ex, target = _fresh(work, _need(originals, which))
    doc = json.loads((target / "index.json").read_text())
    _write_json(target / "index.json", data.draw(json_mutation(doc)))
    check_load(ex, ("target", "cache"), ex / "pwned",
           _read_dataset(str(target), str(ex / "cache"), DATASETS[which]))  # fmt: skip


@pytest.mark.parametrize("which", list(DATASETS))
@FUZZ
@given(data=st.data())
def test_dataset_with_damaged_shards(originals, work, which, data):
    ex, target = _fresh(work, _need(originals, which))
    f = data.draw(st.sampled_from(_data_files(target)))
    apply_bytes(f, data.draw(byte_mutation(f.stat().st_size)))
    check_load(ex, ("target", "cache"), ex / "pwned",
           _read_dataset(str(target), str(ex / "cache"), DATASETS[which]))  # fmt: skip


@FUZZ
@given(data=st.data())
def test_webdataset_with_a_hostile_member_table_in_the_cache(originals, work, data):
    """The tar member tables kept beside the node cache are files too, and may be edited."""
    ex, target = _fresh(work, originals["wds"])
    cache = ex / "cache"
    StreamingDataset(str(target), str(cache))  # writes .meta/wds-index.json
    meta = cache / ".meta" / "wds-index.json"
    _write_json(meta, data.draw(json_mutation(json.loads(meta.read_text()))))
    check_load(ex, ("target", "cache"), ex / "pwned", _read_dataset(str(target), str(cache), {}))


# ---- records of sharded checkpoints: part records, leases, rank records -----------------------


def _records() -> dict[str, bytes]:
    from fmstore.checkpoint.dcp.nodes import RankRecord
    from fmstore.protocol.records import ExportLease, PartRecord

    gen = "g000000000001-00000001"
    return {
        "part": PartRecord("n0", (0, 1), gen, "0" * 64, (("000000.bin", 10, 7),)).dumps(),
        "lease": ExportLease("n0", os.getpid(), 1.7e9).dumps(),
        "rank": RankRecord(gen, "s", 0, "n0", (("000000.bin", 10),), nodes=("n0", "n1")).dumps(),
    }


@FUZZ
@given(data=st.data())
def test_records_with_hostile_fields(tmp_path_factory, data):
    """A part record, lease or rank record with hostile fields parses to one checked
    record or is one fmstore error; a lease that parses answers ``alive()`` without
    raising (a pid of 10**30, a renewal at NaN); ``gc`` over it ends in a report."""
    from fmstore.checkpoint.dcp.nodes import RankRecord
    from fmstore.checkpoint.gc import gc
    from fmstore.protocol.records import ExportLease, PartRecord, is_node_id

    kind = data.draw(st.sampled_from(["part", "lease", "rank"]))
    doc = data.draw(json_mutation(json.loads(_records()[kind])))
    raw = json.dumps(doc, allow_nan=True).encode()
    cls = {"part": PartRecord, "lease": ExportLease, "rank": RankRecord}[kind]
    try:
        rec = cls.loads(raw, where="x")
    except FmstoreError:
        rec = None
    if rec is not None:
        assert is_node_id(rec.node)
        if isinstance(rec, ExportLease):
            assert rec.alive(Env()) in (True, False)
    root = tmp_path_factory.mktemp("records")
    gen = root / "step_000000000001" / "g000000000001-00000001"
    gen.mkdir(parents=True)
    (gen / "000000.bin").write_bytes(b"x" * 10)
    name = {"part": "part-n0.json", "lease": "export-n0.json", "rank": "rank-000000.json"}[kind]
    (gen / name).write_bytes(raw)
    rep = gc(str(root), dry_run=True, older_than=0)
    assert rep.dry_run
