"""Hostile checkpoints, datasets and catalogs: refused with one fmstore error naming the file
and the field, before anything is allocated, decompressed or unpickled."""

from __future__ import annotations

import io
import json
import os
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from hostile_helpers import read_json, replace_blob_bytes, run_limited, write_json, zstd_bomb
from loader_helpers import make_dataset, write_jsonl
from stage_data import fm_here
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import fmstore
from fmstore import runtime
from fmstore.checkpoint.dcp import Reader, Writer
from fmstore.errors import ConfigError, CorruptData
from fmstore.format.checksum import crc32c
from fmstore.loaders import StreamingDataset, write_dataset
from fmstore.stores import open_store
from fmstore.tiering.inventory.catalog import Catalog


def _cli(*args: str) -> tuple[int, str, str]:
    r = fm_here(*args)
    return r.returncode, r.stdout, r.stderr


def _one_line_error(code: int, err: str) -> None:
    assert code != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err


# ---- 1. no code runs from a crafted DCP checkpoint ------------------------------------


class _Evil:
    """Unpickling this creates the file ``path``: a stand-in for any code a pickle can run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


def _dcp_with_byte_io(root: Path, value: object) -> str:
    uri = str(root / "ckpt")
    sd = {"w": torch.arange(16, dtype=torch.float32), "meta": {"step": 7, "epoch": 2}}
    dcp.save(sd, storage_writer=Writer(uri), no_dist=True)
    m = read_json(Path(uri) / "manifest.json")
    item = next(it for it in m["items"] if it["kind"] == "bytes" and it["fqn"] == "meta.step")
    buf = io.BytesIO()
    torch.save(value, buf)
    data = buf.getvalue()
    name = "crafted.bin"
    (Path(uri) / m["generation"] / name).write_bytes(data)
    m["blobs"].append({"name": name, "size": len(data), "rank": 0})
    item["nbytes"] = len(data)
    item["chunks"] = [
        {"blob": len(m["blobs"]) - 1, "offset": 0, "length": len(data), "raw_offset": 0,
         "raw": len(data), "codec": "raw", "crc32c": crc32c(data)}
    ]  # fmt: skip
    write_json(Path(uri) / "manifest.json", m)
    return uri


def _dcp_load(uri: str, **reader_kw: object) -> dict:
    sd = {"w": torch.zeros(16), "meta": {"step": 0, "epoch": 0}}
    dcp.load(sd, storage_reader=Reader(uri, **reader_kw), no_dist=True)
    return sd


def _read_with_default_planner(uri: str) -> None:
    """The Reader under torch's DefaultLoadPlanner, without DCP's exception wrapping."""
    reader = Reader(uri)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"w": torch.zeros(16), "meta": {"step": 0, "epoch": 0}}, md, True)
    reader.read_data(planner.create_local_plan(), planner).wait()


def test_dcp_pickle_payload_runs_no_code_on_load(tmp_path):
    marker = tmp_path / "pwned"
    uri = _dcp_with_byte_io(tmp_path, _Evil(str(marker)))
    with pytest.raises(CorruptData, match=r"'meta.step'.*Unsupported global.*open.*allow_pickle"):
        _read_with_default_planner(uri)
    assert not marker.exists()
    with pytest.raises(BaseException, match="CorruptData") as e:  # DCP wraps rank errors
        _dcp_load(uri)
    assert "'meta.step'" in str(e.value)
    assert not marker.exists()


def test_dcp_pickle_payload_runs_no_code_in_ckpt_convert(tmp_path):
    marker = tmp_path / "pwned"
    uri = _dcp_with_byte_io(tmp_path, _Evil(str(marker)))
    code, _out, err = _cli("ckpt", "convert", uri, str(tmp_path / "out.safetensors"))
    _one_line_error(code, err)
    assert "meta.step" in err
    assert not marker.exists()
    assert not (tmp_path / "out.safetensors").exists()


def test_dcp_plain_byte_io_values_still_load(tmp_path):
    uri = str(tmp_path / "ok")
    sd = {"w": torch.arange(16, dtype=torch.float32), "meta": {"step": 7, "epoch": 2},
          "names": ["a", "b"], "cfg": {"lr": 0.5, "betas": (0.9, 0.99)}}  # fmt: skip
    dcp.save(sd, storage_writer=Writer(uri), no_dist=True)
    back = {"w": torch.zeros(16), "meta": {"step": 0, "epoch": 0}, "names": ["", ""],
            "cfg": {"lr": 0.0, "betas": (0.0, 0.0)}}  # fmt: skip
    dcp.load(back, storage_reader=Reader(uri), no_dist=True)
    assert back["meta"] == {"step": 7, "epoch": 2}
    assert back["names"] == ["a", "b"] and back["cfg"] == {"lr": 0.5, "betas": (0.9, 0.99)}
    assert torch.equal(back["w"], sd["w"])


def test_dcp_other_objects_load_only_with_allow_pickle(tmp_path):
    uri = _dcp_with_byte_io(tmp_path, Fraction(1, 3))
    with pytest.raises(CorruptData, match="allow_pickle"):
        _read_with_default_planner(uri)
    assert _dcp_load(uri, allow_pickle=True)["meta"]["step"] == Fraction(1, 3)


# ---- 2. decompression bombs -------------------------------------------------------------


def test_zstd_frame_declaring_more_than_expected_is_refused_before_decoding():
    from fmstore.format.codecs import zstd_decompress_exact

    bomb = zstd_bomb()
    assert len(bomb) < 64 << 10
    with pytest.raises(CorruptData, match="declares 1073741824 bytes, expected 4096"):
        zstd_decompress_exact(bomb, 4096)


def test_zstd_frame_without_declared_size_is_decoded_with_a_bound():
    from fmstore.format.codecs import zstd_decompress_exact

    bomb = zstd_bomb(64 << 20, declare=False)
    with pytest.raises(CorruptData, match="more than 4097 bytes"):
        zstd_decompress_exact(bomb, 4096)
    assert zstd_decompress_exact(zstd_bomb(4096, declare=False), 4096) == bytes(4096)


def _bomb_in_first_shard(remote: str) -> str:
    """Replace the first (zstd) shard with a 1 GiB bomb; the index keeps its raw size and
    gets the bomb's true size and checksum, so only the decompression bound can catch it."""
    index = read_json(Path(remote) / "index.json")
    shard = index["shards"][0]
    assert shard["compression"] == "zstd"
    bomb = zstd_bomb()
    (Path(remote) / shard["key"]).write_bytes(bomb)
    shard["bytes"] = len(bomb)
    shard["checksum"] = "xxh3_64:" + xxhash.xxh3_64_hexdigest(bomb)
    write_json(Path(remote) / "index.json", index)
    return shard["key"]


def test_decompression_bomb_shard_is_refused_within_bounded_memory(tmp_path):
    remote = make_dataset(tmp_path, 200, compression="zstd")
    key = _bomb_in_first_shard(remote)
    (res,) = run_limited(f"""
        from fmstore.loaders import StreamingDataset
        ds = StreamingDataset({remote!r}, {str(tmp_path / "cache")!r}, shuffle=False, direct_reads=0)
        report(lambda: list(ds))
    """)
    assert res["error"] == "CorruptData", res
    assert key in res["msg"] and "declares 1073741824 bytes" in res["msg"]


def test_decompression_bomb_chunk_is_refused_by_the_codec_fallback(tmp_path):
    # The public zstandard API (used where libzstd's cffi module is missing) is the one that
    # believed the frame's size.
    (res,) = run_limited(f"""
        from fmstore.format import codecs, zstdlib
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from hostile_helpers import zstd_bomb
        zstdlib.AVAILABLE = False
        bomb = zstd_bomb()
        out = memoryview(bytearray(4096))
        report(lambda: codecs.decode_into("zstd", bomb, out))
    """)
    assert res["error"] == "CorruptData", res


# ---- 3. sizes, offsets and views are checked against the bytes behind them -------------


def _ckpt(tmp_path: Path) -> tuple[str, dict]:
    uri = str(tmp_path / "ckpt")
    fmstore.save({"w": torch.arange(4096, dtype=torch.float32), "step": 3}, uri,
                 compression="raw")  # fmt: skip
    return uri, read_json(Path(uri) / "manifest.json")


def _tensor(doc: dict) -> dict:
    return next(t for t in doc["tensors"] if t["name"] == "w")


def _every_read_path(uri: str) -> str:
    """A body for run_limited: one report per read path."""
    return f"""
        uri = {uri!r}
        report(lambda: fmstore.load(uri))
        report(lambda: fmstore.load(uri, lazy=True)["w"])
        report(lambda: fmstore.load(uri, mmap=True))
        report(lambda: fmstore.load(uri, keys="w"))
    """


def _edit_storage_6gib(doc: dict) -> None:
    c = doc["storages"][0]["chunks"][0]
    c["raw"] = 6 << 30
    doc["storages"][0]["nbytes"] = 6 << 30
    _tensor(doc)["shape"] = [(6 << 30) // 4]


def _edit_unaligned_overhang(doc: dict) -> None:
    _tensor(doc).update(dtype="float16", offset=1, shape=[8192], stride=[1])


def _edit_huge_shape(doc: dict) -> None:
    _tensor(doc)["shape"] = [3_000_000_000]


def _edit_negative_offset(doc: dict) -> None:
    _tensor(doc)["offset"] = -3


def _edit_stride_overhang(doc: dict) -> None:
    _tensor(doc).update(shape=[64, 64], stride=[65, 1])


_EDITS = [_edit_storage_6gib, _edit_unaligned_overhang, _edit_huge_shape, _edit_negative_offset,
          _edit_stride_overhang]  # fmt: skip


@pytest.fixture(scope="module")
def edited_reads(tmp_path_factory) -> dict[str, list[dict]]:
    """edit -> the results of every read path of a checkpoint with that edit, all read in
    one capped interpreter (one start of torch for the five edits, not five)."""
    uris = {}
    for edit in _EDITS:
        uri, doc = _ckpt(tmp_path_factory.mktemp(edit.__name__[6:]))
        edit(doc)
        write_json(Path(uri) / "manifest.json", doc)
        uris[edit.__name__] = uri
    results = run_limited("".join(_every_read_path(u) for u in uris.values()))
    assert len(results) == 4 * len(uris), results
    return {name: results[4 * i : 4 * i + 4] for i, name in enumerate(uris)}


@pytest.mark.parametrize("edit", _EDITS, ids=lambda f: f.__name__[6:])
def test_views_and_sizes_beyond_the_blobs_are_refused_on_every_read_path(edited_reads, edit):
    results = edited_reads[edit.__name__]
    assert len(results) == 4
    for r in results:
        assert r["error"] == "CorruptData", r
        assert "manifest.json" in r["msg"], r


def test_compressed_chunk_claiming_more_than_zstd_can_hold_is_refused(tmp_path):
    uri = str(tmp_path / "z")
    fmstore.save({"w": torch.zeros(1 << 16, dtype=torch.int64)}, uri, compression="zstd")
    doc = read_json(Path(uri) / "manifest.json")
    c = doc["storages"][0]["chunks"][0]
    assert c["codec"] == "zstd"
    doc["storages"][0]["nbytes"] = c["raw"] = c["length"] * 40000
    _tensor(doc)["shape"] = [c["raw"] // 8]
    write_json(Path(uri) / "manifest.json", doc)
    with pytest.raises(CorruptData, match=r"storages\[0\]\.chunks\[0\].*cannot decode to"):
        fmstore.load(uri)


def test_zstd_chunk_bomb_in_a_checkpoint_is_refused(tmp_path):
    uri = str(tmp_path / "z")
    fmstore.save({"w": torch.zeros(1024, dtype=torch.int64)}, uri, compression="zstd")
    doc = read_json(Path(uri) / "manifest.json")
    replace_blob_bytes(uri, doc, 0, zstd_bomb(256 << 20))
    doc["storages"][0]["chunks"][0]["codec"] = "zstd"
    write_json(Path(uri) / "manifest.json", doc)
    with pytest.raises(CorruptData, match="'w'"):
        fmstore.load(uri)


def test_dcp_sizes_beyond_the_saved_bytes_are_refused(tmp_path):
    uri = str(tmp_path / "d")
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, storage_writer=Writer(uri),
             no_dist=True)  # fmt: skip
    doc = read_json(Path(uri) / "manifest.json")
    doc["state_dict_metadata"]["w"]["size"] = [3_000_000_000]
    doc["state_dict_metadata"]["w"]["chunks"][0]["sizes"] = [3_000_000_000]
    write_json(Path(uri) / "manifest.json", doc)
    (res,) = run_limited(f"""
        from fmstore.checkpoint.dcp.api import load_full_state_dict
        report(lambda: load_full_state_dict({uri!r}))
    """)
    assert res["error"] == "CorruptData" and "state_dict_metadata['w']" in res["msg"], res
    doc = read_json(Path(uri) / "manifest.json")
    doc["state_dict_metadata"]["w"]["size"] = [4096]
    doc["state_dict_metadata"]["w"]["chunks"][0]["sizes"] = [4096]
    item = doc["items"][0]
    item["shape"] = [3_000_000_000]
    write_json(Path(uri) / "manifest.json", doc)
    with pytest.raises(CorruptData, match=r"item 'w'.*nbytes"):
        Reader(uri).read_metadata()


def test_dataset_index_sizes_are_compared_with_the_objects(tmp_path):
    remote = make_dataset(tmp_path, 200)
    index = read_json(Path(remote) / "index.json")
    index["shards"][0]["bytes"] = index["shards"][0]["raw_bytes"] = 10 << 40
    write_json(Path(remote) / "index.json", index)
    with pytest.raises(CorruptData, match=r"index entry 0 lists 10995116277760 'bytes'") as e:
        StreamingDataset(remote, str(tmp_path / "cache"))
    assert e.value.key == "index.json"
    assert not os.path.exists(tmp_path / "cache") or not [
        f for f in os.listdir(tmp_path / "cache") if not f.startswith(".")
    ]


def test_compressed_shard_claiming_an_impossible_raw_size_is_refused(tmp_path):
    remote = make_dataset(tmp_path, 200, compression="zstd")
    index = read_json(Path(remote) / "index.json")
    index["shards"][0]["raw_bytes"] = 10 << 40
    write_json(Path(remote) / "index.json", index)
    with pytest.raises(CorruptData, match="cannot hold 10995116277760"):
        StreamingDataset(remote, str(tmp_path / "cache"))


# ---- 4. malformed input: one fmstore error naming the file and the field ----------------


def test_unknown_dtype_is_corrupt_data(tmp_path):
    uri, doc = _ckpt(tmp_path)
    _tensor(doc)["dtype"] = "object"
    write_json(Path(uri) / "manifest.json", doc)
    with pytest.raises(CorruptData, match=r"tensor 'w': unknown dtype 'object'") as e:
        fmstore.load(uri)
    assert e.value.key == "manifest.json" and uri in str(e.value)


def test_tensor_reference_out_of_range_is_corrupt_data(tmp_path):
    uri, doc = _ckpt(tmp_path)
    doc["tree"]["dict"][0][1] = {"tensor": 99}
    write_json(Path(uri) / "manifest.json", doc)
    with pytest.raises(CorruptData, match=r"tree\.dict\[0\]\.tensor: 99 is not a tensor index"):
        fmstore.load(uri)


def test_deep_nesting_is_corrupt_data(tmp_path):
    uri, doc = _ckpt(tmp_path)
    doc["tree"]["dict"].append(["deep", "DEEP"])
    for depth, why in ((300, "tree: .* nested deeper than 128 levels"), (900, "not JSON")):
        deep = '{"list":[' * depth + "null" + "]}" * depth
        text = json.dumps(doc).replace('"DEEP"', deep)
        (Path(uri) / "manifest.json").write_text(text)
        for kw in ({}, {"lazy": True}, {"keys": "w"}):
            with pytest.raises(CorruptData, match=why):
                fmstore.load(uri, **kw)
    # Nesting beyond what the JSON parser takes is refused the same way.
    (Path(uri) / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CorruptData, match="not JSON"):
        fmstore.load(uri)


def test_malformed_tree_node_is_corrupt_data(tmp_path):
    uri, doc = _ckpt(tmp_path)
    doc["tree"]["dict"].append(["x", {"bytes": "%%% not base64"}])
    write_json(Path(uri) / "manifest.json", doc)
    with pytest.raises(CorruptData, match="state tree does not decode"):
        fmstore.load(uri)


def test_negative_sample_count_is_corrupt_data(tmp_path):
    remote = make_dataset(tmp_path, 200)
    index = read_json(Path(remote) / "index.json")
    index["shards"][1]["samples"] = -5
    write_json(Path(remote) / "index.json", index)
    with pytest.raises(CorruptData, match=r"index entry 1 .*'samples' is negative") as e:
        StreamingDataset(remote, str(tmp_path / "cache"))
    assert e.value.key == "index.json"


def test_corrupt_catalog_is_corrupt_data_naming_it(tmp_path):
    path = tmp_path / "state" / "catalog.sqlite3"
    path.parent.mkdir()
    path.write_bytes(os.urandom(8192))
    with pytest.raises(CorruptData, match="not a readable fmstore catalog") as e:
        Catalog(str(path))
    assert e.value.key == str(path)


def test_ckpt_verify_refuses_tensors_that_do_not_fit_their_storage(tmp_path):
    uri, doc = _ckpt(tmp_path)
    _edit_unaligned_overhang(doc)
    write_json(Path(uri) / "manifest.json", doc)
    code, out, err = _cli("ckpt", "verify", uri)
    _one_line_error(code, err)
    assert "does not fit its storage" in err and "'w'" in err
    assert "ok" not in out


@pytest.mark.parametrize("cmd", ["inspect", "verify", "convert"])
def test_ckpt_commands_print_one_line_for_malformed_manifests(tmp_path, cmd):
    uri, doc = _ckpt(tmp_path)
    _tensor(doc)["dtype"] = "object"
    write_json(Path(uri) / "manifest.json", doc)
    extra = [str(tmp_path / "o.safetensors")] if cmd == "convert" else []
    code, _out, err = _cli("ckpt", cmd, uri, *extra)
    _one_line_error(code, err)
    assert "unknown dtype 'object'" in err


def test_dataset_inspect_prints_one_line_for_a_malformed_index(tmp_path):
    remote = make_dataset(tmp_path, 200)
    index = read_json(Path(remote) / "index.json")
    index["shards"][0]["samples"] = -5
    write_json(Path(remote) / "index.json", index)
    code, _out, err = _cli("dataset", "inspect", remote)
    _one_line_error(code, err)
    assert "index entry 0" in err


def test_token_dtype_from_index_that_numpy_does_not_know_is_config_error(tmp_path):
    from fmstore.loaders.formats.tokens import check_options

    with pytest.raises(ConfigError, match="token dtype"):
        check_options("not-a-dtype", 8)


# ---- the same checks on S3 (ranged reads, listings, no local files) ---------------------------


@pytest.mark.s3
def test_hostile_index_and_manifest_on_s3_are_refused(tmp_path, s3_server, s3_bucket, s3_store):
    opts = s3_server.store_options()
    src = write_jsonl(tmp_path / "src.jsonl", 200)
    ds_store = open_store(f"s3://{s3_bucket}/ds", **opts)
    write_dataset(src, ds_store, shard_size=2000)
    index = json.loads(runtime.run(ds_store.get("index.json")))
    index["shards"][0]["bytes"] = index["shards"][0]["raw_bytes"] = 10 << 40
    runtime.run(ds_store.put("index.json", json.dumps(index).encode()))
    with pytest.raises(CorruptData, match=r"index entry 0 lists 10995116277760 'bytes'"):
        StreamingDataset(f"s3://{s3_bucket}/ds", str(tmp_path / "cache"),
                         storage_options=opts)  # fmt: skip
    runtime.run(ds_store.close())

    fmstore.save({"w": torch.arange(4096, dtype=torch.float32)}, s3_store, compression="raw")
    doc = json.loads(runtime.run(s3_store.get("manifest.json")))
    _edit_unaligned_overhang(doc)
    runtime.run(s3_store.put("manifest.json", json.dumps(doc).encode()))
    for kw in ({}, {"lazy": True}, {"keys": "w"}):
        with pytest.raises(CorruptData, match="does not fit its storage") as e:
            x = fmstore.load(s3_store, **kw)
            _ = x["w"]
        assert e.value.key == "manifest.json"
