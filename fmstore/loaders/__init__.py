"""Datasets streamed from any tier: shard formats, the node cache, ``StreamingDataset``.

>>> ds = StreamingDataset("s3://bucket/data", batch_size=32, cache_limit=8 << 30)
>>> loader = StreamingDataLoader(ds, batch_size=32, num_workers=2)
"""

from __future__ import annotations

from .cache import CacheFull, ShardCache
from .dataset import Stream, StreamingDataLoader, StreamingDataset
from .formats import FormatOptions, load_format
from .writer import write_dataset

__all__ = [
    "CacheFull",
    "FormatOptions",
    "ShardCache",
    "Stream",
    "StreamingDataLoader",
    "StreamingDataset",
    "load_format",
    "write_dataset",
]
