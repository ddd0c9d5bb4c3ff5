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

from ...errors import CorruptData, NotSupported
from .base import DatasetFormat, ShardReader, ShardSpec

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
        self.offsets = buf[4 : 4 + 4 * (n + 1)].view("<u4").astype(np.int64)
        if int(self.offsets[-1]) > len(buf):
            self.close()
            raise CorruptData("MDS shard is shorter than its offset table says", key=spec.key)
        self.columns = columns
        self.n = n

    def __len__(self) -> int:
        return self.n

    def get(self, index: int) -> dict[str, Any]:
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
            sizes = spec.extra.get("column_sizes") or [_fixed_size(e) for e in encs]
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
        return lo, hi

    def decode(self, spec: ShardSpec, data: bytes) -> Any:
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
                spec = ShardSpec(key=zipped["basename"], samples=int(s["samples"]), size=int(zipped["bytes"]),
                                 compression="zstd", raw_size=int(raw["bytes"]), extra=extra)  # fmt: skip
            else:
                spec = ShardSpec(
                    key=raw["basename"],
                    samples=int(s["samples"]),
                    size=int(raw["bytes"]),
                    extra=extra,
                )
        except (KeyError, TypeError, ValueError):
            raise CorruptData(f"MDS index.json entry {i} is malformed", key=where) from None
        shards.append(spec)
    return MDSFormat(shards, allow_pickle)
