"""``fmstore dataset write``: convert JSONL, text files, a directory of files or numpy token
arrays into fmstore shards on any store.

Shards are written first, ``index.json`` last: a destination without an index is not a
dataset, so an interrupted conversion is never mistaken for a finished one.  A destination
that already holds a dataset is refused unless ``overwrite``; then its index goes first
(no reader pairs the old index with new shards) and, once the new index is written, the
shards it does not name (the old index's, and any ``shard-NNNNN`` this writer left) go too.
Other files under the destination are left alone.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
import zstandard

from .. import runtime
from ..errors import AlreadyExists, ConfigError, CorruptData, NotFound
from ..stores import Store, open_store
from ..stores.bounded import index_limit, read_bounded
from .formats import fmstore as fms

INPUTS = ("auto", "jsonl", "text", "files", "tokens")
DEFAULT_SHARD_SIZE = 64 << 20

#: ``progress(bytes_read, samples_written)``
Progress = Callable[[int, int], None]
#: The names this writer gives shards.
_SHARD_KEY = re.compile(r"shard-\d{5,}\.(?:fms|tok)(?:\.zst)?")


def checksum(data: bytes | memoryview) -> str:
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class WriteResult:
    shards: int
    samples: int
    bytes: int
    kind: str


def detect_input(src: Path) -> str:
    if src.is_dir():
        exts = {p.suffix for p in src.rglob("*") if p.is_file()}
        if exts and exts <= {".jsonl"}:
            return "jsonl"
        if exts and exts <= {".txt"}:
            return "text"
        if exts and exts <= {".npy"}:
            return "tokens"
        return "files"
    return {".jsonl": "jsonl", ".txt": "text", ".npy": "tokens", ".bin": "tokens"}.get(
        src.suffix, "files"
    )


def _files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    return sorted(p for p in src.rglob("*") if p.is_file())


def write_dataset(
    src: str | os.PathLike[str],
    dst: str | Store,
    *,
    input_format: str = "auto",
    shard_size: int = DEFAULT_SHARD_SIZE,
    compression: str | None = None,
    dtype: str | None = None,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> WriteResult:
    """Convert ``src`` (a local file or directory) into an fmstore dataset at ``dst``.

    ``input_format``: ``jsonl`` (one sample per line, read back as dicts), ``text`` (one
    sample per file, read back as ``str``), ``files`` (one sample per file, read back as
    ``{"__key__": relative path, "data": bytes}``), ``tokens`` (``.npy`` or raw ``.bin``
    token arrays, ``dtype`` needed for ``.bin``; read back as fixed-length sequences), or
    ``auto`` (by extension).  ``compression``: ``None`` or ``"zstd"``.  ``overwrite``:
    replace a dataset already at ``dst`` (:class:`AlreadyExists` without it), removing the
    shards the new index does not name.
    """
    srcp = Path(src)
    if not srcp.exists():
        raise NotFound(f"source {str(srcp)!r} does not exist")
    if input_format not in INPUTS:
        raise ConfigError(f"unknown input format {input_format!r}; known: {', '.join(INPUTS)}")
    if compression not in (None, "zstd"):
        raise ConfigError(f"unknown compression {compression!r}: use zstd or none")
    if shard_size < 1:
        raise ConfigError("shard_size must be positive")
    kind = detect_input(srcp) if input_format == "auto" else input_format
    store = open_store(dst) if isinstance(dst, str) else dst
    stale = _make_room(store, overwrite)
    w = _ShardWriter(store, shard_size, compression, progress)
    if kind == "tokens":
        dt = w.write_tokens(_files(srcp), dtype)
        doc = {"kind": "tokens", "dtype": dt}
    else:
        encoding = {"jsonl": "json", "text": "text", "files": "file"}[kind]
        w.write_samples(_samples(srcp, kind))
        doc = {"kind": "samples", "encoding": encoding}
    if not w.entries:
        raise NotFound(f"source {str(srcp)!r} holds no samples")
    index = {
        "format": fms.FORMAT_NAME,
        "version": fms.VERSION,
        **doc,
        "samples": w.samples,
        "bytes": w.bytes,
        "shards": w.entries,
    }
    runtime.run(store.put(fms.INDEX_KEY, json.dumps(index, indent=1).encode()))
    _drop_stale(store, stale, w.entries)
    return WriteResult(shards=len(w.entries), samples=w.samples, bytes=w.bytes, kind=doc["kind"])


def _make_room(store: Store, overwrite: bool) -> set[str]:
    """Before a write: refuse a destination holding a dataset (an ``index.json``) unless
    ``overwrite``, then remove that index; return the keys that may be stale once the new
    index is written (the shards the old index named, and this writer's)."""

    async def go() -> set[str]:
        try:
            old = await read_bounded(store, fms.INDEX_KEY, index_limit(), what="dataset index")
        except NotFound:
            old = None
        except CorruptData:  # over the limit, unread: a dataset all the same, naming nothing
            old = b""
        if old is not None and not overwrite:
            raise AlreadyExists(
                f"{store.url} already holds a dataset: pass --overwrite (overwrite=True) to "
                "replace it (shards the new index does not name are then removed)",
                tier=store.tier,
                key=fms.INDEX_KEY,
            )
        try:
            keys = await store.list_keys()
        except NotFound:
            keys = []
        stale = {k for k in keys if _SHARD_KEY.fullmatch(k)}
        if old is not None:
            stale |= set(keys) & _named(old)
            await store.delete(fms.INDEX_KEY)
        return stale

    return runtime.run(go())


def _named(index: bytes) -> set[str]:
    """The shard keys an existing ``index.json`` names (none when it is not fmstore's)."""
    try:
        doc = fms.parse_index(index, where=fms.INDEX_KEY)
    except (CorruptData, ValueError):
        return set()
    return {s["key"] for s in doc.get("shards", []) if isinstance(s, dict) and "key" in s}


def _drop_stale(store: Store, stale: set[str], entries: list[dict]) -> None:
    gone = stale - {e["key"] for e in entries} - {fms.INDEX_KEY}
    if gone:
        runtime.run(store.delete_many(sorted(gone)))


def write_samples(
    samples: Iterable[Any],
    dst: str | Store,
    *,
    encoding: str = "bytes",
    shard_size: int = DEFAULT_SHARD_SIZE,
    compression: str | None = None,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> WriteResult:
    """Write samples from Python into an fmstore dataset at ``dst``.

    ``encoding``: ``bytes`` (each sample ``bytes``), ``text`` (``str``) or ``json`` (any
    JSON-serialisable value); samples read back the same way.  ``overwrite``: as for
    :func:`write_dataset`.
    """
    if encoding not in ("bytes", "text", "json"):
        raise ConfigError(f"encoding must be bytes, text or json, not {encoding!r}")
    if compression not in (None, "zstd"):
        raise ConfigError(f"unknown compression {compression!r}: use zstd or none")

    def encoded() -> Iterator[tuple[bytes, int]]:
        for x in samples:
            b = (
                x
                if encoding == "bytes"
                else x.encode()
                if encoding == "text"
                else json.dumps(x).encode()
            )
            yield bytes(b), len(b)

    store = open_store(dst) if isinstance(dst, str) else dst
    stale = _make_room(store, overwrite)
    w = _ShardWriter(store, shard_size, compression, progress)
    w.write_samples(encoded())
    if not w.entries:
        raise NotFound("no samples to write")
    index = {
        "format": fms.FORMAT_NAME,
        "version": fms.VERSION,
        "kind": "samples",
        "encoding": encoding,
        "samples": w.samples,
        "bytes": w.bytes,
        "shards": w.entries,
    }
    runtime.run(store.put(fms.INDEX_KEY, json.dumps(index, indent=1).encode()))
    _drop_stale(store, stale, w.entries)
    return WriteResult(shards=len(w.entries), samples=w.samples, bytes=w.bytes, kind="samples")


def _samples(src: Path, kind: str) -> Iterator[tuple[bytes, int]]:
    """``(sample bytes, source bytes consumed)``."""
    base = src if src.is_dir() else src.parent
    for p in _files(src):
        if kind == "jsonl":
            with open(p, "rb") as f:
                for n, line in enumerate(f, 1):
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        json.loads(line)
                    except ValueError:
                        raise ConfigError(f"{p}:{n}: not a JSON line") from None
                    yield line, len(line) + 1
        elif kind == "text":
            data = p.read_bytes()
            data.decode()  # refuse non-UTF-8 text early
            yield data, len(data)
        else:
            data = p.read_bytes()
            yield fms.encode_file_sample(str(p.relative_to(base)), data), len(data)


class _ShardWriter:
    def __init__(
        self, store: Store, shard_size: int, compression: str | None, progress: Progress | None
    ) -> None:
        self.store, self.shard_size, self.compression, self.progress = (
            store,
            shard_size,
            compression,
            progress,
        )
        self.entries: list[dict] = []
        self.samples = 0
        self.bytes = 0
        self.read = 0

    def _put(self, raw: bytes, samples: int, ext: str) -> None:
        key = f"shard-{len(self.entries):05d}.{ext}"
        stored = raw
        if self.compression == "zstd":
            stored = zstandard.ZstdCompressor(level=3, threads=-1).compress(raw)
            key += ".zst"
        runtime.run(self.store.put(key, stored))
        self.entries.append({
            "key": key,
            "samples": samples,
            "bytes": len(stored),
            "raw_bytes": len(raw),
            "checksum": checksum(stored),
            "compression": self.compression,
        })  # fmt: skip
        self.samples += samples
        self.bytes += len(stored)
        if self.progress:
            self.progress(self.read, self.samples)

    def write_samples(self, it: Iterator[tuple[bytes, int]]) -> None:
        batch: list[bytes] = []
        size = 0
        for data, consumed in it:
            self.read += consumed
            batch.append(data)
            size += len(data) + 8
            if size >= self.shard_size:
                self._put(fms.encode_shard(batch), len(batch), "fms")
                batch, size = [], 0
        if batch:
            self._put(fms.encode_shard(batch), len(batch), "fms")

    def write_tokens(self, files: list[Path], dtype: str | None) -> str:
        """Flat token shards; ``samples`` in the index counts tokens."""
        out_dtype: np.dtype | None = None
        for p in files:
            if p.suffix == ".npy":
                arr = np.load(p, mmap_mode="r")
            else:
                if dtype is None:
                    raise ConfigError(f"{p}: raw .bin token files need --dtype (uint16 or uint32)")
                arr = np.memmap(p, dtype=np.dtype(dtype), mode="r")
            if arr.ndim != 1:
                raise ConfigError(f"{p}: token arrays must be 1-D, not shape {arr.shape}")
            if out_dtype is None:
                out_dtype = arr.dtype
            elif arr.dtype != out_dtype:
                raise ConfigError(f"{p}: holds {arr.dtype} tokens, the first file {out_dtype}")
            per = max(1, self.shard_size // arr.dtype.itemsize)
            for lo in range(0, len(arr), per):
                part = np.ascontiguousarray(arr[lo : lo + per]).astype(arr.dtype.newbyteorder("<"))
                self.read += part.nbytes
                self._put(part.tobytes(), len(part), "tok")
        if out_dtype is None:
            return dtype or "uint16"
        return out_dtype.name
