"""Dataset formats behind one shard interface, and :func:`load_format` that detects them.

Detection at the dataset's root: an ``index.json`` written by fmstore → :mod:`.fmstore`
(samples) or :mod:`.tokens` (tokens); an MDS ``index.json`` → :mod:`.mds`; otherwise
``*.tar`` objects → :mod:`.wds`, ``*.bin`` / ``*.npy`` objects → :mod:`.tokens`,
``*.parquet`` objects (at any depth) → :mod:`.parquet`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import runtime
from ...errors import ConfigError, CorruptData, NotFound, describe_error
from ...stores import Store
from ...stores.bounded import decode_json, index_limit, read_bounded
from . import fmstore as fms
from . import mds, parquet, tokens, wds
from .base import DatasetFormat, ShardReader, ShardSpec

__all__ = ["DatasetFormat", "FormatOptions", "ShardReader", "ShardSpec", "load_format"]

FORMATS = ("fmstore", "tokens", "webdataset", "mds", "parquet")


@dataclass(frozen=True)
class FormatOptions:
    """How to read a dataset.

    ``format``: one of ``fmstore``, ``tokens``, ``webdataset``, ``mds``, ``parquet``
    (``None``: detect).
    ``seq_len`` / ``dtype`` / ``targets``: token streams (sample = ``seq_len`` tokens, plus one
    for the targets when ``targets``); ``dtype`` is how the tokens are stored.
    ``sample_dtype``: the dtype token samples are yielded as, ``int64`` by default (what
    ``nn.Embedding`` and ``cross_entropy`` take; the storage stays compact), None: the
    storage dtype (a quarter of the bytes of ``uint16`` tokens; cast them on the device).  ``shard_bytes``: size of the virtual shards a large
    token file is cut into.  ``allow_pickle``: read MDS ``pkl`` columns.  ``columns``: the
    Parquet columns to read (``None``: all).
    """

    format: str | None = None
    seq_len: int | None = None
    dtype: str | None = None
    targets: bool = True
    shard_bytes: int = 64 << 20
    allow_pickle: bool = False
    columns: tuple[str, ...] | None = None
    sample_dtype: str | None = "int64"

    def __post_init__(self) -> None:
        if self.sample_dtype is not None and self.sample_dtype not in tokens.DTYPES:
            raise ConfigError(
                f"sample_dtype must be one of {', '.join(tokens.DTYPES)} or None, "
                f"not {self.sample_dtype!r}"
            )
        if self.columns is not None:
            if isinstance(self.columns, str) or not all(isinstance(c, str) for c in self.columns):
                raise ConfigError(f"columns must be a list of column names, not {self.columns!r}")
            object.__setattr__(self, "columns", tuple(self.columns))
        if self.format is not None and self.format not in FORMATS:
            raise ConfigError(
                f"unknown dataset format {self.format!r}; known: {', '.join(FORMATS)}"
            )


def load_format(
    store: Store, options: FormatOptions, *, index_dir: str | None = None
) -> DatasetFormat:
    """Read the dataset's index (or list it) and return its format with every shard.

    Raises :class:`NotFound` when there is no dataset at the root, :class:`CorruptData` when
    the index does not parse, :class:`ConfigError` for options that do not fit the data.
    """
    fmt = _load(store, options, index_dir)
    if not fmt.shards or fmt.num_samples == 0:
        raise NotFound("dataset holds no samples", tier=store.tier, key=store.url)
    return fmt


def _load(store: Store, o: FormatOptions, index_dir: str | None) -> DatasetFormat:
    doc = None
    if o.format in (None, "fmstore", "mds", "tokens"):
        try:
            raw = runtime.run(
                read_bounded(store, fms.INDEX_KEY, index_limit(), what="dataset index")
            )
        except NotFound:
            raw = None
        if raw is not None:
            try:
                doc = decode_json(raw)
            except ValueError as e:  # decode_json's own: short, never quoting the input
                raise CorruptData(
                    f"index.json is not valid JSON: {e}", tier=store.tier, key=fms.INDEX_KEY
                ) from None
            del raw  # parsed once; the text need not outlive it
    if isinstance(doc, dict) and doc.get("format") == fms.FORMAT_NAME:
        doc = fms.check_index(doc, where=f"{store.url}/{fms.INDEX_KEY}")
        if doc["kind"] == "tokens":
            dtype, seq_len = tokens.check_options(o.dtype or doc.get("dtype"), o.seq_len)
            extra = 1 if o.targets else 0
            itemsize = np.dtype(dtype).itemsize
            specs = fms.shard_specs(doc, where=fms.INDEX_KEY)
            shards = []
            for i, s in enumerate(specs):
                if s.samples * itemsize > s.cached_size:  # the index counts tokens
                    raise CorruptData(
                        f"index entry {i} ({s.key!r}): {s.samples} tokens do not fit in "
                        f"{s.cached_size} bytes",
                        tier=store.tier,
                        key=fms.INDEX_KEY,
                    )
                n = max(0, (s.samples - extra) // seq_len)
                if n:
                    shards.append(dataclasses.replace(s, samples=n))
            _check_sizes(store, specs)
            return tokens.TokenFormat(shards, dtype, seq_len, o.targets, o.sample_dtype)
        if o.format not in (None, "fmstore"):
            raise ConfigError(f"{store.url} is an fmstore dataset, not {o.format}")
        fmt = fms.from_index(doc, where=fms.INDEX_KEY)
        _check_sizes(store, fmt.shards)
        return fmt
    if doc is not None and mds.is_mds_index(doc):
        mfmt = mds.from_index(doc, allow_pickle=o.allow_pickle, where=fms.INDEX_KEY)
        _check_sizes(store, mfmt.shards)
        return mfmt
    if doc is not None and o.format in ("fmstore", "mds"):
        raise CorruptData(
            f"index.json is not an {o.format} index: {_not_an_index(doc)}",
            tier=store.tier,
            key=fms.INDEX_KEY,
        )
    if o.format in ("fmstore", "mds"):
        raise NotFound(
            f"no index.json: not an {o.format} dataset", tier=store.tier, key=fms.INDEX_KEY
        )

    metas = [m for m in runtime.run(_list(store)) if not m.is_dir]
    tars = [m for m in metas if m.key.endswith(".tar")]
    toks = [m for m in metas if m.key.endswith((".bin", ".npy"))]
    pqs = [m for m in metas if parquet.is_parquet_key(m.key)]
    if o.format in (None, "webdataset") and tars:
        return _wds(store, tars, index_dir)
    if o.format in (None, "tokens") and toks:
        return _tokens(store, toks, o)
    if o.format in (None, "parquet") and pqs:
        return parquet.load(store, pqs, o.columns)
    if o.format == "parquet":
        raise NotFound("no *.parquet files here", tier=store.tier, key=store.url)
    if not metas:
        raise NotFound(
            "no dataset here: no index.json and no shards", tier=store.tier, key=store.url
        )
    index = (
        f"index.json is not a dataset index ({_not_an_index(doc)})"
        if doc is not None
        else "no index.json"
    )
    raise NotFound(
        f"{index}, no .tar shards, no .bin/.npy token files and no .parquet files",
        tier=store.tier,
        key=store.url,
    )


def _not_an_index(doc: Any) -> str:
    """What a parsed ``index.json`` that is neither fmstore's nor MDS's index lacks."""
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    fmt = doc.get("format")
    if isinstance(fmt, str) and fmt != fms.FORMAT_NAME:
        return f"its 'format' is {fmt[:80]!r}, not {fms.FORMAT_NAME!r}"
    if fmt is not None and fmt != fms.FORMAT_NAME:
        return f"its 'format' is a JSON {type(fmt).__name__}, not {fms.FORMAT_NAME!r}"
    shards = doc.get("shards")
    if not isinstance(shards, list):
        return "it has no 'format' and no list of 'shards'"
    if not shards:
        return "its list of 'shards' is empty"
    return 'its \'shards\' are not MDS shards (each with "format": "mds")'


async def _list(store: Store) -> list[Any]:
    return [m async for m in store.list("")]


def _check_sizes(store: Store, specs: list[ShardSpec]) -> None:
    """Compare each shard the index lists with its object's real size (one listing, not a
    request per shard), so a hostile index cannot make the cache reserve, or the download
    plan for, more bytes than exist.  A shard missing here is reported when it is needed."""
    real = {m.key: m.size for m in runtime.run(_list(store)) if not m.is_dir}
    for i, s in enumerate(specs):
        size = real.get(s.key)
        if size is not None and s.start + s.size != size:
            raise CorruptData(
                f"index entry {i} lists {s.size} 'bytes' for {s.key!r}, which holds {size}",
                tier=store.tier,
                key=fms.INDEX_KEY,
            )


def _tokens(store: Store, metas: list[Any], o: FormatOptions) -> DatasetFormat:
    # A .npy file's header says its dtype: without ``dtype`` the files' own is used (the
    # same in every file); raw .bin files have none to say, so they need ``dtype``.
    headers = {m.key: _npy_header(store, m.key) for m in metas if m.key.endswith(".npy")}
    dtype_opt = o.dtype
    if dtype_opt is None and headers:
        bins = [m.key for m in metas if m.key not in headers]
        if bins:
            raise ConfigError(
                f"{bins[0]} is a raw token file (no header): give dtype ({', '.join(tokens.DTYPES)})"
            )
        dtype_opt = next(iter(headers.values()))[1].name
    dtype, seq_len = tokens.check_options(dtype_opt, o.seq_len)
    itemsize = np.dtype(dtype).itemsize
    shards: list[ShardSpec] = []
    for m in metas:
        start = 0
        if m.key in headers:
            start, file_dtype = headers[m.key]
            if file_dtype.name != dtype:
                raise ConfigError(f"{m.key} holds {file_dtype.name} tokens, not {dtype}")
        shards += tokens.split_file(
            m.key, data_start=start, data_bytes=m.size - start, itemsize=itemsize, seq_len=seq_len,
            extra=1 if o.targets else 0, shard_bytes=o.shard_bytes,
        )  # fmt: skip
    return tokens.TokenFormat(shards, dtype, seq_len, o.targets, o.sample_dtype)


def _npy_header(store: Store, key: str) -> tuple[int, np.dtype]:
    import io

    head = runtime.run(store.get_range(key, 0, min(4096, runtime.run(store.stat(key)).size)))
    f = io.BytesIO(head)
    try:
        fmt = np.lib.format
        version = fmt.read_magic(f)
        # The public readers (numpy 2.4 dropped the private one that took the version);
        # version 3.0 (UTF-8 field names) is read by the private one where there is one.
        read = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
        if read is not None:
            shape, fortran, dtype = read(f)
        else:
            shape, fortran, dtype = fmt._read_array_header(f, version)  # type: ignore[attr-defined]
    except Exception as e:
        # numpy parses the header (a Python literal) with tokenize and ast: a damaged one
        # raises ValueError, SyntaxError, tokenize.TokenError, ... depending on the damage.
        raise CorruptData(
            f"not a .npy file: {describe_error(e)}", tier=store.tier, key=key
        ) from None
    if len(shape) != 1:
        raise ConfigError(f"{key}: token arrays must be 1-D, not shape {shape}")
    if dtype.byteorder == ">" and dtype.itemsize > 1:
        # Tokens are read little-endian; a big-endian file would give other numbers.
        raise ConfigError(f"{key}: holds big-endian {dtype.name} tokens; save it little-endian")
    return f.tell(), dtype


def _wds(store: Store, metas: list[Any], index_dir: str | None) -> DatasetFormat:
    # Kept beside the cache's shards but outside its accounting and eviction.
    meta_dir = os.path.join(index_dir, ".meta") if index_dir else None
    cache_file = os.path.join(meta_dir, "wds-index.json") if meta_dir else None
    known: dict[str, Any] = {}
    if cache_file and os.path.exists(cache_file):
        try:
            with open(cache_file) as f:
                known = json.load(f)
        except (OSError, ValueError, RecursionError):
            known = {}
        if not isinstance(known, dict):
            known = {}
    # A member table is used only when well-formed and fitting its shard; others are rescanned.
    todo = [
        m
        for m in metas
        if not isinstance(known.get(m.key), dict)
        or known[m.key].get("tag") != [m.size, m.etag]
        or not wds.members_ok(known[m.key].get("members"), m.size)
    ]

    def scan(m: Any) -> tuple[str, Any]:
        return m.key, {"tag": [m.size, m.etag], "members": wds.scan_tar(store, m.key, m.size)}

    if todo:
        with ThreadPoolExecutor(8) as ex:
            known.update(dict(ex.map(scan, todo)))
        if cache_file:
            os.makedirs(meta_dir or ".", exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=meta_dir, prefix=".wds-index.")
            with os.fdopen(fd, "w") as f:
                json.dump(known, f)
            os.replace(tmp, cache_file)
    shards = [wds.spec_for(m.key, m.size, known[m.key]["members"]) for m in metas]
    return wds.WDSFormat([s for s in shards if s.samples])
