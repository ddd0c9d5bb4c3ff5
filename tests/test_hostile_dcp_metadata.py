"""Hostile DCP checkpoints: native ``.metadata`` pickles (a deep list DAG, missing fields,
an item listing one zip member many times or holding a deflated archive) and fmstore's own
DCP manifests (a value holding a deflated archive, fields of a wrong type or range, a replica
manifest with a bool world size).  Each is built from a real checkpoint (written by torch
or fmstore) and refused with one fmstore error, within a memory limit where the attack is
an allocation; a native checkpoint still loads after the checks."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hostile_helpers import LimitedCases
from stage_data import fm_here
from torch.distributed.checkpoint import metadata as dmd
from zip_support import inflating_bomb, listed_again

import fmstore
from fmstore import runtime
from fmstore.checkpoint.dcp.native import read_native
from fmstore.errors import CorruptData
from fmstore.stores import open_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


#: Hostile loads run under a memory limit, all of this module's in one fresh interpreter
#: (see ``hostile_helpers.LimitedCases``).
LIMITED = LimitedCases()


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """name -> (its directory, one result per ``report`` call) of every limited case."""
    return LIMITED.run(tmp_path_factory, inflating_bomb())


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


@LIMITED.case
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


@LIMITED.case
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


@LIMITED.case
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


def _dcp_manifest(world_size: int = 2) -> dict:
    from torch.distributed.checkpoint.metadata import Metadata

    from fmstore.checkpoint.dcp.manifest import DcpBlob, DcpManifest
    from fmstore.checkpoint.layout import new_generation

    m = DcpManifest.from_metadata(
        Metadata(state_dict_metadata={}),
        generation=new_generation(),
        world_size=world_size,
        items=[],
        blobs=[DcpBlob(f"{r:06d}.bin", 0, r) for r in range(world_size)],
        allow_pickle=False,
        writer="test",
    )
    return json.loads(m.dumps())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("world_size", 10**12),
        ("world_size", 1e300),
        ("world_size", True),
        ("world_size", "2"),
        ("world_size", 0),
        ("generation", {"a": 1}),
        ("generation", "../../x"),
        ("created", float("inf")),
        ("created", "yesterday"),
    ],
)
def test_dcp_manifest_fields_of_a_wrong_type_or_range_are_refused(field, value):
    from fmstore.checkpoint.dcp.manifest import DcpManifest

    doc = _dcp_manifest()
    doc[field] = value
    data = json.dumps(doc).encode()
    with pytest.raises(CorruptData, match="manifest.json"):
        DcpManifest.loads(data, where="x/manifest.json")


def test_a_replica_manifest_with_a_bool_world_size_holds_nothing(posix_cfg, tmp_path):
    from fmstore.checkpoint.dcp.nodes import rank_record_key
    from fmstore.checkpoint.dcp.replicas import held

    doc = _dcp_manifest(world_size=1)
    rep = tmp_path / "nvme" / ".replicas" / "run" / "step_00000001"
    (rep / doc["generation"]).mkdir(parents=True)
    (rep / rank_record_key(doc["generation"], 0)).write_text("{}")
    (rep / "manifest.json").write_text(json.dumps(doc))
    assert runtime.run(held("nvme:run/step_00000001", {}))[1] == (0,)
    doc["world_size"] = True  # 1 to int(): a manifest of no valid type
    (rep / "manifest.json").write_text(json.dumps(doc))
    assert runtime.run(held("nvme:run/step_00000001", {})) == (None, ())
