"""``StreamingDataset``: samples from shards on any tier, through the node-local cache.

Call order: construct in the main process (reads every stream's index, builds the plan,
checks the cache limit); optionally :meth:`~StreamingDataset.load_state_dict` and
:meth:`~StreamingDataset.set_epoch`; iterate (each DataLoader worker iterates its copy and
yields its share, see :mod:`.order`); :meth:`~StreamingDataset.state_dict` with the number
of samples this rank consumed (or use :class:`StreamingDataLoader`, which counts them).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.utils.data as tud

from .. import runtime
from ..config import get_config
from ..errors import ConfigError, CorruptData, FmstoreError, InvalidRange, NotFound
from ..stores import ByteRange, Location, Store, open_store
from ..stores.location import open_existing
from . import metrics
from .cache import CacheOptions, ShardCache
from .formats import DatasetFormat, FormatOptions, ShardReader, ShardSpec, load_format
from .mix import Stream
from .nodes import NodeLayout, PartitionOptions, layout
from .order import (
    Ints,
    Plan,
    ShuffleOptions,
    first_last,
    positions,
    rank_count,
    worker_indices,
)
from .prefetch import Prefetcher
from .state import LoaderState


def cache_dir(local: str | None) -> str:
    """The node cache's directory: ``local``, a path or a local tier's location
    (``nvme:cache``, never a directory of that name), else ``<nvme tier>/dataset-cache``."""
    if local is not None:
        root = Location.parse(os.fspath(local)).local_root
        if root is None:
            raise ConfigError(f"local={local!r} is not a directory: the cache is on this node")
        return root
    root = Location.parse("nvme:").local_root
    if root is None:
        url = get_config().tier("nvme").url
        raise ConfigError(f"the nvme tier ({url}) is not a local directory: pass local= explicitly")
    return os.path.join(root, "dataset-cache")


def dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


#: The flat keywords :class:`StreamingDataset` still takes, and the option each one sets.
_FLAT = {
    "seed": ("shuffle", "seed"),
    "shuffle_window": ("shuffle", "window"),
    "cache_limit": ("cache", "limit"),
    "prefetch": ("cache", "prefetch"),
    "max_concurrency": ("cache", "max_concurrency"),
    "direct_reads": ("cache", "direct_reads"),
    "seq_len": ("format", "seq_len"),
    "dtype": ("format", "dtype"),
    "targets": ("format", "targets"),
    "allow_pickle": ("format", "allow_pickle"),
    "shard_bytes": ("format", "shard_bytes"),
    "columns": ("format", "columns"),
    "sample_dtype": ("format", "sample_dtype"),
}


def _options(
    format: FormatOptions | str | None,
    shuffle: ShuffleOptions | bool,
    cache: CacheOptions | None,
    local: str | None,
    flat: dict[str, Any],
) -> tuple[FormatOptions, ShuffleOptions, CacheOptions]:
    """The three option objects from what the caller gave: objects, the common booleans and
    strings, and flat keywords, which set one field each."""
    groups: dict[str, Any] = {
        "format": format if isinstance(format, FormatOptions) else FormatOptions(format),
        "shuffle": shuffle if isinstance(shuffle, ShuffleOptions) else ShuffleOptions(shuffle),
        "cache": cache or CacheOptions(),
    }
    if local is not None:
        groups["cache"] = dataclasses.replace(groups["cache"], local=local)
    for name, value in flat.items():
        where = _FLAT.get(name)
        if where is None:
            near = difflib.get_close_matches(name, list(_FLAT), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(f"StreamingDataset got an unexpected keyword {name!r}{hint}")
        group, field = where
        groups[group] = dataclasses.replace(groups[group], **{field: value})
    return groups["format"], groups["shuffle"], groups["cache"]


class StreamingDataset(tud.IterableDataset):
    """Stream samples from ``remote`` (any store URL or ``TIER:path``) or several ``streams``.

    How to read, order and cache the data is given by three option objects:

    * ``format``: a :class:`~fmstore.loaders.formats.FormatOptions` or just the format's
      name (None: detect);
    * ``shuffle``: a :class:`~fmstore.loaders.order.ShuffleOptions` or a boolean;
    * ``cache``: a :class:`~fmstore.loaders.cache.CacheOptions` (the node cache: its
      directory, limit, prefetch depth and direct reads); ``local`` sets its directory.

    Each field may also be given as a flat keyword, which sets that field: ``seed``,
    ``shuffle_window``, ``cache_limit``, ``prefetch``, ``max_concurrency``,
    ``direct_reads``, ``seq_len``, ``dtype``, ``targets``, ``allow_pickle``,
    ``shard_bytes``, ``columns``, ``sample_dtype`` (token samples come out as ``int64``
    unless it says otherwise; None keeps the storage dtype).

    ``partition``: how an epoch is shared between nodes, a
    :class:`~fmstore.loaders.nodes.PartitionOptions` or its mode (``"node"``, the default:
    each node downloads only its share; ``"global"``: the order of old, every node reads
    every shard).

    ``batch_size``: the DataLoader's batch size, which makes the order a rank sees the same
    for any number of workers.  ``storage_options`` go to ``open_store``.
    ``streams``/``samples_per_epoch``: weighted mixing (see :class:`~.order.Plan`); each
    :class:`~.mix.Stream` names its own format.  ``rank``/``world_size``: default from
    ``torch.distributed``, else ``RANK``/``WORLD_SIZE``.  ``transform``: applied to each
    sample.
    """

    def __init__(
        self,
        remote: str | None = None,
        local: str | None = None,
        *,
        streams: Sequence[Stream] | None = None,
        batch_size: int | None = None,
        format: FormatOptions | str | None = None,
        shuffle: ShuffleOptions | bool = True,
        cache: CacheOptions | None = None,
        storage_options: dict[str, Any] | None = None,
        samples_per_epoch: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        transform: Callable[[Any], Any] | None = None,
        partition: PartitionOptions | str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        fo, so, co = _options(format, shuffle, cache, local, options)
        if (remote is None) == (streams is None):
            raise ConfigError("pass either remote or streams")
        if streams is None:
            streams = [
                Stream(
                    remote or "",
                    1.0,
                    fo.format,
                    fo.seq_len,
                    fo.dtype,
                    fo.targets,
                    fo.allow_pickle,
                    storage_options,
                    fo.columns,
                )
            ]
        if not streams:
            raise ConfigError("streams is empty")
        if any(s.weight <= 0 for s in streams):
            raise ConfigError("stream weights must be positive")
        self.streams = list(streams)
        self.format_options = fo
        self.cache_options = co
        self.local = cache_dir(co.local)
        self.cache_limit = co.limit
        self.batch_size = batch_size
        self.transform = transform
        self.max_concurrency = max(1, co.max_concurrency)
        self.window = max(1, so.window)
        self.prefetch_depth = self.window if co.prefetch is None else max(0, co.prefetch)
        self.direct_reads = co.direct_reads
        r, w = dist_rank_world()
        self.rank = r if rank is None else rank
        self.world_size = w if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size}")
        po = (
            partition
            if isinstance(partition, PartitionOptions)
            else PartitionOptions(partition or "node")
        )
        self.partition = po
        self._layout: NodeLayout | None = None
        #: canonical partitions of the epochs to come (0: the global order of old)
        self.canonical = 0 if po.mode == "global" else po.canonical or self.node_layout().nodes
        self._own_canonical = self.canonical  # what this configuration's states name
        self.cache = ShardCache(
            self.local, self.cache_limit
        )  # checks that the directory is writable
        self.formats: list[DatasetFormat] = []
        self._stores: dict[int, Store] = {}
        self._pid = os.getpid()
        for i, s in enumerate(self.streams):
            opts = FormatOptions(
                s.format, s.seq_len, s.dtype, s.targets, fo.shard_bytes, s.allow_pickle,
                None if s.columns is None else tuple(s.columns), fo.sample_dtype,
            )  # fmt: skip
            # Reading never creates: a missing local dataset is NotFound, not a new directory.
            store = self._stores[i] = open_existing(
                s.remote, role="dataset", **(s.storage_options or {})
            )
            self.formats.append(load_format(store, opts, index_dir=self.local))
        self.specs: list[tuple[int, ShardSpec]] = [
            (i, sp) for i, f in enumerate(self.formats) for sp in f.shards
        ]
        tags = [hashlib.sha1(s.remote.encode()).hexdigest()[:10] for s in self.streams]
        self.names = [f"{tags[i]}-{sp.cache_name}" for i, sp in self.specs]
        self.name_to_shard = {n: k for k, n in enumerate(self.names)}
        self.seed = so.seed
        self.plan = Plan(
            [np.array([sp.samples for sp in f.shards], np.int64) for f in self.formats],
            dataclasses.replace(so, window=self.window),
            weights=[s.weight for s in self.streams] if len(self.streams) > 1 else None,
            length=samples_per_epoch,
        )
        self.epoch = 0
        self._start = 0
        self._start_epoch = 0
        #: canonical partitions of the resumed epoch (None: no state loaded for it)
        self._start_canonical: int | None = None
        self._check_cache_limit()
        self._yielded = 0
        #: ``(key, {worker: {index: sample}})`` read by :meth:`preload` for workers to come.
        self._preloaded: tuple[tuple[int, ...], dict[int, dict[int, Any]]] | None = None

    # ---- configuration checks -----------------------------------------------------------

    def node_layout(self) -> NodeLayout:
        """This rank's node (found once, in the process that built the dataset)."""
        if self._layout is None:
            self._layout = layout(self.partition, self.rank, self.world_size)
        return self._layout

    def _canonical_of(self, epoch: int) -> int:
        """The canonical partitions of ``epoch``'s order: a resumed epoch keeps its own."""
        if self._start_canonical is not None and epoch == self._start_epoch:
            return self._start_canonical
        return self.canonical

    def _slot(self, canonical: int) -> int:
        return self.rank if canonical == 0 else self.node_layout().slot()

    def required_cache_bytes(self) -> int:
        """What the cache must hold: per stream, twice the window's largest shards, for each
        canonical partition this node reads at once."""
        c = self._canonical_of(self.epoch)
        k = 1 if c == 0 else self.node_layout().partitions_read(c)
        need = 0
        for f in self.formats:
            sizes = sorted((sp.cached_size for sp in f.shards), reverse=True)
            need += sum(sizes[: 2 * k * (self.window if self.plan.cfg.shuffle else 1)])
        return need

    def _check_cache_limit(self) -> None:
        if self.cache_limit is None:
            return
        need = self.required_cache_bytes()
        if self.cache_limit < need:
            raise ConfigError(
                f"cache_limit={self.cache_limit} bytes is below the {need} bytes this configuration "
                f"needs (twice the shuffle window of {self.window} shards of the largest size, for "
                "each canonical partition a node reads at once); raise cache_limit, lower "
                "shuffle_window or run on a number of nodes that divides the canonical partitions"
            )

    # ---- epochs and resume ------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next (a resumed epoch keeps its position)."""
        if epoch != self._start_epoch:
            self._start = 0
            self._start_epoch = epoch
            self._start_canonical = None
        self.epoch = epoch

    def _begin(self) -> int:
        return self._start if self._start_epoch == self.epoch else 0

    def __len__(self) -> int:
        """Samples this rank gets in the current epoch (from the resume position)."""
        return rank_count(self.plan.length, self._begin(), self.world_size)

    def state_dict(self, num_samples: int | None = None) -> dict[str, Any]:
        """Where this job is: ``num_samples`` = samples this rank consumed in the current epoch
        (default: what this process yielded, right for in-process iteration)."""
        n = self._yielded if num_samples is None else num_samples
        pos = min(self.plan.length, self._begin() + n * self.world_size)
        c = self._canonical_of(self.epoch)
        st = LoaderState(self.epoch, pos, self.seed, self.plan.length, self.world_size, canonical=c)
        return st.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` says.  The resumed epoch keeps the order it was started
        in (its canonical partitions; the global order for a state that names none); the
        following epochs keep the state's canonical partitions unless ``partition`` says
        otherwise."""
        st = LoaderState.from_dict(state)
        if st.seed != self.seed or st.length != self.plan.length:
            raise ConfigError(
                f"state is for seed {st.seed} and {st.length} samples per epoch; this dataset has "
                f"seed {self.seed} and {self.plan.length}"
            )
        st.check_canonical(self._own_canonical)
        fixed = self.partition.canonical
        if st.canonical and fixed is not None and fixed != st.canonical:
            raise ConfigError(
                f"state is for an order in {st.canonical} canonical partitions; this dataset was "
                f"given canonical={fixed}: the resumed epoch would not be the same"
            )
        if st.canonical and self.partition.mode == "node":
            self.canonical = st.canonical
        self.epoch = self._start_epoch = st.epoch
        self._start = st.position
        self._start_canonical = st.canonical
        if st.canonical:
            self.node_layout()  # found here, in the process that built the dataset
        self._check_cache_limit()

    def __getstate__(self) -> dict[str, Any]:
        # Store clients belong to the process that opened them (spawned workers open theirs).
        state = self.__dict__.copy()
        state["_stores"] = {}
        return state

    # ---- iteration --------------------------------------------------------------------

    def _store(self, stream: int) -> Store:
        if os.getpid() != self._pid:  # a forked worker opens its own clients on its own loop
            self._stores, self._pid = {}, os.getpid()
        st = self._stores.get(stream)
        if st is None:
            spec = self.streams[stream]
            st = self._stores[stream] = open_store(spec.remote, **(spec.storage_options or {}))
        return st

    def sample_ids(self, worker: int = 0, num_workers: int = 1) -> np.ndarray:
        """Global sample ids one worker of this rank yields this epoch, in order."""
        start = self._begin()
        count = rank_count(self.plan.length, start, self.world_size)
        c = self._canonical_of(self.epoch)
        try:
            order = self.plan.epoch(self.epoch, max(1, c))
            if num_workers <= 1 and self.world_size == 1 and count == len(order) - start:
                return order[start:]  # one reader of the epoch: its order as it is (no copy)
            j = worker_indices(count, worker, num_workers, self.batch_size or 1)
            return order[positions(self.plan.length, start, self._slot(c), self.world_size, j)]
        except MemoryError:  # the order of an epoch is an array of 4 or 8 bytes a sample
            raise FmstoreError(
                f"the sample order of an epoch of {self.plan.length} samples does not fit in "
                "memory (its shards declare that many)"
            ) from None

    def _direct_budget(self) -> int:
        return (self.batch_size or 32) if self.direct_reads is None else self.direct_reads

    def _preload_key(self, num_workers: int) -> tuple[int, ...]:
        c = self._canonical_of(self.epoch)
        return (self.epoch, self._begin(), num_workers, self._slot(c), self.world_size, c)

    def preload(self, num_workers: int) -> None:
        """Read, in this process, the first samples each of ``num_workers`` DataLoader
        workers will yield, by range, where their shards are not cached yet.

        :class:`StreamingDataLoader` calls it just before it starts its workers, which find
        the samples in their copy of the dataset: the first batches then need no store
        client in the workers (each creates its own) and no network round trip, and the
        workers start their shard downloads at once.  Reads up to ``direct_reads`` samples
        per worker (what the workers would otherwise read by range themselves), held in
        memory until :meth:`discard_preload`.  On any error the workers read as usual (and
        report it).
        """
        self._preloaded = None
        budget = self._direct_budget()
        if budget <= 0 or num_workers <= 0:
            return
        idx: list[tuple[int, int]] = []  # (worker, index within the worker's sequence)
        shard_l: list[int] = []
        local_l: list[int] = []
        for w in range(num_workers):
            ids = self.sample_ids(w, num_workers)[:budget]
            shard = self.plan.shard_of(ids)
            idx += [(w, i) for i in range(len(ids))]
            shard_l += shard.tolist()
            local_l += self.plan.local_of(ids, shard).tolist()
        want = self._direct_candidates(range(len(idx)), shard_l)
        if not want:
            return
        t0 = time.perf_counter()
        try:
            got = runtime.run(self._fetch_ranges(want, shard_l, local_l))
        except FmstoreError:
            return
        finally:
            metrics.WAIT_SECONDS.inc(time.perf_counter() - t0)
        out: dict[int, dict[int, Any]] = {}
        for j, sample in got.items():
            w, i = idx[j]
            out.setdefault(w, {})[i] = sample
        self._preloaded = (self._preload_key(num_workers), out)

    def discard_preload(self) -> None:
        """Drop what :meth:`preload` read (the workers have their copies)."""
        self._preloaded = None

    def _take_preload(self, w: int, nw: int) -> dict[int, Any] | None:
        got, self._preloaded = self._preloaded, None
        if got is None or got[0] != self._preload_key(nw):
            return None
        return got[1].get(w, {})

    def __iter__(self) -> Iterator[Any]:
        info = tud.get_worker_info()
        w, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        try:
            ids = self.sample_ids(w, nw)
            shard = self.plan.shard_of(ids)
            local = self.plan.local_of(ids, shard)
        except MemoryError:
            raise FmstoreError(
                f"the sample order of an epoch of {self.plan.length} samples does not fit in "
                "memory (its shards declare that many)"
            ) from None
        return self._samples(shard, local, w, nw)

    def _samples(self, shard: np.ndarray, local: np.ndarray, w: int, nw: int) -> Iterator[Any]:
        self._yielded = 0
        n = len(shard)
        if n == 0:
            return
        uniq, first, last = first_last(shard)
        upcoming = uniq[np.argsort(first, kind="stable")].tolist()
        rank_in_upcoming = {s: k for k, s in enumerate(upcoming)}
        first_use = dict(zip(uniq.tolist(), first.tolist(), strict=True))
        release_at: dict[int, list[int]] = {}
        for s, e in zip(uniq.tolist(), last.tolist(), strict=True):
            release_at.setdefault(e, []).append(s)
        here = [0]
        nxt: dict[int, int] | None = None

        def next_use(name: str) -> float:
            nonlocal nxt
            s = self.name_to_shard.get(name)
            if s is None:
                return float("inf")
            f = first_use.get(s)
            if f is not None and int(last[np.searchsorted(uniq, s)]) >= here[0]:
                return max(0, f - here[0])
            if nxt is None:  # needed again next epoch: after the rest of this one
                nxt = self.plan.first_uses(
                    self.epoch + 1, max(1, self._canonical_of(self.epoch + 1))
                )
            return (n - here[0]) + nxt.get(s, len(self.plan.shard_start)) * 1.0

        def fetch(s: int) -> bool:
            stream, spec = self.specs[s]
            return self.cache.prefetch(self.names[s], self._store(stream), spec, next_use)

        pre = Prefetcher(
            upcoming, fetch, depth=self.prefetch_depth, concurrency=self.max_concurrency
        )
        readers: dict[int, ShardReader] = {}

        def release() -> None:
            # Before waiting on a full cache, let go of every open shard (see ShardCache.get);
            # each one opens again when next needed.
            for d, rd in list(readers.items()):
                del readers[d]
                rd.close()
                self.cache.unpin(self.names[d])

        # Under a cache limit a worker also lets go of its shards at the end of each batch:
        # it may then sit idle for as long as its rank likes (its batches queued, the rank
        # waiting on others), and a download waiting for space must be able to evict what
        # idle workers hold.
        every = (self.batch_size or 1) if self.cache_limit is not None else 0
        # Python ints a slice at a time: a list of a whole epoch's would take ~36 bytes a sample.
        shard_l, local_l = Ints(shard), Ints(local)
        transform = self.transform
        budget = self._direct_budget()
        direct = self._take_preload(w, nw)
        if direct is None:
            direct = {}
        else:
            budget = 0  # the first samples were read before this worker started
        try:
            if budget <= 0:
                pre.advance(-1)
            for i in range(n):
                if i in direct:
                    sample = direct.pop(i)
                else:
                    s = shard_l[i]
                    r = readers.get(s)
                    if r is None and budget > 0:
                        got = self._read_direct(
                            i, min(n, i + budget), shard_l, local_l, readers, pre
                        )
                        budget -= len(got)
                        direct.update(got)
                        pre.advance(-1)
                    if i in direct:
                        sample = direct.pop(i)
                    else:
                        if r is None:
                            here[0] = i
                            pre.advance(rank_in_upcoming[s])
                            r = readers[s] = self._open(s, next_use, release)
                        sample = r.get(local_l[i])
                self._yielded += 1
                if every and (i + 1) % every == 0:
                    release()
                yield sample if transform is None else transform(sample)
                done = release_at.get(i)
                if done:
                    for d in done:
                        rd = readers.pop(d, None)
                        if rd is not None:
                            rd.close()
                            self.cache.unpin(self.names[d])
        finally:
            pre.close()
            for d, r in readers.items():
                r.close()
                self.cache.unpin(self.names[d])

    def _read_direct(
        self,
        lo: int,
        hi: int,
        shard_l: Sequence[int],
        local_l: Sequence[int],
        readers: dict[int, ShardReader],
        pre: Prefetcher,
    ) -> dict[int, Any]:
        """Samples ``lo..hi`` whose shards are neither open nor cached, by ranged reads;
        their shards are queued for download meanwhile."""
        want = self._direct_candidates(
            (j for j in range(lo, hi) if shard_l[j] not in readers), shard_l
        )
        if not want:
            return {}
        t0 = time.perf_counter()
        out = runtime.run(self._fetch_ranges(want, shard_l, local_l))
        metrics.WAIT_SECONDS.inc(time.perf_counter() - t0)
        # Downloads start after the ranged reads so that they do not compete with them.
        pre.ensure(sorted({shard_l[j] for j in want}))
        return out

    def _direct_candidates(self, js: Iterable[int], shard_l: Sequence[int]) -> list[int]:
        """Those of ``js`` whose shard is not cached and whose format reads by range."""
        want: list[int] = []
        ready: dict[int, bool] = {}
        for j in js:
            s = shard_l[j]
            ok = ready.get(s)
            if ok is None:
                stream, spec = self.specs[s]
                ok = ready[s] = self.formats[stream].header_size(
                    spec
                ) is not None and not os.path.exists(self.cache.path(self.names[s]))
            if ok:
                want.append(j)
        return want

    async def _fetch_ranges(
        self, want: list[int], shard_l: Sequence[int], local_l: Sequence[int]
    ) -> dict[int, Any]:
        import asyncio

        shards = sorted({shard_l[j] for j in want})

        async def header(s: int) -> tuple[int, bytes]:
            stream, spec = self.specs[s]
            size = self.formats[stream].header_size(spec) or 0
            data = (
                await self._store(stream).get_range(spec.key, spec.start, spec.start + size)
                if size
                else b""
            )
            return s, data

        async def from_shard(s: int) -> list[tuple[int, Any]]:
            # One shard's samples in one call: neighbours are merged into one request.
            stream, spec = self.specs[s]
            fmt = self.formats[stream]
            js = [j for j in want if shard_l[j] == s]
            ranges = []
            for j in js:
                a, b = fmt.sample_range(spec, heads[s], local_l[j])
                ranges.append(ByteRange(spec.start + a, spec.start + b))
            # Gaps between merged samples are read for nothing (the shard is downloaded too):
            # at most 1/256 of the shard each, so a batch's samples bring little beyond themselves.
            gap = max(4 << 10, min(256 << 10, spec.size // 256))
            datas = await self._store(stream).get_ranges(spec.key, ranges, coalesce=gap)
            metrics.DIRECT_BYTES.inc(sum(len(d) for d in datas))
            return [(j, fmt.decode(spec, d)) for j, d in zip(js, datas, strict=True)]

        try:
            heads = dict(await asyncio.gather(*(header(s) for s in shards)))
            for s, head in heads.items():
                stream, spec = self.specs[s]
                if head:
                    self.formats[stream].check_header(spec, head)
            parts = await asyncio.gather(*(from_shard(s) for s in shards))
            return {j: x for part in parts for j, x in part}
        except NotFound as e:
            raise NotFound(
                "shard listed in the dataset index is missing", tier=e.tier, key=e.key
            ) from None
        except InvalidRange as e:
            raise CorruptData(
                "shard is shorter than the index says", tier=e.tier, key=e.key
            ) from None

    def _open(
        self, s: int, next_use: Callable[[str], float], release: Callable[[], None]
    ) -> ShardReader:
        stream, spec = self.specs[s]
        name = self.names[s]
        path = self.cache.get(name, self._store(stream), spec, next_use, release)
        try:
            return self.formats[stream].open_shard(path, spec)
        except BaseException:
            self.cache.unpin(name)
            raise


class StreamingDataLoader(tud.DataLoader):
    """A DataLoader that counts the batches it hands out, so :meth:`state_dict` is exact."""

    dataset: StreamingDataset

    def __init__(self, dataset: StreamingDataset, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        if self.batch_size is None:
            raise ConfigError("StreamingDataLoader needs a batch_size")
        if dataset.batch_size is None:
            dataset.batch_size = self.batch_size
        elif dataset.batch_size != self.batch_size:
            raise ConfigError(
                f"dataset batch_size {dataset.batch_size} differs from the loader's {self.batch_size}"
            )
        self._batches = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._batches = 0
        ds = self.dataset
        # Workers about to start (not persistent ones already running) get their first
        # samples read here, where the store client is warm (see StreamingDataset.preload).
        if self.num_workers > 0 and (not self.persistent_workers or self._iterator is None):
            ds.preload(self.num_workers)
        try:
            batches = super().__iter__()  # starts the workers, which copy the dataset
        finally:
            ds.discard_preload()
        for batch in batches:
            self._batches += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        ds = self.dataset
        consumed = min(self._batches * int(self.batch_size or 1), len(ds))
        return ds.state_dict(num_samples=consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
