"""Weighted mixing of several datasets: :class:`Stream` describes one of them.

Pass ``streams=[Stream(url_a, weight=3), Stream(url_b, weight=1)]`` to
:class:`~fmstore.loaders.StreamingDataset`.  The mix is one canonical order per
``(seed, epoch)`` (built by :class:`~fmstore.loaders.order.Plan`): each epoch holds
``samples_per_epoch`` samples, stream ``i`` contributing exactly
``round(samples_per_epoch * w_i / sum(w))`` at seeded random positions, each stream walking
its own sequence of epochs.  Partitioning, resume and elastic resume therefore work on a mix
exactly as on one dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stream:
    """One dataset in a mix: where it is, its weight, and how to read it."""

    remote: str
    weight: float = 1.0
    format: str | None = None
    seq_len: int | None = None
    dtype: str | None = None
    targets: bool = True
    allow_pickle: bool = False
    #: options for :func:`~fmstore.stores.open_store` (an S3 endpoint, credentials, ...)
    storage_options: dict[str, Any] | None = None
    #: Parquet: the columns to read (None: all)
    columns: Sequence[str] | None = None
