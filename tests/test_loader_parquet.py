"""Parquet datasets (directories of ``*.parquet`` files, written here with pyarrow): values,
canonical order with workers, exact and elastic resume, mixing, S3, corrupt files, and
``fmstore dataset inspect``."""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from loader_helpers import ids
from stage_data import fm_here

from fmstore import runtime
from fmstore.errors import ConfigError, CorruptData, NotFound
from fmstore.loaders import Stream, StreamingDataset
from fmstore.loaders.formats import FormatOptions, load_format
from fmstore.stores import open_store

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

#: rows per file: several files, several (uneven) row groups each
FILES = (70, 95, 40, 88)
N = sum(FILES)
ROW_GROUP = 16


def _table(lo: int, hi: int) -> pa.Table:
    i = np.arange(lo, hi)
    return pa.table(
        {
            "i": pa.array(i, pa.int64()),
            "x": pa.array(i * 0.5, pa.float32()),
            "s": [f"row-{k}" for k in i],
            "tok": pa.array([list(range(k % 7)) for k in i], pa.list_(pa.int32())),
        }
    )


def write_parquet(root: Path, files=FILES, *, sub: str = "data") -> str:
    """``root/<sub>/train-0000k.parquet``; row ``i`` is global row ``i`` in key order."""
    (root / sub).mkdir(parents=True, exist_ok=True)
    lo = 0
    for k, n in enumerate(files):
        pq.write_table(
            _table(lo, lo + n), root / sub / f"train-{k:05d}.parquet", row_group_size=ROW_GROUP
        )
        lo += n
    return str(root)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pq")
    remote = write_parquet(tmp / "ds")
    # Bookkeeping files beside the data are not part of it.
    (tmp / "ds" / "_SUCCESS").write_bytes(b"")
    (tmp / "ds" / ".cache").mkdir()
    pq.write_table(_table(0, 5), tmp / "ds" / ".cache" / "stale.parquet")
    return remote, str(tmp / "cache")


def test_detected_with_row_counts_from_footers_and_values_typed(dataset):
    remote, cache = dataset
    fmt = load_format(open_store(remote), FormatOptions())
    assert fmt.name == "parquet"
    assert [s.key for s in fmt.shards] == [f"data/train-{k:05d}.parquet" for k in range(4)]
    assert [s.samples for s in fmt.shards] == list(FILES)
    assert [len(s.extra["row_groups"]) for s in fmt.shards] == [5, 6, 3, 6]
    ds = StreamingDataset(remote, cache, format="parquet", shuffle=False)
    rows = list(ds)
    assert [int(r["i"]) for r in rows] == list(range(N))
    r = rows[100]
    assert set(r) == {"i", "x", "s", "tok"}
    assert isinstance(r["i"], np.int64) and r["i"] == 100
    assert isinstance(r["x"], np.float32) and r["x"] == 50.0
    assert r["s"] == "row-100"
    assert isinstance(r["tok"], np.ndarray) and r["tok"].dtype == np.int32
    assert r["tok"].tolist() == list(range(100 % 7))


def test_columns_option_reads_only_those(dataset):
    remote, cache = dataset
    ds = StreamingDataset(remote, cache, columns=["s", "i"], shuffle=False)
    first = next(iter(ds))
    assert first == {"s": "row-0", "i": 0}
    with pytest.raises(ConfigError, match="no column 'nope'"):
        StreamingDataset(remote, cache, columns=["i", "nope"])


def test_nulls_fixed_size_lists_and_nested_values(tmp_path):
    (tmp_path / "d").mkdir()
    t = pa.table(
        {
            "n": pa.array([1, None, 3], pa.int32()),
            "f": pa.array([[1.0, 2.0]] * 3, pa.list_(pa.float64(), 2)),
            "tags": [["a"], [], ["b", "c"]],
            "b": [b"x", b"y", None],
        }
    )
    pq.write_table(t, tmp_path / "d" / "part.parquet")
    rows = list(StreamingDataset(str(tmp_path / "d"), str(tmp_path / "c"), shuffle=False))
    assert [r["n"] for r in rows] == [1, None, 3]
    assert isinstance(rows[0]["n"], np.int32)
    assert isinstance(rows[0]["f"], np.ndarray) and rows[0]["f"].tolist() == [1.0, 2.0]
    assert [r["tags"] for r in rows] == [["a"], [], ["b", "c"]]
    assert [r["b"] for r in rows] == [b"x", b"y", None]


def test_every_row_once_in_the_canonical_order_with_two_workers(dataset):
    remote, cache = dataset
    got = ids(remote, cache, workers=2)
    assert sorted(got) == list(range(N))
    assert got != list(range(N))
    canonical = StreamingDataset(remote, cache, batch_size=8).sample_ids().tolist()
    assert got == canonical  # row i is sample i: files in key order, rows in file order
    assert ids(remote, cache, workers=0) == got


def test_exact_resume_mid_epoch(dataset):
    remote, cache = dataset
    full = ids(remote, cache, workers=2, seed=7)
    head, state = ids(remote, cache, workers=2, seed=7, stop_after=13)
    assert head == full[: 13 * 8]
    rest = ids(remote, cache, workers=2, seed=7, state=state)
    assert head + rest == full


def test_elastic_resume_from_three_ranks_to_two_covers_every_row_once(dataset):
    remote, cache = dataset
    seen, states = [], []
    for r in range(3):
        head, st = ids(remote, cache, rank=r, world_size=3, workers=1, stop_after=4)
        seen += head
        states.append(st)
    assert states[0] == states[1] == states[2]
    rest = []
    for r in range(2):
        rest += ids(
            remote, cache, rank=r, world_size=2, workers=2 if r == 0 else 0, state=states[0]
        )
    remaining = N - len(seen)
    assert len(rest) == remaining + remaining % 2  # the documented wrap-around padding
    assert sorted(set(seen + rest)) == list(range(N))
    assert Counter(seen + rest[:remaining]) == Counter(range(N))


def test_mixed_with_a_token_stream(tmp_path, dataset):
    remote, _ = dataset
    (tmp_path / "tok").mkdir()
    np.arange(10_000, dtype=np.uint16).tofile(tmp_path / "tok" / "train.bin")
    streams = [
        Stream(remote, weight=1.0, columns=["i"]),
        Stream(str(tmp_path / "tok"), weight=1.0, seq_len=32, dtype="uint16"),
    ]

    def make():
        return StreamingDataset(
            streams=streams, local=str(tmp_path / "cache"), batch_size=8,
            samples_per_epoch=2 * N, seed=3,
        )  # fmt: skip

    samples = list(make())
    rows = [int(s["i"]) for s in samples if isinstance(s, dict)]
    toks = [s for s in samples if isinstance(s, np.ndarray)]
    assert sorted(rows) == list(range(N))  # the Parquet stream: one full pass
    assert len(toks) == N and all(len(t) == 33 for t in toks)
    ds = make()
    order = ds.sample_ids().tolist()
    again = make()
    again.load_state_dict(ds.state_dict(num_samples=101))
    assert again.sample_ids().tolist() == order[101:]


def test_mixed_with_an_mds_stream(tmp_path, dataset):
    from peer_libs import import_mds_writer

    MDSWriter = import_mds_writer()
    if MDSWriter is None:
        pytest.skip("mosaicml-streaming is not installed (make setup installs it)")
    remote, _ = dataset
    with MDSWriter(out=str(tmp_path / "mds"), columns={"i": "int"}, size_limit=1000) as w:
        for k in range(50):
            w.write({"i": 10_000 + k})
    ds = StreamingDataset(
        streams=[Stream(remote, float(N), columns=["i"]), Stream(str(tmp_path / "mds"), 50.0)],
        local=str(tmp_path / "cache"), transform=lambda s: int(s["i"]), seed=1,
    )  # fmt: skip
    got = list(ds)
    assert sorted(got) == list(range(N)) + list(range(10_000, 10_050))


@pytest.mark.s3
def test_streams_from_s3(tmp_path, s3_server, s3_bucket):
    local = Path(write_parquet(tmp_path / "src", sub="train"))
    opts = s3_server.store_options()
    url = f"s3://{s3_bucket}/pq"
    store = open_store(url, **opts)
    for f in sorted((local / "train").iterdir()):
        runtime.run(store.put(f"train/{f.name}", f.read_bytes()))
    got = ids(url, str(tmp_path / "cache"), workers=2, storage_options=opts)
    assert sorted(got) == list(range(N))
    info = load_format(store, FormatOptions()).describe()
    assert (info["format"], info["shards"], info["samples"]) == ("parquet", 4, N)


def _one_file(tmp_path: Path) -> Path:
    d = tmp_path / "bad"
    d.mkdir()
    pq.write_table(_table(0, 40), d / "ok.parquet", row_group_size=10)
    pq.write_table(_table(40, 80), d / "part.parquet", row_group_size=10, compression="zstd")
    return d / "part.parquet"


@pytest.mark.parametrize(
    "damage",
    ["truncated", "short", "footer_length", "footer_bytes", "no_head_magic"],
)
def test_a_corrupt_file_is_corrupt_data_naming_it(tmp_path, damage):
    f = _one_file(tmp_path)
    data = bytearray(f.read_bytes())
    n = struct.unpack("<I", data[-8:-4])[0]
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "short":
        data = data[:6]
    elif damage == "footer_length":
        data[-8:-4] = struct.pack("<I", 1 << 31)
    elif damage == "footer_bytes":
        start = len(data) - 8 - n
        data[start : start + n] = os.urandom(n)
    else:
        data[:4] = b"XXXX"
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptData) as e:  # at start, or (no_head_magic) when the file opens
        list(StreamingDataset(str(f.parent), str(tmp_path / "cache")))
    assert "part.parquet" in str(e.value)


def test_column_chunks_outside_the_file_are_corrupt_data_when_read(tmp_path):
    f = _one_file(tmp_path)
    data = f.read_bytes()
    n = struct.unpack("<I", data[-8:-4])[0]
    body, footer = data[: len(data) - 8 - n], data[len(data) - 8 - n :]
    # The footer still parses and its row counts add up, but the later row groups' column
    # chunks now lie past the end of the (shorter) file.
    f.write_bytes(body[: len(body) // 2] + footer)
    ds = StreamingDataset(str(f.parent), str(tmp_path / "cache"), shuffle=False)
    with pytest.raises(CorruptData, match="row group") as e:
        list(ds)
    assert "part.parquet" in str(e.value)


def test_damaged_pages_are_corrupt_data_when_read(tmp_path):
    f = _one_file(tmp_path)
    data = bytearray(f.read_bytes())
    md = pq.read_metadata(f)
    cc = md.row_group(0).column(2)  # the string column of the first row group
    lo = cc.data_page_offset
    data[lo + 20 : lo + cc.total_compressed_size - 4] = b"\xff" * (cc.total_compressed_size - 24)
    f.write_bytes(bytes(data))
    ds = StreamingDataset(str(f.parent), str(tmp_path / "cache"), shuffle=False)
    with pytest.raises(CorruptData, match="row group 0") as e:
        list(ds)
    assert "part.parquet" in str(e.value)


def test_explicit_format_and_files_that_disagree(tmp_path):
    with pytest.raises(NotFound, match="parquet"):
        load_format(open_store(str(tmp_path)), FormatOptions(format="parquet"))
    d = tmp_path / "d"
    d.mkdir()
    pq.write_table(_table(0, 5), d / "a.parquet")
    pq.write_table(pa.table({"i": ["x"], "s": ["y"]}), d / "b.parquet")
    with pytest.raises(ConfigError, match="disagree"):
        load_format(open_store(str(d)), FormatOptions())
    assert load_format(open_store(str(d)), FormatOptions(columns=["s"])).num_samples == 6


@pytest.fixture
def fm(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    return fm_here


def test_inspect_shows_files_rows_row_groups_and_columns(dataset, fm):
    remote, _ = dataset
    r = fm("dataset", "inspect", remote, "--shards")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for word in ("parquet", "files", "rows", str(N), "row_groups", "20", "i: int64",
                 "x: float", "s: string", "tok: list<element: int32>",
                 "data/train-00001.parquet"):  # fmt: skip
        assert word in out, (word, out)
    r = fm("dataset", "inspect", remote, "--json", "--shards", "--columns", "i,s")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["format"] == "parquet"
    assert (doc["shards"], doc["samples"], doc["row_groups"]) == (4, N, 20)
    assert doc["columns"] == {"i": "int64", "s": "string"}
    assert [s["samples"] for s in doc["shard_list"]] == list(FILES)
    assert [s["row_groups"] for s in doc["shard_list"]] == [5, 6, 3, 6]


@pytest.mark.fuzz
def test_damaged_bytes_anywhere_give_only_fmstore_errors(tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from fmstore.errors import FmstoreError

    f = _one_file(tmp_path)
    original = f.read_bytes()
    n = struct.unpack("<I", original[-8:-4])[0]
    footer_at = len(original) - 8 - n
    count = [0]

    @settings(
        max_examples=int(os.environ.get("FMSTORE_FUZZ_EXAMPLES", "60")), deadline=None,
        suppress_health_check=list(HealthCheck), database=None,
    )  # fmt: skip
    @given(
        where=st.one_of(
            st.integers(footer_at, len(original) - 1), st.integers(0, len(original) - 1)
        ),
        junk=st.binary(min_size=1, max_size=16),
        cut=st.booleans(),
    )
    def check(where: int, junk: bytes, cut: bool) -> None:
        data = original[:where] if cut else original[:where] + junk + original[where + len(junk) :]
        f.write_bytes(data[: len(original)] if not cut else data)
        count[0] += 1
        try:
            ds = StreamingDataset(str(f.parent), str(tmp_path / f"cache{count[0]}"), seed=count[0])
            for r in ds:
                assert set(r) == {"i", "x", "s", "tok"}
        except FmstoreError:
            pass

    check()
