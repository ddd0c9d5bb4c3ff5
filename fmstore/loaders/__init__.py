"""Datasets streamed from any tier: shard formats, the node cache, ``StreamingDataset``.

>>> ds = StreamingDataset("s3://bucket/data", batch_size=32, cache_limit=8 << 30)
>>> loader = StreamingDataLoader(ds, batch_size=32, num_workers=2)

Names are imported on first use, so ``fmstore dataset write`` does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "CacheFull": "cache",
    "CacheOptions": "cache",
    "ShardCache": "cache",
    "Stream": "mix",
    "StreamingDataLoader": "dataset",
    "StreamingDataset": "dataset",
    "FormatOptions": "formats",
    "PartitionOptions": "nodes",
    "load_format": "formats",
    "ShuffleOptions": "order",
    "write_dataset": "writer",
    "write_samples": "writer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
