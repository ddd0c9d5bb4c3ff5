"""A valid but dense Parquet file costs bounded memory on its first sample.

A 268 KB file of 2**26 zeros in one row group (valid: pyarrow writes it) took 6 GB on its
first sample: the epoch's sample order as several arrays of 8 bytes a row plus Python lists
of them, and the row group decoded whole.  The order is now 4 bytes a row (1 for shard
numbers) with no whole-epoch temporaries, and a row group is decoded a slice at a time
(under 900 MB peak resident, most of it the order and the reader's slice cache).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hostile_helpers import run_limited

ROWS = 1 << 26
#: Address space the loads may take beyond the interpreter after its imports: a fraction of
#: what the old code allocated (about 6 GB), twice what they take now.
HEADROOM = 1536 << 20


def test_first_sample_of_a_dense_parquet_file_takes_bounded_memory(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    ds.mkdir()
    pq.write_table(pa.table({"x": np.zeros(ROWS, np.int64)}), ds / "a.parquet", row_group_size=ROWS)
    assert (ds / "a.parquet").stat().st_size < 1 << 20
    body = f"""
        import itertools
        from fmstore.loaders import StreamingDataset

        def first(shuffle, n):
            d = StreamingDataset({str(ds)!r}, local={str(tmp_path / "cache")!r}, shuffle=shuffle)
            got = list(itertools.islice(iter(d), n))
            assert len(got) == n and all(int(s["x"]) == 0 for s in got), got[:3]

        report(lambda: first(False, 100_000))  # crosses a slice of the row group
        report(lambda: first(True, 3))
    """
    res = run_limited(body, headroom=HEADROOM, timeout=240)
    assert res == [{"error": None}, {"error": None}], res
