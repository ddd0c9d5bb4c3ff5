"""Directories of Parquet files (what HF datasets, Spark and most pipelines write), read by
row groups.

A shard is one ``*.parquet`` file, cached whole like any shard; its samples are its rows,
counted from the file's footer.  The footer is fetched with bounded ranged reads at start
(one request for most files: the last 64 KiB), its length checked against the object's
real size before it is read, and its row counts checked to add up; column chunk ranges are
checked against the cached file by pyarrow's reader before it reads them.  A sample is a dict of
column -> value: numbers and booleans as numpy scalars, strings as ``str``, binary as
``bytes``, lists (and fixed-size lists) of numbers as 1-D numpy arrays, nulls as ``None``;
other values (lists of strings, structs, maps, dates) as pyarrow's ``as_py()`` gives them.

pyarrow is imported only when a Parquet dataset is read.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...errors import ConfigError, CorruptData, FmstoreError, NotSupported
from ...stores import Store
from .base import DatasetFormat, ShardReader, ShardSpec, decoding

MAGIC = b"PAR1"
#: Bytes read from the end of each file at start: the footer of most files fits.
TAIL = 64 << 10
#: The largest footer believed (Thrift metadata of a file; real ones are KBs to a few MBs).
MAX_FOOTER = 64 << 20
#: Rows a file may declare per byte it holds.  Parquet can encode a run of equal values in
#: a few bytes, so no format rule bounds this; the densest files pyarrow writes (a column
#: of nulls, one of zeros) hold about 500 rows a byte.  A footer declaring more is refused:
#: the row counts size every epoch's sample order (8 bytes a row, several times over).
MAX_ROWS_PER_BYTE = 2048
#: Decoded slices of row groups one open shard keeps (Arrow bytes), least recently used
#: dropped first.
ROW_GROUP_CACHE = 256 << 20
#: Rows decoded at once: a row group is read a slice at a time, never decoded whole.
SLICE_ROWS = 1 << 16


def _pa() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is installed where Parquet is read
        raise NotSupported("reading Parquet datasets needs pyarrow (pip install pyarrow)") from None
    return pa, pq


def is_parquet_key(key: str) -> bool:
    """``*.parquet`` objects, skipping hidden and bookkeeping paths (``.cache/``, ``_temporary/``)."""
    return key.endswith(".parquet") and not any(p[:1] in (".", "_") for p in key.split("/"))


# ---- footers ---------------------------------------------------------------------------


async def read_footer(store: Store, key: str, size: int) -> bytes:
    """The Thrift footer of ``key`` (``size`` bytes), checked to lie inside the object."""

    def bad(why: str) -> CorruptData:
        return CorruptData(f"not a readable Parquet file: {why}", tier=store.tier, key=key)

    if size < 12:
        raise bad(f"{size} bytes is too short")
    tail = await store.get_range(key, max(0, size - TAIL), size)
    if len(tail) != min(size, TAIL):
        raise bad(f"read {len(tail)} bytes of its last {min(size, TAIL)}")
    if tail[-4:] == b"PARE":
        raise NotSupported("encrypted Parquet footers are not supported", tier=store.tier, key=key)
    if tail[-4:] != MAGIC:
        raise bad("no PAR1 magic at the end (truncated, or not Parquet)")
    (n,) = struct.unpack("<I", tail[-8:-4])
    if n + 12 > size:
        raise bad(f"its footer length {n} does not fit in its {size} bytes")
    if n > MAX_FOOTER:
        raise bad(f"its footer of {n} bytes is over the {MAX_FOOTER}-byte limit")
    if size <= TAIL and tail[:4] != MAGIC:  # larger files: checked when opened from the cache
        raise bad("no PAR1 magic at the start")
    if n + 8 <= len(tail):
        return tail[len(tail) - 8 - n : len(tail) - 8]
    footer = await store.get_range(key, size - 8 - n, size - 8)
    if len(footer) != n:
        raise bad(f"read {len(footer)} bytes of its {n}-byte footer")
    return footer


def parse_footer(
    footer: bytes, *, key: str, tier: str | None = None, size: int | None = None
) -> Any:
    """The ``FileMetaData`` of a footer with its row counts checked (against the file's
    ``size`` too, when given: see :func:`check_metadata`); CorruptData naming the file
    otherwise."""
    pa, pq = _pa()
    n = len(footer)
    blob = MAGIC + footer + struct.pack("<I", n) + MAGIC
    try:
        md = pq.read_metadata(pa.BufferReader(blob))
        check_metadata(md, size)
    except ValueError as e:  # our checks
        raise CorruptData(f"Parquet footer: {e}", tier=tier, key=key) from None
    except (pa.ArrowException, OSError, RuntimeError) as e:
        raise CorruptData(f"Parquet footer does not parse: {e}"[:300], tier=tier, key=key) from None
    return md


def check_metadata(md: Any, size: int | None = None) -> None:
    """Raise ValueError unless the row groups' row counts are sane and add up, and (with
    the file's ``size``) are at most :data:`MAX_ROWS_PER_BYTE` a byte of the file.

    Column chunks' byte ranges are not read here: pyarrow's ``RowGroupMetaData.column()``
    aborts the process (an uncaught C++ exception) on some damaged footers, e.g. a size
    histogram of the wrong length.  pyarrow's reader checks each chunk's range against the
    (cached, size-checked) file before reading it, and a chunk outside the file is then
    CorruptData naming the file and the row group."""
    total = 0
    for g in range(md.num_row_groups):
        rows = md.row_group(g).num_rows
        if rows < 0:
            raise ValueError(f"row group {g} has {rows} rows")
        total += rows
    if total != md.num_rows:
        raise ValueError(f"row groups hold {total} rows but the file says {md.num_rows}")
    if size is not None and total > size * MAX_ROWS_PER_BYTE:
        raise ValueError(
            f"it declares {total} rows in {size} bytes, more than the {MAX_ROWS_PER_BYTE} "
            "rows a byte fmstore believes"
        )


# ---- the format -------------------------------------------------------------------------


def _schema(md: Any, columns: Sequence[str] | None, key: str) -> list[tuple[str, str]]:
    schema = md.schema.to_arrow_schema()
    names = list(schema.names)
    if columns is not None:
        missing = [c for c in columns if c not in names]
        if missing:
            raise ConfigError(f"{key} has no column {missing[0]!r} (it has {', '.join(names)})")
        names = list(columns)
    return [(nm, str(schema.field(nm).type)) for nm in names]


def load(
    store: Store, metas: list[Any], columns: Sequence[str] | None, *, concurrency: int = 16
) -> ParquetFormat:
    """Every ``*.parquet`` object of ``metas`` (a listing) as a shard, from its footer."""
    from ... import runtime

    metas = sorted(metas, key=lambda m: m.key)

    async def all_footers() -> list[bytes]:
        sem = asyncio.Semaphore(concurrency)

        async def one(m: Any) -> bytes:
            async with sem:
                return await read_footer(store, m.key, m.size)

        return list(await asyncio.gather(*(one(m) for m in metas)))

    footers = runtime.run(all_footers())
    shards: list[ShardSpec] = []
    schema: list[tuple[str, str]] | None = None
    first = ""
    for m, footer in zip(metas, footers, strict=True):
        md = parse_footer(footer, key=m.key, tier=store.tier, size=m.size)
        pa, _pq = _pa()
        try:
            cols = _schema(md, columns, m.key)
        except pa.ArrowException as e:
            raise CorruptData(
                f"Parquet schema does not convert: {e}"[:300], tier=store.tier, key=m.key
            ) from None
        if schema is None:
            schema, first = cols, m.key
        elif cols != schema:
            raise ConfigError(
                f"Parquet files disagree on columns: {first} has {schema}, {m.key} has {cols}"
            )
        groups = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        if md.num_rows:
            shards.append(
                ShardSpec(key=m.key, samples=md.num_rows, size=m.size,
                          extra={"row_groups": groups})
            )  # fmt: skip
    return ParquetFormat(shards, schema or [], None if columns is None else list(columns))


class ParquetFormat(DatasetFormat):
    name = "parquet"

    def __init__(
        self, shards: list[ShardSpec], schema: list[tuple[str, str]], columns: list[str] | None
    ) -> None:
        super().__init__(shards)
        self.schema = schema
        self.columns = columns

    def open_shard(self, path: str, spec: ShardSpec) -> ShardReader:
        return ParquetShardReader(path, spec, self.columns)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "row_groups": sum(len(s.extra["row_groups"]) for s in self.shards),
            "columns": dict(self.schema),
        }


def _accessor(pa: Any, col: Any) -> Callable[[int], Any]:
    """``i -> value`` over one column of a decoded row group (see the module's docstring)."""
    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    t = arr.type
    numeric = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
    get: Callable[[int], Any]
    if numeric and not arr.null_count:
        vals = arr.to_numpy(zero_copy_only=False)
        get = vals.__getitem__
    elif (pa.types.is_list(t) or pa.types.is_large_list(t)) and not arr.null_count:
        vt = t.value_type
        if not (pa.types.is_integer(vt) or pa.types.is_floating(vt)) or arr.values.null_count:
            return lambda i: arr[i].as_py()
        offs = arr.offsets.to_numpy()
        vals = arr.values.to_numpy(zero_copy_only=False)

        def get(i: int) -> Any:
            return vals[offs[i] : offs[i + 1]].copy()

    elif pa.types.is_fixed_size_list(t) and not arr.null_count:
        vt = t.value_type
        if not (pa.types.is_integer(vt) or pa.types.is_floating(vt)) or arr.values.null_count:
            return lambda i: arr[i].as_py()
        vals = arr.flatten().to_numpy(zero_copy_only=False).reshape(len(arr), t.list_size)

        def get(i: int) -> Any:
            return vals[i].copy()

    elif numeric:
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        vals = arr.fill_null(False if pa.types.is_boolean(t) else 0).to_numpy(zero_copy_only=False)

        def get(i: int) -> Any:
            return vals[i] if valid[i] else None

    else:

        def get(i: int) -> Any:
            return arr[i].as_py()

    return get


class ParquetShardReader(ShardReader):
    """Rows of one cached Parquet file, decoded a row group at a time."""

    def __init__(self, path: str, spec: ShardSpec, columns: list[str] | None) -> None:
        # No memory map: pyarrow reads the file itself.
        self.path = path
        self.buf = np.zeros(0, np.uint8)
        self._mm = None
        self.key = spec.key
        pa, pq = _pa()
        self._pa = pa
        try:
            self.pf = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise CorruptData(
                f"cached Parquet file does not open: {e}"[:300], key=spec.key
            ) from None
        try:
            with open(path, "rb") as f:
                if f.read(4) != MAGIC:
                    raise ValueError("no PAR1 magic at the start")
            md = self.pf.metadata
            check_metadata(md, os.path.getsize(path))
            groups = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
            if groups != list(spec.extra["row_groups"]):
                raise ValueError(
                    f"holds row groups of {groups} rows, but its footer said "
                    f"{list(spec.extra['row_groups'])} at start (the object changed?)"
                )
        except (ValueError, OSError) as e:
            self.close()
            raise CorruptData(f"Parquet file: {e}"[:300], key=spec.key) from None
        self.columns = columns
        self.starts = np.cumsum([0, *groups]).tolist()
        self.n = int(self.starts[-1])
        #: (group, first row) -> (Arrow bytes, rows, column accessors) of decoded slices.
        self._slices: OrderedDict[tuple[int, int], tuple[int, int, list[Any]]] = OrderedDict()
        self._bytes = 0
        #: group -> first rows of its slices, as decoding found them (ascending).
        self._bounds: dict[int, list[int]] = {}
        #: group -> (its open batch iterator, the first row of its next batch).
        self._iters: dict[int, tuple[Any, int]] = {}

    def __len__(self) -> int:
        return self.n

    def _cached(self, g: int, i: int) -> tuple[int, list[Any]] | None:
        bounds = self._bounds.get(g)
        if not bounds:
            return None
        k = bisect.bisect_right(bounds, i) - 1
        if k < 0:
            return None
        got = self._slices.get((g, bounds[k]))
        if got is None or i >= bounds[k] + got[1]:
            return None
        self._slices.move_to_end((g, bounds[k]))
        return bounds[k], got[2]

    def _slice(self, g: int, i: int) -> tuple[int, list[tuple[str, Callable[[int], Any]]]]:
        """The first row and the accessors of the decoded slice of row group ``g`` holding its row ``i``: the
        group is decoded ``SLICE_ROWS`` at a time from its start (going on from the last
        slice decoded where it can), each slice decoded kept while the cache has room."""
        got = self._cached(g, i)
        if got is not None:
            return got
        pa = self._pa
        rows = self.starts[g + 1] - self.starts[g]
        it, at = self._iters.pop(g, (None, 0))
        try:
            if it is None or at > i:
                it = self.pf.iter_batches(
                    row_groups=[g], batch_size=SLICE_ROWS, columns=self.columns
                )
                at = 0
            while True:
                batch = next(it, None)
                if batch is None:
                    raise CorruptData(
                        f"row group {g} decodes to {at} rows, not {rows}", key=self.key
                    )
                lo, at = at, at + batch.num_rows
                if at > rows:
                    raise CorruptData(f"row group {g} decodes to over {rows} rows", key=self.key)
                bounds = self._bounds.setdefault(g, [])
                if not bounds or bounds[-1] < lo:
                    bounds.append(lo)
                cols = [(nm, _accessor(pa, batch.column(nm))) for nm in batch.schema.names]
                self._keep(g, lo, batch, cols)
                if lo <= i < at:
                    break
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CorruptData(f"row group {g} does not decode: {e}"[:300], key=self.key) from None
        except MemoryError:
            raise FmstoreError(
                f"a slice of row group {g} ({rows} rows) does not fit in memory when decoded",
                key=self.key,
            ) from None
        if at < rows:
            self._iters[g] = (it, at)
        return lo, cols

    def _keep(self, g: int, lo: int, batch: Any, cols: list[Any]) -> None:
        size = int(batch.nbytes)
        while self._slices and self._bytes + size > ROW_GROUP_CACHE:
            _k, (old, _n, _c) = self._slices.popitem(last=False)
            self._bytes -= old
        self._slices[(g, lo)] = (size, batch.num_rows, cols)
        self._bytes += size

    def get(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        g = bisect.bisect_right(self.starts, index) - 1
        i = index - self.starts[g]
        lo, cols = self._slice(g, i)
        with decoding(self.key, index):  # e.g. a string column that is not UTF-8
            return {nm: get(i - lo) for nm, get in cols}

    def close(self) -> None:
        self._slices = OrderedDict()
        self._iters = {}
        pf = getattr(self, "pf", None)
        if pf is not None:
            with contextlib.suppress(Exception):
                pf.close()
            self.pf = None
