"""The loader's Prometheus counters (per process; DataLoader workers count their own)."""

from __future__ import annotations

from prometheus_client import Counter

BYTES_DOWNLOADED = Counter(
    "fmstore_loader_bytes_downloaded_total", "Shard bytes downloaded into the node cache"
)
CACHE_HITS = Counter("fmstore_loader_cache_hits_total", "Shards found in the node cache")
CACHE_MISSES = Counter(
    "fmstore_loader_cache_misses_total", "Shards downloaded because the node cache lacked them"
)
WAIT_SECONDS = Counter(
    "fmstore_loader_wait_seconds_total", "Time readers waited for a shard to arrive"
)
EVICTIONS = Counter("fmstore_loader_evictions_total", "Shards evicted from the node cache")
REFETCHES = Counter(
    "fmstore_loader_refetches_total", "Shards downloaded again after a failed checksum"
)
DIRECT_BYTES = Counter(
    "fmstore_loader_direct_read_bytes_total",
    "Sample bytes read by range while their shard was downloading",
)
