"""MosaicML MDS datasets (``index.json`` + ``shard.NNNNN.mds[.zstd]``), read directly.

Supported column encodings: ``bytes``, ``str``, ``int``, ``json``, ``ndarray[:dtype[:shape]]``,
the numpy scalars (``uint8`` … ``float64``), ``str_int`` and ``str_float``.  ``pkl`` columns
are refused unless the caller passes ``allow_pickle=True`` (unpickling runs arbitrary code).
Image encodings (``jpeg``, ``png``, ``pil``) come back as their raw bytes.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from ...errors import CorruptData, NotSupported, describe_error
from .base import DatasetFormat, ShardReader, ShardSpec, check_offsets, check_spec, decoding

_SCALARS = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
            "float16", "float32", "float64")  # fmt: skip
_NDARRAY_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32",
                   33: "int32", 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}  # fmt: skip
_SHAPE_DTYPES = {0: "uint8", 1: "uint16", 2: "uint32", 3: "uint64"}
_RAW = ("bytes", "jpeg", "png", "pil")


def _decode_ndarray(config: str, data: bytes) -> np.ndarray:
    args = config.split(":") if config else []
    i = 0
    if args and args[0]:
        dtype = args[0]
    else:
        dtype = _NDARRAY_DTYPES[data[i]]
        i += 1
    if len(args) > 1:
        shape: tuple[int, ...] = tuple(int(x) for x in args[1].split(","))
    else:
        byte = data[i]
        i += 1
        ndim, sdt = byte >> 2, _SHAPE_DTYPES[byte % 4]
        n = ndim * np.dtype(sdt).itemsize
        shape = tuple(int(x) for x in np.frombuffer(data[i : i + n], sdt))
        i += n
    return np.frombuffer(data[i:], dtype).reshape(shape).copy()


def make_decoder(encoding: str, allow_pickle: bool) -> Any:
    name, _, config = encoding.partition(":")
    if name in _RAW:
        return lambda b: b
    if name == "str":
        return lambda b: b.decode()
    if name == "int":
        return lambda b: int(np.frombuffer(b, np.int64)[0])
    if name in _SCALARS:
        dt = np.dtype(name)
        return lambda b: np.frombuffer(b, dt)[0]
    if name == "str_int":
        return lambda b: int(b.decode())
    if name == "str_float":
        return lambda b: float(b.decode())
    if name == "json":
        return json.loads
    if name == "ndarray":
        return lambda b: _decode_ndarray(config, b)
    if name == "pkl":
        if not allow_pickle:
            raise NotSupported(
                "MDS column encoded with pickle: pass allow_pickle=True to read it "
                "(unpickling runs code from the dataset)"
            )
        import pickle

        return pickle.loads
    raise NotSupported(f"MDS column encoding {encoding!r} is not supported")


def _fixed_size(encoding: str) -> int | None:
    name, _, config = encoding.partition(":")
    if name == "int":
        return 8
    if name in _SCALARS:
        return np.dtype(name).itemsize
    if name == "ndarray":
        args = config.split(":") if config else []
        if len(args) == 2 and args[0]:
            return int(np.prod([int(x) for x in args[1].split(",")])) * np.dtype(args[0]).itemsize
    return None


class MDSShardReader(ShardReader):
    def __init__(
        self, path: str, spec: ShardSpec, columns: list[tuple[str, Any, int | None]]
    ) -> None:
        super().__init__(path)
        buf = self.buf
        n = int(buf[:4].view("<u4")[0]) if len(buf) >= 4 else -1
        if n != spec.samples:
            self.close()
            raise CorruptData(
                f"MDS shard holds {n} samples but index.json lists {spec.samples}", key=spec.key
            )
        hs = 4 + 4 * (n + 1)
        if hs > len(buf):
            self.close()
            raise CorruptData("MDS shard is shorter than its offset table", key=spec.key)
        table = buf[4:hs].view("<u4")
        try:
            check_offsets(table, hs, len(buf), key=spec.key, what="MDS shard")
        except CorruptData:
            self.close()
            raise
        self.offsets = table.astype(np.int64)
        self.columns = columns
        self.n = n
        self.key = spec.key

    def __len__(self) -> int:
        return self.n

    def get(self, index: int) -> dict[str, Any]:
        with decoding(self.key, index):
            return decode_sample(
                self.columns, self.buf[self.offsets[index] : self.offsets[index + 1]].tobytes()
            )


def decode_sample(columns: list[tuple[str, Any, int | None]], data: bytes) -> dict[str, Any]:
    sizes = []
    i = 0
    for _name, _dec, size in columns:
        if size is None:
            size = int.from_bytes(data[i : i + 4], "little")
            i += 4
        sizes.append(size)
    if i + sum(sizes) != len(data):
        raise ValueError(f"columns take {i + sum(sizes)} bytes of a {len(data)}-byte sample")
    out = {}
    for (name, dec, _), size in zip(columns, sizes, strict=True):
        out[name] = dec(data[i : i + size])
        i += size
    return out


class MDSFormat(DatasetFormat):
    name = "mds"

    def __init__(self, shards: list[ShardSpec], allow_pickle: bool) -> None:
        super().__init__(shards)
        self.allow_pickle = allow_pickle
        self._columns: dict[tuple[tuple[str, ...], tuple[str, ...]], list[Any]] = {}
        for s in shards:  # fail at start, not in a worker, on an unsupported column
            self._layout(s)

    def _layout(self, spec: ShardSpec) -> list[tuple[str, Any, int | None]]:
        names, encs = tuple(spec.extra["column_names"]), tuple(spec.extra["column_encodings"])
        cols = self._columns.get((names, encs))
        if cols is None:
            if not all(isinstance(x, str) for x in (*names, *encs)):
                raise ValueError("column names and encodings must be strings")
            sizes = spec.extra.get("column_sizes") or [_fixed_size(e) for e in encs]
            if not all(sz is None or (type(sz) is int and sz >= 0) for sz in sizes):
                raise ValueError(f"column_sizes {sizes!r} are not sizes")
            cols = [
                (n, make_decoder(e, self.allow_pickle), sz)
                for n, e, sz in zip(names, encs, sizes, strict=True)
            ]
            self._columns[(names, encs)] = cols
        return cols

    def open_shard(self, path: str, spec: ShardSpec) -> ShardReader:
        return MDSShardReader(path, spec, self._layout(spec))

    def header_size(self, spec: ShardSpec) -> int | None:
        return None if spec.compression else 4 + 4 * (spec.samples + 1)

    def check_header(self, spec: ShardSpec, header: bytes) -> None:
        (n,) = struct.unpack_from("<I", header)
        if n != spec.samples:
            raise CorruptData(
                f"MDS shard holds {n} samples but index.json lists {spec.samples}", key=spec.key
            )

    def sample_range(self, spec: ShardSpec, header: bytes, index: int) -> tuple[int, int]:
        lo, hi = struct.unpack_from("<II", header, 4 + 4 * index)
        if not lo <= hi <= spec.size:
            raise CorruptData(f"MDS sample {index} has bad offsets {lo}..{hi}", key=spec.key)
        return lo, hi

    def decode(self, spec: ShardSpec, data: bytes) -> Any:
        with decoding(spec.key, -1):
            return decode_sample(self._layout(spec), data)

    def describe(self) -> dict[str, Any]:
        cols = (
            dict(
                zip(
                    self.shards[0].extra["column_names"],
                    self.shards[0].extra["column_encodings"],
                    strict=True,
                )
            )
            if self.shards
            else {}
        )
        return {**super().describe(), "columns": cols}


def is_mds_index(doc: Any) -> bool:
    return (
        isinstance(doc, dict)
        and isinstance(doc.get("shards"), list)
        and all(isinstance(s, dict) and s.get("format") == "mds" for s in doc["shards"])
        and bool(doc["shards"])
    )


def _n(v: Any) -> int:
    if type(v) is not int:
        raise TypeError(f"{v!r} is not an int")
    return v


def from_index(doc: dict[str, Any], *, allow_pickle: bool, where: str) -> MDSFormat:
    shards = []
    for i, s in enumerate(doc["shards"]):
        try:
            raw, zipped = s["raw_data"], s.get("zip_data")
            comp = s.get("compression")
            extra = {
                "column_names": s["column_names"],
                "column_encodings": s["column_encodings"],
                "column_sizes": s.get("column_sizes"),
            }
            if comp:
                algo = str(comp).split(":")[0]
                if algo != "zstd" or not zipped:
                    raise NotSupported(
                        f"MDS compression {comp!r} is not supported (zstd is)", key=where
                    )
                spec = ShardSpec(key=zipped["basename"], samples=_n(s["samples"]), size=_n(zipped["bytes"]),
                                 compression="zstd", raw_size=_n(raw["bytes"]), extra=extra)  # fmt: skip
            else:
                spec = ShardSpec(
                    key=raw["basename"],
                    samples=_n(s["samples"]),
                    size=_n(raw["bytes"]),
                    extra=extra,
                )
            check_spec(spec, entry=i, where=where)
            if 4 + 4 * (spec.samples + 1) > spec.cached_size:
                raise CorruptData(
                    f"MDS index.json entry {i}: {spec.samples} 'samples' cannot fit in "
                    f"{spec.cached_size} bytes",
                    key=where,
                )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptData(
                f"MDS index.json entry {i} is malformed ({describe_error(e)})", key=where
            ) from None
        shards.append(spec)
    try:
        return MDSFormat(shards, allow_pickle)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptData(
            f"MDS index.json columns are malformed ({describe_error(e)})", key=where
        ) from None
