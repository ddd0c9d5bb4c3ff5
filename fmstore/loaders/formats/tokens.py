"""Pre-tokenized token streams read as fixed-length sequences.

The input is one or more flat little-endian ``uint16`` / ``uint32`` arrays: nanoGPT's and
Megatron's ``.bin`` files (no header), ``.npy`` files, or the tokens shards fmstore's writer
produces.  Sample ``i`` of a file is ``tokens[i * seq_len : i * seq_len + seq_len + extra]``
with ``extra = 1`` when ``targets=True`` (inputs plus the shifted targets), so consecutive
samples share that one token.  A file's last ``< seq_len`` tokens are not read.  Samples
are yielded as ``int64`` arrays by default (``sample_dtype``): a DataLoader would make
``uint16`` ones ``torch.uint16`` tensors, which ``nn.Embedding`` and ``cross_entropy``
refuse.

Large files are cut into virtual shards of about ``shard_bytes`` each (on sequence
boundaries), so the node cache holds pieces, not whole multi-GiB files.
"""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError, CorruptData
from .base import DatasetFormat, ShardReader, ShardSpec

DTYPES = ("uint16", "uint32", "int32", "int64", "uint8")


class TokenShardReader(ShardReader):
    def __init__(
        self, path: str, spec: ShardSpec, dtype: np.dtype, seq_len: int, extra: int, out: np.dtype
    ) -> None:
        super().__init__(path)
        n = len(self.buf) // dtype.itemsize
        if spec.samples and (spec.samples * seq_len + extra) > n:
            self.close()
            raise CorruptData(
                f"token shard holds {n} tokens, fewer than its {spec.samples} samples need",
                key=spec.key,
            )
        self.tokens = self.buf[: n * dtype.itemsize].view(dtype)
        self.seq_len = seq_len
        self.width = seq_len + extra
        self.n = spec.samples
        self.out = out

    def __len__(self) -> int:
        return self.n

    def get(self, index: int) -> np.ndarray:
        lo = index * self.seq_len
        return self.tokens[lo : lo + self.width].astype(self.out)  # a copy, in any case


class TokenFormat(DatasetFormat):
    name = "tokens"

    def __init__(
        self,
        shards: list[ShardSpec],
        dtype: str,
        seq_len: int,
        targets: bool,
        sample_dtype: str | None = "int64",
    ) -> None:
        super().__init__(shards)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        #: What samples are yielded as (native byte order).
        self.out = np.dtype(sample_dtype or dtype)
        self.seq_len = seq_len
        self.extra = 1 if targets else 0

    def open_shard(self, path: str, spec: ShardSpec) -> ShardReader:
        return TokenShardReader(path, spec, self.dtype, self.seq_len, self.extra, self.out)

    def header_size(self, spec: ShardSpec) -> int | None:
        return None if spec.compression else 0

    def sample_range(self, spec: ShardSpec, header: bytes, index: int) -> tuple[int, int]:
        lo = index * self.seq_len * self.dtype.itemsize
        return lo, lo + (self.seq_len + self.extra) * self.dtype.itemsize

    def decode(self, spec: ShardSpec, data: bytes) -> np.ndarray:
        return np.frombuffer(data, self.dtype).astype(self.out)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "dtype": self.dtype.name,
            "sample_dtype": self.out.name,
            "seq_len": self.seq_len,
        }


def check_options(dtype: str | None, seq_len: int | None) -> tuple[str, int]:
    if seq_len is None or int(seq_len) < 1:
        raise ConfigError("a token-stream dataset needs seq_len (a positive int)")
    try:
        name = None if dtype is None else np.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in DTYPES:
        raise ConfigError(f"token dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    return str(name), int(seq_len)


def split_file(
    key: str,
    *,
    data_start: int,
    data_bytes: int,
    itemsize: int,
    seq_len: int,
    extra: int,
    shard_bytes: int,
) -> list[ShardSpec]:
    """Virtual shards over one token file, cut on sequence boundaries."""
    tokens = data_bytes // itemsize
    total = max(0, (tokens - extra) // seq_len)
    per = max(1, shard_bytes // (seq_len * itemsize))
    out = []
    for a in range(0, total, per):
        b = min(total, a + per)
        start = data_start + a * seq_len * itemsize
        end = data_start + (b * seq_len + extra) * itemsize
        out.append(
            ShardSpec(
                key=key, samples=b - a, size=end - start, start=start, extra={"virtual": True}
            )
        )
    return out
