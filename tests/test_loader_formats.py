"""Formats: MDS and WebDataset written by their own libraries, token streams, the writer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from peer_libs import import_mds_writer

from fmstore.errors import NotSupported
from fmstore.loaders import StreamingDataset, write_dataset
from fmstore.loaders.formats import FormatOptions, load_format
from fmstore.stores import open_store


def _mds_samples(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "id": i,
            "text": f"sample {i} " + "y" * (i % 17),
            "blob": bytes(rng.integers(0, 256, 1 + i % 50, dtype=np.uint8)),
            "score": float(i) / 3,
            "meta": {"i": i, "tags": ["a", str(i)]},
            "tokens": np.arange(i % 7 + 1, dtype=np.uint16) * i,
            "fixed": np.full((2, 3), i, dtype=np.int32),
            "small": np.int32(-i),
        }
        for i in range(n)
    ]


COLUMNS = {"id": "int", "text": "str", "blob": "bytes", "score": "float64", "meta": "json",
           "tokens": "ndarray", "fixed": "ndarray:int32:2,3", "small": "int32"}  # fmt: skip


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_mds_written_by_mosaicml_streaming_reads_back_exactly(tmp_path, compression):
    MDSWriter = import_mds_writer()
    if MDSWriter is None:
        pytest.skip("mosaicml-streaming is not installed")
    out = str(tmp_path / "mds")
    samples = _mds_samples(300)
    with MDSWriter(out=out, columns=COLUMNS, compression=compression, size_limit=4000) as w:
        for s in samples:
            w.write(s)
    assert len([f for f in os.listdir(out) if f.startswith("shard.")]) > 3
    ds = StreamingDataset(out, str(tmp_path / "cache"), shuffle=False)
    assert ds.formats[0].name == "mds"
    got = list(ds)
    assert len(got) == 300
    for a, b in zip(got, samples, strict=True):
        assert a["id"] == b["id"] and a["text"] == b["text"] and a["blob"] == b["blob"]
        assert a["score"] == b["score"] and a["meta"] == b["meta"] and a["small"] == b["small"]
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["fixed"], b["fixed"])


def test_mds_pickle_columns_are_refused_unless_allowed(tmp_path):
    MDSWriter = import_mds_writer()
    if MDSWriter is None:
        pytest.skip("mosaicml-streaming is not installed")
    out = str(tmp_path / "mds")
    with MDSWriter(out=out, columns={"obj": "pkl"}) as w:
        for i in range(5):
            w.write({"obj": {"i": i}})
    with pytest.raises(NotSupported, match="allow_pickle"):
        StreamingDataset(out, str(tmp_path / "cache"))
    ds = StreamingDataset(out, str(tmp_path / "cache"), shuffle=False, allow_pickle=True)
    assert [s["obj"]["i"] for s in ds] == list(range(5))


def test_webdataset_tars_written_by_webdataset_read_back_exactly(tmp_path):
    wds = pytest.importorskip("webdataset")
    root = tmp_path / "wds"
    root.mkdir()
    expected = {}
    for shard in range(3):
        with wds.TarWriter(str(root / f"data-{shard:04d}.tar")) as w:
            for j in range(40):
                key = f"s{shard}_{j:03d}"
                sample = {"__key__": key, "txt": f"text {key}", "json": {"k": key},
                          "bin": os.urandom(10 + j)}  # fmt: skip
                w.write(sample)
                expected[key] = sample
    cache = str(tmp_path / "cache")
    ds = StreamingDataset(str(root), cache, batch_size=4)
    assert ds.formats[0].name == "webdataset"
    got = list(ds)
    assert sorted(s["__key__"] for s in got) == sorted(expected)
    for s in got:
        e = expected[s["__key__"]]
        assert (
            s["txt"] == e["txt"].encode()
            and json.loads(s["json"]) == e["json"]
            and s["bin"] == e["bin"]
        )
    assert os.path.exists(os.path.join(cache, ".meta", "wds-index.json"))  # the tar scan is kept


def test_nanogpt_token_bin_read_as_sequences_with_targets(tmp_path):
    root = tmp_path / "tok"
    root.mkdir()
    tokens = np.arange(10_000, dtype=np.uint16)
    tokens.tofile(root / "train.bin")
    ds = StreamingDataset(str(root), str(tmp_path / "cache"), shuffle=False, seq_len=64, dtype="uint16",
                          shard_bytes=1000)  # fmt: skip
    assert len(ds.formats[0].shards) > 5  # one file cut into virtual shards
    got = list(ds)
    assert len(got) == (10_000 - 1) // 64
    for i, s in enumerate(got):
        np.testing.assert_array_equal(s, tokens[i * 64 : i * 64 + 65])


def test_writer_converts_npy_tokens_and_reads_them_with_zstd(tmp_path):
    arr = (np.arange(50_000) % 60_000).astype(np.uint16)
    np.save(tmp_path / "tok.npy", arr)
    dst = str(tmp_path / "ds")
    r = write_dataset(tmp_path / "tok.npy", dst, shard_size=20_000, compression="zstd")
    assert r.kind == "tokens" and r.shards == 5
    ds = StreamingDataset(dst, str(tmp_path / "cache"), shuffle=False, seq_len=100, targets=False)
    got = np.concatenate(list(ds))
    assert len(got) == 50_000 - 50_000 % 100
    np.testing.assert_array_equal(got, arr[: len(got)])


def test_npy_token_files_are_read_directly(tmp_path):
    root = tmp_path / "npy"
    root.mkdir()
    arr = np.arange(3000, dtype=np.uint32)
    np.save(root / "a.npy", arr)
    fmt = load_format(open_store(str(root)), FormatOptions(seq_len=100, dtype="uint32"))
    assert fmt.num_samples == 29
    ds = StreamingDataset(
        str(root), str(tmp_path / "cache"), shuffle=False, seq_len=100, dtype="uint32"
    )
    np.testing.assert_array_equal(next(iter(ds)), arr[:101])


def test_writer_text_and_file_directories(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "b.txt").write_text("beta")
    write_dataset(src, str(tmp_path / "text"))
    assert sorted(StreamingDataset(str(tmp_path / "text"), str(tmp_path / "c1"))) == [
        "alpha",
        "beta",
    ]
    (src / "c.png").write_bytes(b"\x89PNG")
    write_dataset(src, str(tmp_path / "files"))
    got = {
        s["__key__"]: s["data"]
        for s in StreamingDataset(str(tmp_path / "files"), str(tmp_path / "c2"))
    }
    assert got == {"a.txt": b"alpha", "sub/b.txt": b"beta", "c.png": b"\x89PNG"}


def test_index_describes_shards_and_is_versioned(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(50)))
    write_dataset(src, str(tmp_path / "ds"), shard_size=200)
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    assert index["format"] == "fmstore-dataset" and index["version"] == 1
    assert sum(s["samples"] for s in index["shards"]) == index["samples"] == 50
    assert all(s["checksum"].startswith("xxh3_64:") for s in index["shards"])
    index["version"] = 99
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    from fmstore.errors import VersionError

    with pytest.raises(VersionError):
        StreamingDataset(str(tmp_path / "ds"), str(tmp_path / "c"))
