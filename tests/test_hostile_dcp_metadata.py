"""Hostile input, third round: native DCP metadata and zip members, torch.save and
safetensors files given to ``ckpt convert``, Hugging Face directories holding FIFOs,
Parquet footers, and resume journals.

Each test builds the hostile file from a real one (written by torch, safetensors, pyarrow or
fmstore itself) and checks that fmstore refuses it with one fmstore error, within a memory
limit where the attack is an allocation, without hanging where it is a FIFO.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import textwrap
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hostile_helpers import run_limited
from stage_data import fm_here
from torch.distributed.checkpoint import metadata as dmd
from zip_support import deflated, listed_again, torch_bytes

import fmstore
from fmstore import runtime
from fmstore.checkpoint.dcp.native import read_native
from fmstore.checkpoint.zipguard import check_torch_zip
from fmstore.errors import CorruptData
from fmstore.stores import open_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A 5 MB torch.save file of a 1 GiB tensor of zeros: its storage member deflated
    (torch.save stores members; torch inflates whatever it is given)."""
    n, small = 256 << 20, 123457
    src = io.BytesIO(torch_bytes(torch.zeros(small)))
    out = io.BytesIO()
    with (
        zipfile.ZipFile(src) as z,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as dst,
    ):
        for info in z.infolist():
            data = z.read(info)
            if info.filename.endswith("/data/0"):
                piece = bytes(1 << 20)
                with dst.open(info.filename, "w", force_zip64=True) as w:
                    for _ in range(n * 4 >> 20):
                        w.write(piece)
                continue
            if info.filename.endswith("/data.pkl"):  # the storage's and the tensor's sizes
                data = data.replace(b"J" + struct.pack("<i", small), b"J" + struct.pack("<i", n))
            dst.writestr(info.filename, data)
    return out.getvalue()


#: Hostile loads run under a memory limit, all in one fresh interpreter (starting one
#: costs seconds): name -> a function preparing the input in a directory of its own and
#: returning the ``report(...)`` calls to run there (see ``hostile_helpers.run_limited``).
LIMITED: dict[str, Callable[[Path, bytes], str]] = {}


def limited_case(fn: Callable[[Path, bytes], str]) -> Callable[[Path, bytes], str]:
    LIMITED[fn.__name__.removeprefix("_case_")] = fn
    return fn


@pytest.fixture(scope="module")
def limited(tmp_path_factory, bomb) -> dict[str, tuple[Path, list[dict]]]:
    """name -> (its directory, one result per ``report`` call) of every limited case."""
    dirs, bodies, counts = {}, [], []
    for name, prepare in LIMITED.items():
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


def test_check_torch_zip_accepts_torch_save_output(tmp_path):
    data = torch_bytes({"a": torch.arange(10), "b": [1, "x"]})
    check_torch_zip(data, name="a.pt")
    (tmp_path / "a.pt").write_bytes(data)
    check_torch_zip(tmp_path / "a.pt", name="a.pt")
    with open(tmp_path / "a.pt", "rb") as f:
        f.seek(7)
        check_torch_zip(f, name="a.pt")
        assert f.tell() == 7


def test_check_torch_zip_refusals(tmp_path):
    good = torch_bytes(torch.arange(100))
    with pytest.raises(CorruptData, match="x.pt .*listed more than once"):
        check_torch_zip(listed_again(good, "data/0", 3), name="x.pt")
    with pytest.raises(CorruptData, match="compressed"):
        check_torch_zip(deflated(good), name="x.pt")
    with pytest.raises(CorruptData, match="not a zip archive"):
        check_torch_zip(pickle.dumps({"a": 1}), name="x.pt")
    with pytest.raises(CorruptData, match="no .*data.pkl"):
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            z.writestr("archive/other", b"x")
        check_torch_zip(out.getvalue(), name="x.pt")
    os.mkfifo(tmp_path / "fifo.pt")
    with pytest.raises(CorruptData, match="not a regular file"):
        check_torch_zip(tmp_path / "fifo.pt", name="fifo.pt")


# ---- native DCP checkpoints ---------------------------------------------------------------


def _native(path: Path) -> dict:
    st = {"model": {"w": torch.randn(64, 32), "b": torch.zeros(7)}, "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(st, storage_writer=dcp.FileSystemWriter(str(path)))
    return st


def _rewrite_metadata(path: Path, change) -> None:
    md = pickle.loads((path / ".metadata").read_bytes())  # written by torch in this test
    md = change(md) or md
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _replace_item(path: Path, fqn: str, make) -> None:
    """Append ``make(old item bytes)`` to the item's data file and point the metadata at it."""
    md = pickle.loads((path / ".metadata").read_bytes())
    idx, info = next((i, v) for i, v in md.storage_data.items() if i.fqn == fqn)
    f = path / info.relative_path
    data = f.read_bytes()
    new = make(data[info.offset : info.offset + info.length])
    info.offset, info.length = len(data), len(new)
    f.write_bytes(data + new)
    (path / ".metadata").write_bytes(pickle.dumps(md))


@limited_case
def _case_dag(d: Path, bomb: bytes) -> str:
    _native(d / "c")
    dag: list = []
    for _ in range(40):
        dag = [dag, dag]  # repr() of this has 2**40 pieces; the pickle ~1 KB

    def plant(md):
        next(iter(md.storage_data.values())).relative_path = dag

    _rewrite_metadata(d / "c", plant)
    assert (d / "c" / ".metadata").stat().st_size < 4096
    return f"""
        from fmstore.checkpoint.dcp.api import inspect_checkpoint
        report(lambda: fmstore.load({str(d / "c")!r}))
        report(lambda: inspect_checkpoint({str(d / "c")!r}))
    """


def test_metadata_with_a_deep_list_dag_is_refused_at_once(limited):
    for r in limited["dag"][1]:
        assert r["fmstore"] and r["error"] == "CorruptData", r
        assert "bad file, offset or length" in r["msg"] and len(r["msg"]) < 1000


def test_metadata_without_fields_is_corrupt_data(tmp_path, monkeypatch):
    _native(tmp_path / "c")
    _rewrite_metadata(tmp_path / "c", lambda md: dmd.Metadata.__new__(dmd.Metadata))
    with pytest.raises(CorruptData, match="state_dict_metadata or storage_data is missing"):
        fmstore.load(tmp_path / "c")

    def hollow(md):  # every tensor entry without its attributes, every index without its own
        for k in md.state_dict_metadata:
            md.state_dict_metadata[k] = dmd.TensorStorageMetadata.__new__(dmd.TensorStorageMetadata)

    _native(tmp_path / "d")
    _rewrite_metadata(tmp_path / "d", hollow)
    with pytest.raises(CorruptData, match="is not a tensor's metadata"):
        fmstore.load(tmp_path / "d")
    monkeypatch.setenv("COLUMNS", "200")
    r = fm_here("ckpt", "inspect", str(tmp_path / "d"))
    assert r.returncode == 1 and r.stderr.startswith("error:") and "Traceback" not in r.stderr


def test_metadata_is_parsed_off_the_event_loop(tmp_path, monkeypatch):
    import threading

    from fmstore.checkpoint.dcp import native

    _native(tmp_path / "c")
    threads = []
    real = native._checked

    def spy(md, where):
        threads.append(threading.current_thread().name)
        return real(md, where)

    monkeypatch.setattr(native, "_checked", spy)
    store = open_store(str(tmp_path / "c"))
    try:
        runtime.run(read_native(store))
    finally:
        runtime.run(store.close())
    assert threads and "fmstore-loop" not in threads  # a big pickle would hold every transfer


def test_item_listing_one_member_many_times_is_refused(tmp_path, monkeypatch):
    _native(tmp_path / "c")
    _replace_item(tmp_path / "c", "model.w", lambda b: listed_again(b, "data/0", 2000))
    for verify in (True, False):
        with pytest.raises(CorruptData, match="model.w.*listed more than once"):
            fmstore.load(tmp_path / "c", verify=verify)
    monkeypatch.setenv("COLUMNS", "200")
    r = fm_here("ckpt", "verify", str(tmp_path / "c"))
    assert r.returncode == 1 and "listed more than once" in r.stdout + r.stderr


@limited_case
def _case_deflated_item(d: Path, bomb: bytes) -> str:
    _native(d / "c")
    # model.b is 7 floats; its item becomes the 5 MB archive of a 1 GiB tensor, which torch
    # would inflate whole before the shape check (beyond the memory limit of the load).
    _replace_item(d / "c", "model.b", lambda b: bomb)
    assert (d / "c" / "__0_0.distcp").stat().st_size < 8 << 20
    return f"""
        report(lambda: fmstore.load({str(d / "c")!r}, verify=False))
        report(lambda: fmstore.load({str(d / "c")!r}))
    """


def test_deflated_item_is_refused_before_inflating(limited):
    for r in limited["deflated_item"][1]:
        assert r["fmstore"] and r["error"] == "CorruptData", r
        assert "model.b" in r["msg"] and "compressed" in r["msg"]


def test_native_checkpoint_still_loads_after_the_checks(tmp_path):
    want = _native(tmp_path / "c")
    got = fmstore.load(tmp_path / "c", verify=False)
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and got["step"] == 3
    store = open_store(str(tmp_path / "c"))
    try:
        ck = runtime.run(read_native(store))
    finally:
        runtime.run(store.close())
    assert ck.metadata.planner_data == {
        "model.w": ("model", "w"),
        "model.b": ("model", "b"),
        "step": ("step",),
    }


# ---- ckpt convert of torch.save and safetensors files -------------------------------------


@pytest.fixture
def fm(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    return fm_here


def _one_error_line(r) -> str:
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    return lines[0]


@limited_case
def _case_deflated_pt(d: Path, bomb: bytes) -> str:
    (d / "x.pt").write_bytes(bomb)
    return f"""
        from fmstore.checkpoint.convert import convert
        report(lambda: convert({str(d / "x.pt")!r}, {str(d / "y")!r}))
    """


def test_convert_of_a_deflated_pt_is_refused(limited):
    d, res = limited["deflated_pt"]
    assert res[0]["fmstore"] and res[0]["error"] == "CorruptData", res
    assert "x.pt" in res[0]["msg"] and "compressed" in res[0]["msg"]
    assert not (d / "y").exists()


def test_convert_of_garbage_files_is_one_error_line(tmp_path, fm):
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}")
    line = _one_error_line(
        fm("ckpt", "convert", str(tmp_path / "bad.safetensors"), str(tmp_path / "out.pt"))
    )
    assert "bad.safetensors" in line
    (tmp_path / "bad.pt").write_bytes(pickle.dumps({"a": 1})[:-3])
    line = _one_error_line(
        fm("ckpt", "convert", str(tmp_path / "bad.pt"), str(tmp_path / "out.safetensors"))
    )
    assert "bad.pt" in line
    # a zip archive that passes the member checks but whose pickle torch refuses
    arch = io.BytesIO()
    with zipfile.ZipFile(arch, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02cos\nsystem\nq\x00.")
    (tmp_path / "evil.pt").write_bytes(arch.getvalue())
    line = _one_error_line(
        fm("ckpt", "convert", str(tmp_path / "evil.pt"), str(tmp_path / "out.safetensors"))
    )
    assert "evil.pt" in line
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "out.pt").exists()


# ---- resume journals ----------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An isolated FMSTORE_HOME (state dir, default tiers) for in-process CLI runs."""
    from fmstore.config import set_config

    monkeypatch.setenv("FMSTORE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FMSTORE_CONFIG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    set_config(None)
    yield tmp_path / "home"
    set_config(None)


def _staged_once(tmp_path: Path, home: Path, size: int) -> tuple[Path, Path, Path]:
    """A source holding ``a.bin`` staged once; returns (source, destination, journal)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(size))
    r = fm_here("stage", str(src), str(dst), "--part-size", "1MiB", "--no-progress")
    assert r.returncode == 0, r.stderr
    (journal,) = (home / "state" / "transfers").glob("*.jsonl")
    return src, dst, journal


@pytest.mark.parametrize(
    "line",
    [
        "5",
        '{"p":"a.bin"}',
        '{"u":"a.bin","t":"x"}',
        '{"y":"zz"}',
        '{"f":["x"]}',
        '{"p":"a.bin","t":"x","i":-1,"c":"00000000","n":1}',
        '{"b":true}',
    ],
)
def test_a_bad_journal_line_is_one_error(tmp_path, home, line):
    src, dst, journal = _staged_once(tmp_path, home, 1000)
    journal.write_text('{"to":"x"}\n' + line + "\n")
    r = fm_here("stage", str(src), str(dst), "--no-progress")
    err = _one_error_line(r)
    assert "resume journal" in err and "line 2" in err and str(journal) in err


def test_a_journal_token_cannot_remove_another_files_temp(tmp_path, home):
    src, dst, journal = _staged_once(tmp_path, home, 3 << 20)
    (dst / "a.bin").unlink()  # copied again, in parts, from the journal's pending write
    sibling = dst / f".fmstore-tmp.{'ab' * 16}.b.bin"
    sibling.write_bytes(b"another copy's bytes")
    rec = {"u": "a.bin", "t": sibling.name, "v": "other", "z": 1 << 20}
    journal.write_text(json.dumps(rec) + "\n")
    r = fm_here("stage", str(src), str(dst), "--part-size", "1MiB", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert sibling.read_bytes() == b"another copy's bytes"
    assert (dst / "a.bin").read_bytes() == (src / "a.bin").read_bytes()


# ---- Hugging Face directories -------------------------------------------------------------


@limited_case
def _case_fifo(d: Path, bomb: bytes) -> str:
    from safetensors.torch import save_file

    single = d / "single"
    single.mkdir()
    os.mkfifo(single / "model.safetensors")
    sharded = d / "sharded"
    sharded.mkdir()
    save_file({"a": torch.zeros(3)}, str(sharded / "model-00001-of-00002.safetensors"))
    os.mkfifo(sharded / "model-00002-of-00002.safetensors")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    # A FIFO opened without O_NONBLOCK waits for a writer for ever: the run's timeout.
    return f"""
        from fmstore.checkpoint.convert import convert
        report(lambda: convert({str(single)!r}, {str(d / "single.pt")!r}))
        report(lambda: convert({str(sharded)!r}, {str(d / "sharded.pt")!r}))
    """


def test_a_fifo_in_a_hugging_face_dir_is_refused_without_waiting(limited):
    res = limited["fifo"][1]
    assert [r["error"] for r in res] == ["CorruptData", "CorruptData"], res
    assert "model.safetensors is not a regular file" in res[0]["msg"]
    assert "model-00002-of-00002.safetensors is not a regular file" in res[1]["msg"]


# ---- Parquet footers ----------------------------------------------------------------------


def declaring_rows(rows: int, *, pad: int = 0) -> bytes:
    """A real Parquet file of 10 rows (one row group) whose footer declares ``rows`` rows
    (the file's and the row group's counts agreeing), ``pad`` bytes of slack before it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from thrift_compact import I64, field, join_parquet, split_parquet

    buf = io.BytesIO()
    pq.write_table(pa.table({"x": list(range(10))}), buf)
    body, md = split_parquet(buf.getvalue())
    field(md, 3)[2] = rows
    for rg in field(md, 4)[2][1]:
        assert field(rg, 3)[1] == I64
        field(rg, 3)[2] = rows
    return join_parquet(body + bytes(pad), md)


def test_parquet_footer_declaring_more_rows_than_its_bytes_hold_is_refused(tmp_path, fm):
    from fmstore.loaders import StreamingDataset

    d = tmp_path / "ds"
    d.mkdir()
    (d / "a.parquet").write_bytes(declaring_rows(1 << 40))
    assert (d / "a.parquet").stat().st_size < 1000
    with pytest.raises(CorruptData, match="1099511627776 rows in .* bytes"):
        StreamingDataset(str(d), local=str(tmp_path / "cache"))
    line = _one_error_line(fm("dataset", "inspect", str(d)))
    assert "a.parquet" in line and "rows a byte" in line


@limited_case
def _case_epoch_order(d: Path, bomb: bytes) -> str:
    # 2**30 rows in a 1 MiB file: believable by the bytes, 8 GiB an order array.
    (d / "ds").mkdir()
    (d / "ds" / "a.parquet").write_bytes(declaring_rows(1 << 30, pad=1 << 20))
    return f"""
        from fmstore.loaders import StreamingDataset
        ds = StreamingDataset({str(d / "ds")!r}, local={str(d / "cache")!r}, shuffle=False)
        report(lambda: next(iter(ds)))
    """


def test_an_epoch_order_too_big_for_memory_is_an_fmstore_error(limited):
    res = limited["epoch_order"][1]
    assert res[0]["fmstore"], res
    assert "does not fit in memory" in res[0]["msg"], res


@limited_case
def _case_dcp_value(d: Path, bomb: bytes) -> str:
    from fmstore.checkpoint.dcp import Writer
    from fmstore.format.checksum import crc32c

    uri = d / "c"
    dcp.save(
        {"w": torch.randn(4, 4), "meta": {"step": 5}}, storage_writer=Writer(str(uri)), no_dist=True
    )
    doc = json.loads((uri / "manifest.json").read_text())
    (uri / doc["generation"] / "planted.bin").write_bytes(bomb)
    doc["blobs"].append({"name": "planted.bin", "size": len(bomb), "rank": 0})
    item = next(it for it in doc["items"] if it["kind"] == "bytes")
    item["nbytes"] = len(bomb)
    item["chunks"] = [
        {
            "blob": len(doc["blobs"]) - 1,
            "offset": 0,
            "length": len(bomb),
            "raw_offset": 0,
            "raw": len(bomb),
            "codec": "raw",
            "crc32c": crc32c(bomb),
        }
    ]
    (uri / "manifest.json").write_text(json.dumps(doc))
    return f"""
        from fmstore.checkpoint.dcp.api import load_full_state_dict
        report(lambda: load_full_state_dict({str(uri)!r}))
        report(lambda: load_full_state_dict({str(uri)!r}, allow_pickle=True))
    """


def test_fmstore_dcp_value_holding_a_deflated_archive_is_refused(limited):
    for r in limited["dcp_value"][1]:
        assert r["fmstore"] and "compressed" in r["msg"], r
