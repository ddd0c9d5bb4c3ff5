"""Prometheus metrics, all named ``fmstore_*``; the registry is prometheus_client's default."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LAT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

STORE_OPS = Counter("fmstore_store_operations_total", "Store operations", ["tier", "op", "outcome"])
STORE_BYTES = Counter(
    "fmstore_store_bytes_total", "Bytes moved by store operations", ["tier", "op"]
)
STORE_ERRORS = Counter(
    "fmstore_store_errors_total", "Store operation errors by class", ["tier", "op", "error"]
)
STORE_LATENCY = Histogram(
    "fmstore_store_operation_seconds",
    "Store operation latency",
    ["tier", "op"],
    buckets=_LAT_BUCKETS,
)
STORE_RETRIES = Counter(
    "fmstore_store_retries_total", "Requests retried after a transient error", ["tier", "reason"]
)
STORE_INFLIGHT = Gauge("fmstore_store_inflight", "Store operations in flight", ["tier"])
