"""Prometheus metrics of tiering (the daemon serves them on ``/metrics``), all ``fmstore_*``."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_COPY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

COPY_BYTES = Counter(
    "fmstore_tier_copy_bytes_total",
    "Checkpoint bytes copied between tiers",
    ["src", "dst"],
)
COPIES = Counter(
    "fmstore_tier_copies_total", "Checkpoint copies between tiers", ["src", "dst", "outcome"]
)
COPY_SECONDS = Histogram(
    "fmstore_tier_copy_seconds",
    "Duration of one checkpoint copy between tiers",
    ["src", "dst"],
    buckets=_COPY_BUCKETS,
)
EXPORT_LAG = Gauge(
    "fmstore_tier_export_lag_seconds",
    "Age of the oldest committed checkpoint that still waits for an export",
)
EXPORTS_SUPERSEDED = Counter(
    "fmstore_tier_exports_superseded_total",
    "Pending exports skipped because a newer checkpoint was committed (backlog control)",
    ["src", "dst"],
)
EXPORT_FAILURES = Counter(
    "fmstore_tier_export_failures_total",
    "Failed export attempts, by the class of the error (NotFound, PermissionDenied, "
    "StoreUnavailable, TierFull, ...)",
    ["src", "dst", "reason"],
)
EXPORT_FAILING_SECONDS = Gauge(
    "fmstore_tier_export_failing_seconds",
    "How long the oldest failing export to the tier has been failing (0: none fails)",
    ["dst"],
)
EXPORT_PENDING = Gauge(
    "fmstore_tier_export_pending",
    "Exports still to make (after coalescing) per run root and destination",
    ["root", "dst"],
)
EXPORT_OLDEST_PENDING_STEP = Gauge(
    "fmstore_tier_export_oldest_pending_step",
    "Step of the oldest checkpoint still waiting for its export (-1: none waits)",
    ["root", "dst"],
)
EXPORT_OLDEST_PENDING_SECONDS = Gauge(
    "fmstore_tier_export_oldest_pending_seconds",
    "Age of the oldest checkpoint still waiting for its export (0: none waits)",
    ["root", "dst"],
)
NEWEST_STEP = Gauge(
    "fmstore_tier_newest_step",
    "Newest step with a complete copy on the tier (-1: none)",
    ["root", "tier"],
)
QUEUE_DEPTH = Gauge("fmstore_tier_queue_depth", "Actions planned and not yet done", ["action"])
TIER_BYTES = Gauge("fmstore_tier_bytes", "Checkpoint bytes held per tier (catalog)", ["tier"])
TIER_REPLICA_BYTES = Gauge(
    "fmstore_tier_replica_bytes",
    "Bytes of the replicas of other nodes' parts this node holds on a node-local tier",
    ["tier"],
)
TIER_FS_USED = Gauge(
    "fmstore_tier_filesystem_used_ratio", "Used fraction of a POSIX tier's file system", ["tier"]
)
DELETIONS = Counter("fmstore_tier_deletions_total", "Copies removed by policy", ["tier", "reason"])
ERRORS = Counter("fmstore_tier_errors_total", "Errors of tiering steps", ["action", "error"])
STEPS = Counter("fmstore_daemon_steps_total", "Policy steps run", ["outcome"])
BACKOFF = Gauge("fmstore_daemon_backoff_seconds", "Current back-off after a failing step")
UP = Gauge("fmstore_daemon_up", "1 while the daemon runs")
ORPHANS_REMOVED = Counter(
    "fmstore_orphans_removed",
    "Leftovers of dead writers removed by the orphan sweep (uploads, temp files, "
    "generations, journals)",
    ["tier", "kind"],
)
ORPHAN_BYTES = Counter(
    "fmstore_orphan_bytes_reclaimed", "Bytes the orphan sweep reclaimed", ["tier"]
)
# Checkpoints in node parts (docs/distributed.md), with the node's id as a label so that a
# cluster's scrape of every node's daemon compares the nodes.
PARTS = Gauge(
    "fmstore_parts",
    "Checkpoints in node parts per tier, by state: held (this node's part, node-local "
    "tier), waiting (exported, the commit waits for other nodes' parts), committed (shared tier)",
    ["node", "tier", "state"],
)
NODE_EXPORT_LAG = Gauge(
    "fmstore_node_export_lag_seconds",
    "Age of the oldest checkpoint this node still has to export to the destination (0: none)",
    ["node", "dest"],
)
# Clock skew (:mod:`.skew`): manifests a rescan did not count because they were created
# later than this node's clock allows, and this node's clock against the tiers'.
MANIFESTS_IN_FUTURE = Gauge(
    "fmstore_manifests_in_future",
    "Manifests the last rescan found created later than this node's clock plus the allowed "
    "skew (not counted as committed: a node's clock is off)",
    ["tier"],
)
MANIFEST_FUTURE_SECONDS = Gauge(
    "fmstore_manifest_future_max_seconds",
    "How far ahead of this node's clock the furthest such manifest was created (0: none)",
    ["tier"],
)
TIER_CLOCK_OFFSET = Gauge(
    "fmstore_tier_clock_offset_seconds",
    "The tier's clock minus this node's, from the modification time a probe write got "
    "there (0: within the write's duration)",
    ["tier"],
)
