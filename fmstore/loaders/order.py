"""The canonical global sample order, and how it is cut across ranks and workers.

1. **One order per (seed, epoch)**, independent of ranks and workers: the shards are
   permuted, then taken in groups of ``window`` shards; the samples of each group are
   permuted together (a bounded shuffle window spanning several shards).  Without shuffling
   the order is the dataset's order.  Sample ids are global: ``shard_start[shard] + index``.
2. **Ranks interleave**: rank ``r`` of ``W`` takes positions ``start + r + W * j``.  All ranks
   therefore walk the same shuffle window at the same time (one window's shards in a node's
   cache serve every rank on it), and a resume position is one number valid for any ``W``.
   Every rank gets ``ceil((L - start) / W)`` samples; the up to ``W - 1`` positions past the
   end wrap to the start of the epoch's order (repeated, never dropped), so no rank runs
   out of batches before another (no DDP hang).
3. **Workers take whole batches**: a rank's j-th sample belongs to batch ``j // B``, and batch
   ``b`` goes to worker ``b % num_workers``.  The DataLoader collects one batch from each
   worker in turn, so what a rank sees is the same for any number of workers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShuffleOptions:
    """The order of an epoch: ``shuffle`` (off: the datasets' own order), the ``seed`` the
    order is derived from (with the epoch), and ``window``: shards whose samples are
    shuffled together (the cache must hold twice as many shards)."""

    shuffle: bool = True
    seed: int = 0
    window: int = 4


def shard_starts(samples_per_shard: np.ndarray) -> np.ndarray:
    starts = np.zeros(len(samples_per_shard) + 1, np.int64)
    np.cumsum(samples_per_shard, out=starts[1:])
    return starts


def stream_order(
    samples_per_shard: np.ndarray, cfg: ShuffleOptions, epoch: int, salt: int = 0
) -> np.ndarray:
    """Ids (0-based within this stream) of one epoch, in canonical order."""
    counts = np.asarray(samples_per_shard, np.int64)
    starts = shard_starts(counts)
    total = int(starts[-1])
    if not cfg.shuffle:
        return np.arange(total, dtype=np.int64)
    rng = np.random.default_rng([cfg.seed, epoch, salt, 0])
    perm = rng.permutation(len(counts))
    out = np.empty(total, np.int64)
    pos = 0
    window = max(1, cfg.window)
    for b in range(0, len(perm), window):
        group = perm[b : b + window]
        ids = np.concatenate([np.arange(starts[s], starts[s + 1], dtype=np.int64) for s in group])
        np.random.default_rng([cfg.seed, epoch, salt, 1 + b // window]).shuffle(ids)
        out[pos : pos + len(ids)] = ids
        pos += len(ids)
    return out


def rank_count(length: int, start: int, world: int) -> int:
    return max(0, -(-(length - start) // world))


def worker_indices(count: int, worker: int, num_workers: int, batch: int) -> np.ndarray:
    """Indices ``j`` (into a rank's sample sequence) that ``worker`` yields, in order."""
    batch = max(1, batch)
    nblocks = -(-count // batch)
    mine = np.arange(worker, nblocks, num_workers, dtype=np.int64)
    if not len(mine):
        return np.zeros(0, np.int64)
    j = (mine[:, None] * batch + np.arange(batch, dtype=np.int64)[None, :]).ravel()
    return j[j < count]


def positions(length: int, start: int, rank: int, world: int, j: np.ndarray) -> np.ndarray:
    """Epoch positions of a rank's samples ``j``; positions past the end wrap (padding)."""
    p = start + rank + world * j
    return np.where(p >= length, (p - length) % length, p)


class Plan:
    """The epoch orders of one or several streams (mixing), cached for the last epochs used.

    ``streams``: samples per shard of each stream.  ``weights`` (mixing): each epoch holds
    ``length`` samples, stream ``i`` contributing ``round(weights[i] / sum * length)``
    (largest remainder) at seeded random places; each stream continues its own sequence of
    epochs across mix epochs, so every sample of a stream is seen before any repeats.
    """

    def __init__(
        self,
        streams: list[np.ndarray],
        cfg: ShuffleOptions,
        weights: list[float] | None = None,
        length: int | None = None,
    ) -> None:
        self.streams = [np.asarray(s, np.int64) for s in streams]
        self.cfg = cfg
        self.sizes = [int(s.sum()) for s in self.streams]
        self.offsets = np.cumsum([0, *self.sizes])
        all_counts = np.concatenate(self.streams) if self.streams else np.zeros(0, np.int64)
        self.shard_start = shard_starts(all_counts)
        self.mixed = weights is not None and len(self.streams) > 1
        self.length = int(length) if length is not None else int(sum(self.sizes))
        self.quota: list[int] = []
        if self.mixed:
            assert weights is not None
            w = np.asarray(weights, np.float64)
            exact = w / w.sum() * self.length
            q = np.floor(exact).astype(np.int64)
            rest = self.length - int(q.sum())
            q[np.argsort(-(exact - q), kind="stable")[:rest]] += 1
            self.quota = [int(x) for x in q]
        self._cache: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def _cached(self, key: tuple, make) -> np.ndarray:  # type: ignore[no-untyped-def]
        got = self._cache.get(key)
        if got is None:
            got = make()
            self._cache[key] = got
            while len(self._cache) > 6:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return got

    def _stream(self, i: int, epoch: int) -> np.ndarray:
        return self._cached(
            ("s", i, epoch), lambda: stream_order(self.streams[i], self.cfg, epoch, salt=i)
        )

    def epoch(self, epoch: int) -> np.ndarray:
        """Global sample ids of ``epoch`` in canonical order (length :attr:`length`)."""
        return self._cached(("e", epoch), lambda: self._make(epoch))

    def _make(self, epoch: int) -> np.ndarray:
        if not self.mixed:
            if self.length == self.sizes[0]:
                return self._stream(0, epoch)
            return self._take(0, epoch * self.length, self.length)
        choice = np.repeat(np.arange(len(self.quota)), self.quota)
        np.random.default_rng([self.cfg.seed, epoch, 7919]).shuffle(choice)
        out = np.empty(self.length, np.int64)
        for i, q in enumerate(self.quota):
            if q:
                out[choice == i] = self._take(i, epoch * q, q)
        return out

    def _take(self, i: int, pos: int, n: int) -> np.ndarray:
        """``n`` global ids of stream ``i`` from its position ``pos`` across its epochs."""
        size = self.sizes[i]
        parts = []
        while n > 0:
            e, off = divmod(pos, size)
            k = min(n, size - off)
            parts.append(self._stream(i, e)[off : off + k])
            pos, n = pos + k, n - k
        return np.concatenate(parts) + int(self.offsets[i])

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.shard_start, ids, side="right") - 1
