"""The canonical global sample order, and how it is cut across nodes, ranks and workers.

1. **One order per (seed, epoch, partitions)**, independent of the job's shape.  The
   shards are permuted and their samples laid end to end; that sequence is cut into
   ``partitions`` (canonical partitions, :func:`cuts`) of equal length (the first
   ``L % partitions`` one sample longer).  Within each partition, ``window`` consecutive
   shards (or shard pieces, where a shard straddles a cut) are taken at a time and their
   samples permuted together (a bounded shuffle window spanning several shards).  The
   epoch's order then takes one sample of each partition in turn (:func:`interleave`):
   position ``p`` belongs to partition ``p % partitions``.  With one partition this is the
   order of a single sequence of windows; without shuffling the dataset's own order (cut
   and interleaved).  Sample ids are global: ``shard_start[shard] + index``.
2. **Ranks take every W-th position**: the rank in *slot* ``v`` of ``W`` takes positions
   ``start + v + W * j``.  With node partitioning the slot of local rank ``l`` on node ``n``
   of ``N`` is ``n + N * l`` (:mod:`.nodes`), so a node's ranks read positions ``= start + n
   (mod N)``: where ``N`` divides ``partitions``, only the partitions ``= start + n (mod
   N)``, whose shards no other node reads (each node downloads about ``1/N`` of the epoch);
   the global order of old keeps ``v = rank`` and one partition.  A node's ranks walk the
   same shuffle windows at the same time (one window's shards in the node's cache serve
   every rank on it), and a resume position is one number valid for any ``W`` and any
   number of nodes.  Every rank gets ``ceil((L - start) / W)`` samples; the up to ``W - 1``
   positions past the end wrap to the start of the epoch's order (repeated, never
   dropped), so no rank runs out of batches before another (no DDP hang).
3. **Workers take whole batches**: a rank's j-th sample belongs to batch ``j // B``, and batch
   ``b`` goes to worker ``b % num_workers``.  The DataLoader collects one batch from each
   worker in turn, so what a rank sees is the same for any number of workers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Ids handled at once where a whole epoch's would take an array of 8 bytes an id.
CHUNK = 1 << 20


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


def id_dtype(n: int) -> type[np.signedinteger]:
    """The smallest signed dtype holding every value below ``n``: ``int32`` up to 2**31
    (4 bytes a sample in every order array), else ``int64``."""
    return np.int32 if n < (1 << 31) else np.int64


def shard_dtype(n: int) -> type[np.unsignedinteger]:
    """The smallest dtype holding ``n`` shard numbers (1 byte a sample below 256 shards)."""
    return np.uint8 if n <= 1 << 8 else np.uint16 if n <= 1 << 16 else np.uint32


def cuts(total: int, parts: int) -> list[int]:
    """Where ``total`` positions are cut into ``parts`` canonical partitions: the first
    ``total % parts`` partitions hold one more than the others (see :func:`interleave`)."""
    m, rem = divmod(total, parts)
    return [c * m + min(c, rem) for c in range(parts + 1)]


def stream_order(
    samples_per_shard: np.ndarray,
    cfg: ShuffleOptions,
    epoch: int,
    salt: int = 0,
    parts: int = 1,
) -> np.ndarray:
    """Ids (0-based within this stream) of one epoch, partition after partition (cut by
    :func:`cuts`), in the compact dtype of :func:`id_dtype`; each window is shuffled in
    place (one array in all) and no window spans two partitions."""
    counts = np.asarray(samples_per_shard, np.int64)
    starts = shard_starts(counts)
    total = int(starts[-1])
    dt = id_dtype(total)
    if not cfg.shuffle:
        return np.arange(total, dtype=dt)
    rng = np.random.default_rng([cfg.seed, epoch, salt, 0])
    perm = rng.permutation(len(counts))
    out = np.empty(total, dt)
    pos = 0
    window = max(1, cfg.window)
    if parts <= 1:
        for b in range(0, len(perm), window):
            lo = pos
            for s in perm[b : b + window]:
                n = int(counts[s])
                out[pos : pos + n] = np.arange(starts[s], starts[s + 1], dtype=dt)
                pos += n
            # The same draws whatever the dtype: the order of every dataset is what it was.
            np.random.default_rng([cfg.seed, epoch, salt, 1 + b // window]).shuffle(out[lo:pos])
        return out
    for s in perm:
        n = int(counts[s])
        out[pos : pos + n] = np.arange(starts[s], starts[s + 1], dtype=dt)
        pos += n
    ends = np.cumsum(counts[perm])
    bounds = cuts(total, parts)
    for c in range(parts):
        lo, hi = bounds[c], bounds[c + 1]
        inner = ends[(ends > lo) & (ends < hi)].tolist()
        edges = [lo, *inner, hi]  # the shard pieces of partition c
        for g, b in enumerate(range(0, len(edges) - 1, window)):
            a, z = edges[b], edges[min(b + window, len(edges) - 1)]
            np.random.default_rng([cfg.seed, epoch, salt, 1 + g, 1 + c, parts]).shuffle(out[a:z])
    return out


def interleave(seq: np.ndarray, parts: int) -> np.ndarray:
    """The epoch order from a sequence cut into ``parts`` partitions by :func:`cuts`: round
    ``t`` takes the ``t``-th sample of each partition in turn, so position ``p`` belongs to
    partition ``p % parts`` (the last, short round only to the longer partitions)."""
    if parts <= 1:
        return seq
    total = len(seq)
    m, rem = divmod(total, parts)
    bounds = cuts(total, parts)
    out = np.empty_like(seq)
    grid = out[: m * parts].reshape(m, parts)
    for c in range(parts):
        block = seq[bounds[c] : bounds[c + 1]]
        grid[:, c] = block[:m]
        if c < rem:
            out[m * parts + c] = block[m]
    return out


def rank_count(length: int, start: int, world: int) -> int:
    return max(0, -(-(length - start) // world))


def worker_indices(count: int, worker: int, num_workers: int, batch: int) -> np.ndarray:
    """Indices ``j`` (into a rank's sample sequence) that ``worker`` yields, in order."""
    batch = max(1, batch)
    dt = id_dtype(count + batch)
    if num_workers <= 1:
        return np.arange(count if worker == 0 else 0, dtype=dt)
    nblocks = -(-count // batch)
    mine = np.arange(worker, nblocks, num_workers, dtype=dt)
    if not len(mine):
        return np.zeros(0, dt)
    j = (mine[:, None] * dt(batch) + np.arange(batch, dtype=dt)[None, :]).ravel()
    return j[: np.searchsorted(j, count)]  # j ascends: the tail past count is cut


def positions(length: int, start: int, rank: int, world: int, j: np.ndarray) -> np.ndarray:
    """Epoch positions of a rank's samples ``j``; positions past the end wrap (padding).
    Computed in place in ``j`` where its dtype holds them."""
    dt = id_dtype(start + rank + world * (int(j[-1]) + 1) if len(j) else 0)
    p = j if j.dtype == dt else j.astype(dt)
    if world != 1:
        p *= world
    if start + rank:
        p += start + rank
    over = p >= length
    if over.any():
        p[over] = (p[over] - length) % length
    return p


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

    def _stream(self, i: int, epoch: int, parts: int) -> np.ndarray:
        return self._cached(
            ("s", i, epoch, parts),
            lambda: stream_order(self.streams[i], self.cfg, epoch, salt=i, parts=parts),
        )

    def epoch(self, epoch: int, parts: int = 1) -> np.ndarray:
        """Global sample ids of ``epoch`` in canonical order (length :attr:`length`) with
        ``parts`` canonical partitions."""
        return self._cached(
            ("e", epoch, parts), lambda: interleave(self._make(epoch, parts), parts)
        )

    def _make(self, epoch: int, parts: int) -> np.ndarray:
        """The epoch's ids partition after partition (before :func:`interleave`): each
        stream's own order is cut the same way, so a partition of one stream read whole
        stays within its shards."""
        if not self.mixed:
            if self.length == self.sizes[0]:
                return self._stream(0, epoch, parts)
            return self._take(0, epoch * self.length, self.length, parts)
        choice = np.repeat(np.arange(len(self.quota)), self.quota)
        np.random.default_rng([self.cfg.seed, epoch, 7919]).shuffle(choice)
        out = np.empty(self.length, id_dtype(int(self.offsets[-1])))
        for i, q in enumerate(self.quota):
            if q:
                out[choice == i] = self._take(i, epoch * q, q, parts)
        return out

    def _take(self, i: int, pos: int, n: int, parts: int) -> np.ndarray:
        """``n`` global ids of stream ``i`` from its position ``pos`` across its epochs."""
        size = self.sizes[i]
        pieces = []
        while n > 0:
            e, off = divmod(pos, size)
            k = min(n, size - off)
            pieces.append(self._stream(i, e, parts)[off : off + k])
            pos, n = pos + k, n - k
        out = np.concatenate(pieces).astype(id_dtype(int(self.offsets[-1])), copy=False)
        if self.offsets[i]:
            out += int(self.offsets[i])
        return out

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        """The shard of each id, in :func:`shard_dtype` (found a slice at a time, so no
        array of 8 bytes an id is made)."""
        nshards = len(self.shard_start) - 1
        out = np.zeros(len(ids), shard_dtype(nshards))
        if nshards > 1:
            for lo in range(0, len(ids), CHUNK):
                found = np.searchsorted(self.shard_start, ids[lo : lo + CHUNK], side="right")
                out[lo : lo + CHUNK] = found - 1
        return out

    def local_of(self, ids: np.ndarray, shard: np.ndarray) -> np.ndarray:
        """Each id's index within its shard (``ids`` itself where there is one shard)."""
        if len(self.shard_start) <= 2:
            return ids
        out = np.empty_like(ids)
        for lo in range(0, len(ids), CHUNK):
            out[lo : lo + CHUNK] = ids[lo : lo + CHUNK] - self.shard_start[shard[lo : lo + CHUNK]]
        return out

    def first_uses(self, epoch: int, parts: int = 1) -> dict[int, int]:
        """shard -> the first position of ``epoch`` that reads it."""
        ids = self.epoch(epoch, parts)
        first: dict[int, int] = {}
        for lo in range(0, len(ids), CHUNK):
            u, fi = np.unique(self.shard_of(ids[lo : lo + CHUNK]), return_index=True)
            for s, f in zip(u.tolist(), fi.tolist(), strict=True):
                first.setdefault(s, lo + f)
        return first


def first_last(shard: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shards of ``shard`` (ascending), and the first and last index reading each,
    found a slice at a time (no sort of the whole sequence)."""
    n = len(shard)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for lo in range(0, n, CHUNK):
        part = shard[lo : lo + CHUNK]
        u, f = np.unique(part, return_index=True)
        _u, r = np.unique(part[::-1], return_index=True)
        for s, a, b in zip(u.tolist(), f.tolist(), r.tolist(), strict=True):
            first.setdefault(s, lo + a)
            last[s] = lo + len(part) - 1 - b
    uniq = np.array(sorted(first), np.int64)
    return (
        uniq,
        np.array([first[s] for s in uniq.tolist()], np.int64),
        np.array([last[s] for s in uniq.tolist()], np.int64),
    )


class Ints(Sequence[int]):
    """A read-only view of a numpy array as Python ints, converted a slice at a time."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self._lo = -1
        self._vals: list[int] = []

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        lo = i - i % 4096
        if lo != self._lo:
            if not 0 <= i < len(self.a):
                raise IndexError(i)
            self._lo, self._vals = lo, self.a[lo : lo + 4096].tolist()
        return self._vals[i - lo]
