"""``fmstore://TIER/key`` as an fsspec protocol (:mod:`fmstore.fsspec`): pandas and pyarrow
read and write tiers through their Stores, with ranged reads, atomic writes, lazy
read-through and hostile paths refused."""

from __future__ import annotations

import os

import fsspec
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from fmstore import runtime
from fmstore.errors import ConfigError, InvalidKey
from fmstore.fsspec import FmstoreFileSystem
from fmstore.stores import open_store
from tests.stage_data import write_s3_config


def _registered() -> type:
    try:  # installed with the package: the ``fsspec.specs`` entry point
        return fsspec.get_filesystem_class("fmstore")
    except ValueError:
        fsspec.register_implementation("fmstore", FmstoreFileSystem)
        return fsspec.get_filesystem_class("fmstore")


@pytest.fixture(autouse=True)
def _protocol():
    assert _registered() is FmstoreFileSystem
    yield
    fsspec.AbstractFileSystem.clear_instance_cache()


@pytest.fixture
def s3_cfg(tmp_path, s3_server, s3_bucket, monkeypatch):
    cfg = tmp_path / "s3.toml"
    write_s3_config(cfg, s3_server.endpoint_url, s3_bucket)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    return cfg


def _frame(n: int = 1000) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({"i": np.arange(n), "x": rng.random(n), "s": [f"r{k}" for k in range(n)]})


def test_get_filesystem_class_and_url_parsing(posix_cfg):
    fs, path = fsspec.core.url_to_fs("fmstore://nvme/datasets/x.parquet")
    assert isinstance(fs, FmstoreFileSystem)
    assert path == "nvme/datasets/x.parquet"
    assert fs.split(path) == ("nvme", "datasets/x.parquet")


def test_pandas_parquet_round_trip_posix(posix_cfg, tmp_path):
    df = _frame()
    df.to_parquet("fmstore://nvme/datasets/x.parquet")
    assert (tmp_path / "nvme" / "datasets" / "x.parquet").is_file()
    pd.testing.assert_frame_equal(pd.read_parquet("fmstore://nvme/datasets/x.parquet"), df)


def test_config_from_storage_options(tmp_path, monkeypatch):
    cfg = tmp_path / "other.toml"
    cfg.write_text(f'[tiers.fast]\nurl = "{tmp_path / "fast"}"\n')
    monkeypatch.delenv("FMSTORE_CONFIG", raising=False)
    df = _frame(50)
    opts = {"config": str(cfg)}
    df.to_parquet("fmstore://fast/a.parquet", storage_options=opts)
    pd.testing.assert_frame_equal(
        pd.read_parquet("fmstore://fast/a.parquet", storage_options=opts), df
    )
    assert (tmp_path / "fast" / "a.parquet").is_file()


@pytest.mark.s3
def test_pandas_parquet_round_trip_s3(s3_cfg, s3_server, s3_bucket):
    df = _frame()
    opts = {"config": str(s3_cfg)}
    df.to_parquet("fmstore://s3/datasets/x.parquet", storage_options=opts)
    pd.testing.assert_frame_equal(
        pd.read_parquet("fmstore://s3/datasets/x.parquet", storage_options=opts), df
    )
    raw = open_store(f"s3://{s3_bucket}", **s3_server.store_options())
    assert runtime.run(raw.exists("ds/datasets/x.parquet"))  # the tier's prefix is ds/
    fs = fsspec.filesystem("fmstore", **opts)
    assert fs.ls("s3/datasets", detail=False) == ["s3/datasets/x.parquet"]
    assert fs.info("s3/datasets")["type"] == "directory"
    fs.rm("s3/datasets/x.parquet")
    assert not fs.exists("s3/datasets/x.parquet")


def _count_reads(monkeypatch, fs: FmstoreFileSystem, tier: str) -> list[tuple[int, int]]:
    store = fs.store(tier)
    calls: list[tuple[int, int]] = []
    inner_range, inner_get = store.get_range, store.get

    async def get_range(key, start, end=None):
        calls.append((start, end))
        return await inner_range(key, start, end)

    async def get(key):
        calls.append((0, None))
        return await inner_get(key)

    monkeypatch.setattr(store, "get_range", get_range)
    monkeypatch.setattr(store, "get", get)
    return calls


def _ranged_parquet_read(monkeypatch, fs: FmstoreFileSystem, path: str) -> None:
    rows, groups = 40_000, 8
    df = _frame(rows * groups)[["i", "x"]]
    with fs.open(path, "wb") as f:
        df.to_parquet(f, row_group_size=rows)
    size = fs.size(path)
    assert pq.ParquetFile(fs.open(path, "rb")).num_row_groups == groups
    calls = _count_reads(monkeypatch, fs, path.split("/", 1)[0])
    lo, hi = 3 * rows, 4 * rows  # exactly row group 3, found by its statistics
    table = pq.read_table(path, filesystem=fs, filters=[("i", ">=", lo), ("i", "<", hi)])
    assert table.num_rows == rows
    assert table.column("i").to_pylist() == list(range(lo, hi))
    assert calls and all(end is not None for _, end in calls), calls  # never a whole GET
    fetched = sum(end - start for start, end in calls)
    assert fetched < size / 3, (fetched, size, calls)


def test_pyarrow_reads_one_row_group_with_ranged_reads_posix(posix_cfg, monkeypatch):
    fs = FmstoreFileSystem(block_size=64 * 1024, skip_instance_cache=True)
    _ranged_parquet_read(monkeypatch, fs, "nvme/big.parquet")


@pytest.mark.s3
def test_pyarrow_reads_one_row_group_with_ranged_reads_s3(s3_cfg, monkeypatch):
    fs = FmstoreFileSystem(config=str(s3_cfg), block_size=64 * 1024, skip_instance_cache=True)
    _ranged_parquet_read(monkeypatch, fs, "s3/big.parquet")


def _write_is_atomic(fs: FmstoreFileSystem, url: str) -> None:
    path = fs._strip_protocol(url)
    with fsspec.open(url, "wb", block_size=5 * 1024 * 1024, **fs.storage_options) as f:
        for _ in range(3):  # more than one block: the writer has streamed parts already
            f.write(os.urandom(3 * 1024 * 1024))
        f.flush()
        assert not fs.exists(path)
    assert fs.size(path) == 9 * 1024 * 1024

    failed = fsspec.open(url + ".failed", "wb", **fs.storage_options)
    with pytest.raises(RuntimeError, match="boom"), failed as f:
        f.write(os.urandom(6 * 1024 * 1024))
        f.flush()
        raise RuntimeError("boom")
    assert not fs.exists(path + ".failed")

    f = fs.open(path + ".dropped", "wb")  # dropped without close: never published
    f.write(b"partial")
    f.flush(force=False)
    del f
    assert not fs.exists(path + ".dropped")


def test_write_invisible_until_close_nothing_left_on_error_posix(posix_cfg, tmp_path):
    fs = fsspec.filesystem("fmstore")
    _write_is_atomic(fs, "fmstore://nvme/out/w.bin")
    assert sorted(os.listdir(tmp_path / "nvme" / "out")) == ["w.bin"]  # no temp files
    assert runtime.run(fs.store("nvme").leftovers()) == []


@pytest.mark.s3
def test_write_invisible_until_close_nothing_left_on_error_s3(s3_cfg):
    fs = fsspec.filesystem("fmstore", config=str(s3_cfg))
    _write_is_atomic(fs, "fmstore://s3/out/w.bin")
    assert fs.ls("s3/out", detail=False) == ["s3/out/w.bin"]
    assert runtime.run(fs.store("s3").leftovers()) == []  # no multipart upload left


@pytest.mark.parametrize(
    "url",
    [
        "fmstore://nvme/../escape",
        "fmstore://nvme/a/../../escape",
        "fmstore://nvme/./a",
        "fmstore:///etc/passwd",
        "fmstore://../nvme/a",
        "fmstore://nvme/a\x00b",
        "fmstore://nvme/a\\..\\b",
    ],
)
def test_hostile_paths_are_refused(posix_cfg, tmp_path, url):
    fs = fsspec.filesystem("fmstore")
    with pytest.raises(InvalidKey), fsspec.open(url, "rb") as f:
        f.read()
    with pytest.raises(InvalidKey), fsspec.open(url, "wb") as f:
        f.write(b"x")
    with pytest.raises(InvalidKey):
        fs.exists(url)
    with pytest.raises(InvalidKey):
        fs.rm(url)
    assert not (tmp_path / "escape").exists()


def test_unknown_tier_names_the_configured_ones(posix_cfg):
    with pytest.raises(ConfigError, match="lustre, nvme"):
        fsspec.filesystem("fmstore").info("fmstore://nope/a")


def test_ls_info_cat_rm_mkdir(posix_cfg, tmp_path):
    fs = fsspec.filesystem("fmstore")
    assert fs.ls("fmstore://", detail=False) == ["lustre", "nvme"]
    fs.mkdir("nvme/empty")  # directories are prefixes: nothing to create
    fs.pipe("nvme/d/a.bin", b"0123456789")
    fs.pipe("nvme/d/sub/b.bin", b"xy")
    assert fs.ls("nvme/d", detail=False) == ["nvme/d/a.bin", "nvme/d/sub"]
    assert fs.info("nvme/d/a.bin")["size"] == 10
    assert fs.info("nvme/d/sub")["type"] == "directory"
    assert fs.cat_file("nvme/d/a.bin", 2, 5) == b"234"
    assert fs.cat_file("nvme/d/a.bin", -3) == b"789"
    with fs.open("nvme/d/a.bin", "rb") as f:
        f.seek(7)
        assert f.read() == b"789"
    assert fs.find("nvme/d") == ["nvme/d/a.bin", "nvme/d/sub/b.bin"]
    fs.cp_file("nvme/d/a.bin", "lustre/c.bin")
    assert (tmp_path / "lustre" / "c.bin").read_bytes() == b"0123456789"
    with pytest.raises(FileNotFoundError):
        fs.info("nvme/missing")
    with pytest.raises(FileNotFoundError):
        fs.cat_file("nvme/missing")
    fs.rm("nvme/d", recursive=True)
    assert not fs.exists("nvme/d/a.bin") and not fs.exists("nvme/d/sub/b.bin")


def test_lazily_staged_files_read_through(posix_cfg, tmp_path):
    from fmstore.tiering.copy.transfer import CopyItem
    from fmstore.tiering.staging.lazy import write_index

    src = tmp_path / "lustre" / "source"  # an index may name only tiers (or lazy_sources)
    (src / "train").mkdir(parents=True)
    df = _frame(200)
    df.to_parquet(src / "train" / "p0.parquet")
    size = (src / "train" / "p0.parquet").stat().st_size
    (tmp_path / "nvme" / "ds").mkdir(parents=True)
    dst = open_store(str(tmp_path / "nvme" / "ds"))
    runtime.run(
        write_index(dst, str(src), [CopyItem("train/p0.parquet", "train/p0.parquet", size)])
    )
    local = tmp_path / "nvme" / "ds" / "train" / "p0.parquet"
    fs = fsspec.filesystem("fmstore")
    assert fs.ls("nvme/ds", detail=False) == ["nvme/ds/.fmstore-lazy.jsonl", "nvme/ds/train"]
    assert fs.ls("nvme/ds/train", detail=False) == ["nvme/ds/train/p0.parquet"]
    assert fs.info("nvme/ds/train/p0.parquet")["size"] == size
    assert not local.exists()  # listing and info fetch nothing
    pd.testing.assert_frame_equal(pd.read_parquet("fmstore://nvme/ds/train/p0.parquet"), df)
    assert local.read_bytes() == (src / "train" / "p0.parquet").read_bytes()  # kept


def test_exclusive_create_and_transactions(posix_cfg):
    from fmstore.errors import AlreadyExists

    fs = fsspec.filesystem("fmstore")
    fs.pipe("nvme/x.bin", b"1")
    with pytest.raises(AlreadyExists), fs.open("nvme/x.bin", "xb") as f:
        f.write(b"2")
    assert fs.cat("nvme/x.bin") == b"1"
    with fs.transaction:
        with fs.open("nvme/t.bin", "wb") as f:
            f.write(b"t")
        assert not fs.exists("nvme/t.bin")  # published when the transaction commits
    assert fs.cat("nvme/t.bin") == b"t"
    with pytest.raises(KeyError), fs.transaction:
        with fs.open("nvme/t2.bin", "wb") as f:
            f.write(b"t")
        raise KeyError("abandon")
    assert not fs.exists("nvme/t2.bin")


def test_the_protocol_is_registered_by_the_installed_entry_point():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="fsspec.specs") if e.name == "fmstore"]
    assert ep.load() is FmstoreFileSystem


@pytest.mark.s3
def test_s3_folder_markers_are_directories_and_go_with_rm_r(s3_cfg, s3_server, s3_bucket):
    """0-byte keys ending in "/" (the AWS console's "Create folder", Hadoop S3A, rclone)
    are directories, as s3fs sees them: never listed or found as files, and removed by
    ``rm -r``."""
    client = s3_server.boto3_client()
    for k in ("ds/top/d/", "ds/top/e/", "ds/top/e/f"):
        client.put_object(Bucket=s3_bucket, Key=k, Body=b"x" if k.endswith("f") else b"")
    fs = FmstoreFileSystem(config=str(s3_cfg), skip_instance_cache=True)
    assert [(o["name"], o["type"]) for o in fs.ls("s3/top")] == [
        ("s3/top/d", "directory"),
        ("s3/top/e", "directory"),
    ]
    assert fs.ls("s3/top/d") == []
    assert fs.find("s3/top") == ["s3/top/e/f"]
    assert fs.info("s3/top/d")["type"] == "directory" and fs.exists("s3/top/d")
    with pytest.raises(IsADirectoryError):
        fs.cat("s3/top/d")
    raw = open_store(f"s3://{s3_bucket}/ds", **s3_server.store_options())
    listed = runtime.run(raw.list_keys("top"))
    assert listed == ["top/e/f"], listed  # files only, whatever the markers
    fs.rm("s3/top", recursive=True)
    assert not fs.exists("s3/top/d") and not fs.exists("s3/top")
    assert "Contents" not in client.list_objects_v2(Bucket=s3_bucket, Prefix="ds/")


def test_exclusive_open_of_an_existing_key_is_refused_at_open_and_again_at_commit(posix_cfg):
    from fmstore.errors import AlreadyExists

    fs = fsspec.filesystem("fmstore")
    fs.pipe("nvme/x.bin", b"1")
    with pytest.raises(AlreadyExists, match="x.bin"):
        fs.open("nvme/x.bin", "xb")  # at open(), as open(path, "x") does
    f = fs.open("nvme/y.bin", "xb")
    f.write(b"mine")
    fs.pipe("nvme/y.bin", b"theirs")  # created between the open and the close
    with pytest.raises(AlreadyExists):
        f.close()
    assert fs.cat("nvme/x.bin") == b"1" and fs.cat("nvme/y.bin") == b"theirs"


@pytest.mark.parametrize("prefix", ["nvme/src", "fmstore://nvme/src"])
def test_get_of_a_glob_to_a_local_directory_writes_under_it_alone(
    posix_cfg, tmp_path, monkeypatch, prefix
):
    """``get`` of a glob into an absolute local directory (fsspec's "copy scenario 1h")
    writes there and nowhere else: not under the working directory, as if the target's
    leading "/" had been dropped."""
    fs = fsspec.filesystem("fmstore")
    for key in ("file1", "subdir/subfile1", "subdir/subfile2", "subdir/nesteddir/nestedfile"):
        fs.pipe(f"nvme/src/{key}", key.encode())
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    target = tmp_path / "target"
    flat = {"subfile1", "subfile2"}
    deep = flat | {"nesteddir/nestedfile"}
    for slash in ("", "/"):
        for glob, kwargs, want in [
            ("*", {}, flat),
            ("*", {"recursive": True}, deep),
            ("**", {}, deep),
            ("*", {"recursive": True, "maxdepth": 1}, flat),
            ("**", {"maxdepth": 1}, flat),
        ]:
            target.mkdir()
            fs.get(f"{prefix}/subdir/{glob}", f"{target}/newdir{slash}", **kwargs)
            got = {
                os.path.relpath(os.path.join(d, f), target / "newdir")
                for d, _, files in os.walk(target)
                for f in files
            }
            assert got == want, (glob, kwargs, slash)
            assert (target / "newdir" / "subfile1").read_bytes() == b"subdir/subfile1"
            assert os.listdir(cwd) == [], (glob, kwargs, slash)
            fsspec.filesystem("file").rm(str(target), recursive=True)
