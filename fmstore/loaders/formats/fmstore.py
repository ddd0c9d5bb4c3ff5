"""fmstore's own shard format (version 1); see ``docs/dataloader.md`` for the byte layout.

A dataset is a prefix holding ``index.json`` (written last: it is the commit) and shard
objects.  A *samples* shard is::

    b"FMSHARD1"                      8-byte magic (the trailing digit is the version)
    uint64 n                         number of samples, little-endian
    uint64 offsets[n + 1]            sample i is data[offsets[i]:offsets[i + 1]]
    data                             the samples' bytes, back to back

A *tokens* shard is a flat little-endian array of ``dtype`` tokens with no header (the same
bytes nanoGPT and Megatron write), read by :mod:`fmstore.loaders.formats.tokens`.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from ...errors import CorruptData, VersionError, describe_error
from ...stores.bounded import decode_json
from .base import DatasetFormat, ShardReader, ShardSpec, check_offsets, check_spec, decoding

MAGIC = b"FMSHARD1"
INDEX_KEY = "index.json"
FORMAT_NAME = "fmstore-dataset"
VERSION = 1
ENCODINGS = ("bytes", "text", "json", "file")
_HEAD = struct.Struct("<8sQ")


def encode_shard(samples: list[bytes]) -> bytes:
    """The bytes of one samples shard holding ``samples`` in order."""
    sizes = np.fromiter((len(s) for s in samples), np.uint64, len(samples))
    offsets = np.zeros(len(samples) + 1, np.uint64)
    np.cumsum(sizes, out=offsets[1:])
    return b"".join([_HEAD.pack(MAGIC, len(samples)), offsets.astype("<u8").tobytes(), *samples])


def header_size(n: int) -> int:
    return _HEAD.size + 8 * (n + 1)


def encode_file_sample(name: str, data: bytes) -> bytes:
    raw = name.encode()
    return struct.pack("<I", len(raw)) + raw + data


def decode_sample(encoding: str, data: bytes) -> Any:
    if encoding == "bytes":
        return data
    if encoding == "text":
        return data.decode()
    if encoding == "json":
        return json.loads(data)
    if encoding == "file":
        (n,) = struct.unpack_from("<I", data)
        return {"__key__": data[4 : 4 + n].decode(), "data": data[4 + n :]}
    raise CorruptData(f"unknown sample encoding {encoding!r}")


class FmstoreShardReader(ShardReader):
    def __init__(self, path: str, spec: ShardSpec, encoding: str) -> None:
        super().__init__(path)
        self.encoding = encoding
        buf = self.buf
        if len(buf) < _HEAD.size or bytes(buf[:8]) != MAGIC:
            self.close()
            if len(buf) >= 8 and bytes(buf[:7]) == MAGIC[:7]:
                raise VersionError(
                    f"shard format {bytes(buf[:8])!r} is newer than {MAGIC!r}", key=spec.key
                )
            raise CorruptData("not an fmstore shard (bad magic)", key=spec.key)
        n = int(buf[8:16].view("<u8")[0])
        if n != spec.samples:
            self.close()
            raise CorruptData(
                f"shard holds {n} samples but the index lists {spec.samples}", key=spec.key
            )
        hs = header_size(n)
        if hs > len(buf):
            self.close()
            raise CorruptData("shard is shorter than its offset table", key=spec.key)
        table = buf[_HEAD.size : hs].view("<u8")
        try:
            check_offsets(table, 0, len(buf) - hs, key=spec.key, what="shard")
        except CorruptData:
            self.close()
            raise
        self.offsets = table.astype(np.int64) + hs
        self.n = n
        self.key = spec.key

    def __len__(self) -> int:
        return self.n

    def get(self, index: int) -> Any:
        o = self.offsets
        with decoding(self.key, index):
            return decode_sample(self.encoding, self.buf[o[index] : o[index + 1]].tobytes())


class FmstoreFormat(DatasetFormat):
    """Samples shards written by ``fmstore dataset write``."""

    name = "fmstore"

    def __init__(self, shards: list[ShardSpec], encoding: str) -> None:
        super().__init__(shards)
        self.encoding = encoding

    def open_shard(self, path: str, spec: ShardSpec) -> ShardReader:
        return FmstoreShardReader(path, spec, self.encoding)

    def header_size(self, spec: ShardSpec) -> int | None:
        return None if spec.compression else header_size(spec.samples)

    def check_header(self, spec: ShardSpec, header: bytes) -> None:
        magic, n = _HEAD.unpack_from(header)
        if magic != MAGIC:
            raise CorruptData("not an fmstore shard (bad magic)", key=spec.key)
        if n != spec.samples:
            raise CorruptData(
                f"shard holds {n} samples but the index lists {spec.samples}", key=spec.key
            )

    def sample_range(self, spec: ShardSpec, header: bytes, index: int) -> tuple[int, int]:
        lo, hi = struct.unpack_from("<QQ", header, _HEAD.size + 8 * index)
        base = header_size(spec.samples)
        if not lo <= hi <= spec.size - base:
            raise CorruptData(f"sample {index} has bad offsets {lo}..{hi}", key=spec.key)
        return base + lo, base + hi

    def decode(self, spec: ShardSpec, data: bytes) -> Any:
        with decoding(spec.key, -1):
            return decode_sample(self.encoding, data)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "encoding": self.encoding}


def parse_index(raw: bytes, *, where: str) -> dict[str, Any]:
    """Validate an fmstore ``index.json`` and return it as a dict."""
    try:
        doc = decode_json(raw)
    except ValueError as e:  # decode_json's own: short, never quoting the input
        raise CorruptData(f"index is not valid JSON: {e}", key=where) from None
    return check_index(doc, where=where)


def check_index(doc: Any, *, where: str) -> dict[str, Any]:
    """``doc``, a parsed ``index.json``, when it is an fmstore dataset index."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptData("not an fmstore dataset index", key=where)
    version = doc.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise VersionError(f"dataset index version {version!r} is newer than {VERSION}", key=where)
    if doc.get("kind") not in ("samples", "tokens") or not isinstance(doc.get("shards"), list):
        raise CorruptData("index lacks 'kind' or 'shards'", key=where)
    return doc


def shard_specs(doc: dict[str, Any], *, where: str) -> list[ShardSpec]:
    out = []
    for i, s in enumerate(doc["shards"]):
        try:
            spec = ShardSpec(
                key=_field(s, "key", str),
                samples=_field(s, "samples", int),
                size=_field(s, "bytes", int),
                checksum=s.get("checksum"),
                compression=s.get("compression"),
                raw_size=_field(s, "raw_bytes", int) if s.get("raw_bytes") is not None else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptData(
                f"index entry {i} of 'shards' is malformed ({describe_error(e)})", key=where
            ) from None
        out.append(check_spec(spec, entry=i, where=where))
    return out


def _field(d: dict[str, Any], name: str, typ: type) -> Any:
    v = d[name]
    if type(v) is not typ:
        raise TypeError(f"{name!r} is {v!r}, not {typ.__name__}")
    return v


def from_index(doc: dict[str, Any], *, where: str) -> FmstoreFormat:
    encoding = doc.get("encoding", "bytes")
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        raise CorruptData(f"unknown sample encoding {encoding!r}", key=where)
    specs = shard_specs(doc, where=where)
    for i, s in enumerate(specs):
        if header_size(s.samples) > s.cached_size:
            raise CorruptData(
                f"index entry {i} ({s.key!r}): {s.samples} 'samples' cannot fit in "
                f"{s.cached_size} bytes",
                key=where,
            )
    return FmstoreFormat(specs, encoding)
