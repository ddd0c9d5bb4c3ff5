"""Hostile datasets: a Hugging Face directory holding FIFOs, a Parquet footer declaring
more rows than its bytes hold (or an epoch order too big for memory), a sparse gigabyte
``index.json``.  Each is refused with one fmstore error naming it, without waiting on a FIFO
and within a memory limit where the attack is an allocation."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
from hostile_helpers import LimitedCases, one_error_line, run_limited
from stage_data import fm_here

from fmstore.errors import CorruptData

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


#: Hostile loads run under a memory limit, all of this module's in one fresh interpreter
#: (see ``hostile_helpers.LimitedCases``).
LIMITED = LimitedCases()


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """name -> (its directory, one result per ``report`` call) of every limited case."""
    return LIMITED.run(tmp_path_factory, b"")


@pytest.fixture
def fm(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    return fm_here


@LIMITED.case
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
    line = one_error_line(fm("dataset", "inspect", str(d)))
    assert "a.parquet" in line and "rows a byte" in line


@LIMITED.case
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


def test_a_sparse_gigabyte_dataset_index_is_refused_in_bounded_memory(tmp_path):
    """A dataset's ``index.json`` is read bounded like a manifest: 1.5 GiB of sparse file
    (no disk) is refused by its size, before a byte is read, by the loader and the writer."""
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "index.json", "wb") as f:
        f.truncate(3 << 29)
    res = run_limited(
        f"""
        os.environ["FMSTORE_MAX_INDEX_BYTES"] = str(64 << 20)
        from fmstore.loaders import StreamingDataset
        from fmstore.loaders.writer import write_samples
        report(lambda: StreamingDataset({str(data)!r}, {str(tmp_path / "cache")!r}))
        report(lambda: write_samples([b"x"], {str(data)!r}))
        """
    )
    assert [r["error"] for r in res] == ["CorruptData", "AlreadyExists"], res
    assert "dataset index" in res[0]["msg"] and "67108864" in res[0]["msg"], res
    assert (data / "index.json").stat().st_size == 3 << 29  # nothing replaced or removed
    # overwrite replaces it: the unread index names no shard to remove
    res = run_limited(
        f"""
        os.environ["FMSTORE_MAX_INDEX_BYTES"] = str(64 << 20)
        from fmstore.loaders.writer import write_samples
        report(lambda: write_samples([b"x"], {str(data)!r}, overwrite=True))
        """
    )
    assert res == [{"error": None}], res
    assert (data / "index.json").stat().st_size < 4096
