"""Turning loaded storages into the caller's objects: tensors as views of shared storages
(ties survive), ``map_location``, pickled leaves (opt-in), and the lazy mapping."""

from __future__ import annotations

import copy
import fnmatch
import pickle
import threading
from collections import OrderedDict
from collections.abc import ItemsView, Iterator, Mapping, Sequence, ValuesView
from typing import Any

import torch

from .. import runtime
from ..errors import CorruptData, NotFound
from ..format.dtypes import dtype_from_name
from ..format.manifest import Manifest, TensorEntry
from ..stores.base import Store
from .devring import cpu_routed, tensors_to
from .reader import MapLocation, ReadOptions, StorageReader, device_for, place_storage
from .select import has_pickle, tensor_indices
from .tree import LazyMapping, _hashable, decode_tree


class PickleRefused(CorruptData):
    """The checkpoint holds pickled objects and the caller did not pass weights_only=False."""


class Materializer:
    """Builds tensors of one manifest, caching placed storages so views share them."""

    def __init__(
        self,
        store: Store,
        manifest: Manifest,
        *,
        map_location: MapLocation = None,
        weights_only: bool = True,
        read: ReadOptions = ReadOptions(),
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.map_location = map_location
        self.weights_only = weights_only
        self.reader = StorageReader(store, manifest, read)
        self._placed: dict[int, torch.Tensor] = {}
        self._devices: dict[str, torch.device | None] = {}
        self._lock = threading.Lock()
        #: True when load() opened the store for this lazy mapping (LazyDict.close closes it).
        self.owns_store = False

    async def fetch(self, tensor_ids: list[int]) -> None:
        """Load the storages behind ``tensor_ids`` that are not loaded yet."""
        want = sorted({self.manifest.tensors[i].storage for i in tensor_ids} - set(self._placed))
        if not want:
            return
        # Storages bound for a device are read straight onto it through a ring of bounce
        # buffers; the rest into host memory, then placed as map_location says.
        direct: dict[int, torch.device] = {}
        host: list[int] = []
        for si in want:
            dev = self._device(self.manifest.storages[si].device)
            if dev is not None and (dev.type != "cpu" or cpu_routed()):
                direct[si] = dev
            else:
                host.append(si)
        if direct:
            for si, t in (await self.reader.load_to(direct)).items():
                self._placed.setdefault(si, t)
        if not host:
            return
        loaded = await self.reader.load(host)
        for si, u8 in loaded.items():
            placed = await runtime.to_cpu(
                place_storage, u8, self.manifest.storages[si].device, self.map_location
            )
            self._placed.setdefault(si, placed)

    def _device(self, saved: str) -> torch.device | None:
        if saved not in self._devices:
            self._devices[saved] = device_for(self.map_location, saved)
        return self._devices[saved]

    def tensor(self, i: int) -> Any:
        e = self.manifest.tensors[i]
        return _view(e, self._placed[e.storage])

    def unpickle(self, i: int) -> Any:
        e = self.manifest.tensors[i]
        if self.weights_only:
            raise PickleRefused(
                f"{e.name!r} is a pickled object; load with weights_only=False if you trust this checkpoint",
                tier=self.store.tier,
                key=self.store.url,
            )
        u8 = self._placed[e.storage].cpu()
        return pickle.loads(bytes(u8.numpy()))

    def check_pickles(self, node: Any) -> None:
        if self.weights_only and self.manifest.pickled and has_pickle(node):
            raise PickleRefused(
                f"checkpoint {self.store.url} holds pickled objects (saved with pickle=True); "
                "load with weights_only=False if you trust it",
                tier=self.store.tier,
            )

    async def build(self, node: Any) -> Any:
        """Load everything under the encoded ``node`` and decode it."""
        self.check_pickles(node)
        await self.fetch(tensor_indices(node))
        return decode_tree(node, self.tensor, self.unpickle)

    def fetch_sync(self, node: Any) -> None:
        """Fetch every tensor under the encoded ``node`` in one batch of reads."""
        self.check_pickles(node)
        with self._lock:
            runtime.run(self.fetch(tensor_indices(node)))

    def build_sync(self, node: Any) -> Any:
        with self._lock:
            return runtime.run(self.build(node))


def _view(e: TensorEntry, storage: torch.Tensor) -> Any:
    dt = dtype_from_name(e.dtype)
    size = dt.itemsize
    try:
        if e.offset % size == 0 and storage.storage_offset() == 0:
            t = torch.empty(0, dtype=dt, device=storage.device).set_(
                storage.untyped_storage(), e.offset // size, e.shape, e.stride
            )
        else:  # unaligned view of a storage shared across dtypes: copy this one out
            span = storage[e.offset :].clone()
            t = torch.empty(0, dtype=dt, device=storage.device).set_(
                span.untyped_storage(), 0, e.shape, e.stride
            )
    except RuntimeError as err:
        raise CorruptData(f"tensor {e.name!r} does not fit its storage: {err}") from None
    if e.numpy:
        return t.numpy()
    if e.parameter:
        return torch.nn.Parameter(t, requires_grad=e.requires_grad)
    if e.requires_grad and (dt.is_floating_point or dt.is_complex):
        t.requires_grad_(True)
    return t


class _Unbuilt:
    """A value of a lazy mapping not built yet: its encoded node."""

    __slots__ = ("node",)

    def __init__(self, node: Any) -> None:
        self.node = node

    def __repr__(self) -> str:
        return "<not loaded>"


def _is_mapping(node: Any) -> bool:
    return isinstance(node, dict) and ("dict" in node or "odict" in node)


class LazyDict(LazyMapping):
    """A dict over a dict of the checkpoint whose values are built on first access: tensors
    are fetched then (and kept; tensors sharing storage stay shared), nested dicts are
    LazyDicts too, other values (lists, scalars) are built whole.

    It is a real ``dict`` (``isinstance(x, dict)``), usable wherever a dict from
    ``torch.load`` is: ``copy()`` is a shallow copy that stays lazy; ``copy.deepcopy``,
    ``pickle`` and ``torch.save`` load what they need and give plain dicts (``OrderedDict``
    where one was saved); ``fmstore.save``, ``async_save`` and ``CheckpointManager.save``
    take it as the plain state it stands for, fetching what was not fetched yet in one batch; ``items()``, ``values()``, ``dict(x)`` and ``{**x}`` build every value
    they hand out.  It can be changed like any dict.  ``materialize()`` loads everything at once
    and returns plain dicts."""

    __slots__ = ("_mat", "_node")

    def __init__(self, mat: Materializer, node: dict[str, Any]) -> None:
        super().__init__()
        self._mat = mat
        self._node = node
        tag = "dict" if "dict" in node else "odict"
        for k, v in node[tag]:
            dict.__setitem__(self, _hashable(decode_tree(k, _no_tensor)), _Unbuilt(v))

    def _build(self, key: Any, v: Any) -> Any:
        if not isinstance(v, _Unbuilt):
            return v
        built = LazyDict(self._mat, v.node) if _is_mapping(v.node) else self._mat.build_sync(v.node)
        # Another thread may have built it meanwhile: keep the first, so every caller sees one object.
        if dict.get(self, key, _MISSING) is v:
            dict.__setitem__(self, key, built)
            return built
        return dict.get(self, key, built)

    def _prefetch(self) -> None:
        """Fetch every tensor below this mapping not fetched yet in one batch of reads
        (value by value would read one tensor at a time)."""
        nodes = self._unbuilt_nodes()
        if nodes:
            node = {"list": nodes}
            self._mat.fetch_sync(node)

    def _unbuilt_nodes(self) -> list[Any]:
        out: list[Any] = []
        for v in dict.values(self):
            if isinstance(v, _Unbuilt):
                out.append(v.node)
            elif isinstance(v, LazyDict):
                out.extend(v._unbuilt_nodes())
        return out

    def __getitem__(self, key: Any) -> Any:
        return self._build(key, dict.__getitem__(self, key))

    def get(self, key: Any, default: Any = None) -> Any:
        v = dict.get(self, key, _MISSING)
        return default if v is _MISSING else self._build(key, v)

    def __iter__(self) -> Iterator[Any]:
        # Overridden so that dict(x), {**x} and dict.update(x) take the slow path through
        # keys() and __getitem__ instead of copying the unbuilt placeholders.
        return iter(dict.keys(self))

    def values(self) -> ValuesView[Any]:  # type: ignore[override]
        return ValuesView(self)

    def items(self) -> ItemsView[Any, Any]:  # type: ignore[override]
        return ItemsView(self)

    def pop(self, key: Any, *default: Any) -> Any:
        if key not in self and default:
            return default[0]
        v = self[key]
        dict.__delitem__(self, key)
        return v

    def popitem(self) -> tuple[Any, Any]:
        key = next(reversed(dict.keys(self)))
        return key, self.pop(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key in self:
            return self[key]
        dict.__setitem__(self, key, default)
        return default

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return len(self) == len(other) and dict(self.items()) == dict(other.items())

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # type: ignore[assignment]

    def __or__(self, other: Any) -> Any:
        if not isinstance(other, Mapping):
            return NotImplemented
        out = self.copy()
        out.update(other)
        return out

    def copy(self) -> LazyDict:
        """A shallow copy, still lazy: values built later are built for each copy apart
        (over the same fetched storage)."""
        out = LazyDict.__new__(LazyDict)
        out._mat, out._node = self._mat, self._node
        dict.update(out, dict.items(self))  # the placeholders and built values as they are
        return out

    def __copy__(self) -> LazyDict:
        return self.copy()

    def _plain_type(self) -> type[dict[Any, Any]]:
        return OrderedDict if "odict" in self._node else dict

    @property
    def _metadata(self) -> Any:
        """What ``nn.Module.load_state_dict`` reads of a saved ``OrderedDict`` (versions)."""
        meta = self._node.get("meta")
        return None if meta is None else decode_tree(meta, _no_tensor)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self._prefetch()
        out = self._plain_type()()
        memo[id(self)] = out
        for k in self:
            out[copy.deepcopy(k, memo)] = copy.deepcopy(self[k], memo)
        if self._metadata is not None:
            out._metadata = copy.deepcopy(self._metadata, memo)  # type: ignore[attr-defined]
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled (torch.save) as an OrderedDict: a pickle can build an exact dict only from
        # an exact dict, and OrderedDict is the one other mapping torch.load(weights_only=True)
        # accepts.
        self._prefetch()
        meta = self._metadata
        state = None if meta is None else {"_metadata": meta}
        return (OrderedDict, (), state, None, iter(self.items()))

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)

    def holds_mapping(self, key: Any) -> bool:
        """Whether the value at ``key`` is a dict (a LazyDict on access); nothing is read."""
        v = dict.__getitem__(self, key)
        return isinstance(v, dict) or (isinstance(v, _Unbuilt) and _is_mapping(v.node))

    def __repr__(self) -> str:
        return f"LazyDict({list(self)!r})"

    def materialize(self) -> Any:
        """Load every tensor below this mapping; returns plain dicts (``OrderedDict`` where
        one was saved)."""
        self._prefetch()
        out = self._plain_type()()
        for k in self:
            v = self[k]
            out[k] = v.materialize() if isinstance(v, LazyDict) else v
        if self._metadata is not None:
            out._metadata = self._metadata  # type: ignore[attr-defined]
        return out

    @property
    def manifest(self) -> Manifest:
        return self._mat.manifest

    def close(self) -> None:
        """Release the store connection held for later fetches (when load() opened it);
        tensors already fetched stay valid."""
        if self._mat.owns_store:
            self._mat.owns_store = False
            runtime.run(self._mat.store.close())


_MISSING = object()


async def place_tree(obj: Any, device: torch.device) -> Any:
    """``obj`` (a state tree read on the host) with its tensors moved onto ``device``
    through a ring of bounce buffers (see :mod:`.devring`); ties between tensors survive."""
    found: list[torch.Tensor] = []

    def collect(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                collect(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                collect(v)

    collect(obj)
    if not found or (device.type == "cpu" and not cpu_routed()):
        return obj
    moved = iter(await tensors_to(found, device))

    def rebuild(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return next(moved)
        if isinstance(o, dict):
            items = [(k, rebuild(v)) for k, v in o.items()]
            return dict(items) if type(o) is dict else type(o)(items)
        if isinstance(o, list):
            return [rebuild(v) for v in o]
        if isinstance(o, tuple):
            vals = [rebuild(v) for v in o]
            return type(o)(*vals) if hasattr(o, "_fields") else type(o)(vals)
        return o

    return rebuild(obj)


def _no_tensor(i: int) -> Any:
    raise CorruptData("a dict key refers to a tensor")


def select(obj: Any, patterns: Sequence[str], where: str) -> Any:
    """``obj`` pruned to the entries ``patterns`` name, as ``fmstore.load(keys=...)`` does:
    a pattern selects an entry by its dotted name (``model``, ``model.h.0.attn``), by a
    glob (``model.*.weight``), or, in a flat dict of dotted names, every name under it."""
    matched: set[str] = set()
    drop = object()

    def hit(name: str) -> bool:
        ok = False
        for p in patterns:
            if name == p or fnmatch.fnmatchcase(name, p) or name.startswith(p + "."):
                matched.add(p)
                ok = True
        return ok

    def may_hold(name: str) -> bool:
        return any(p.startswith(name + ".") or any(c in p for c in "*?[") for p in patterns)

    def walk(n: Any, name: str) -> Any:
        if name and hit(name):
            return n.materialize() if isinstance(n, LazyDict) else n
        if isinstance(n, Mapping):
            out = {}
            for k in n:
                child = f"{name}.{k}" if name else str(k)
                # A leaf or a list of a lazy load is read only when it may be selected.
                lazy_leaf = isinstance(n, LazyDict) and not n.holds_mapping(k)
                if lazy_leaf and not (hit(child) or may_hold(child)):
                    continue
                r = walk(n[k], child)
                if r is not drop:
                    out[k] = r
            return out if out else drop
        if isinstance(n, (list, tuple)):
            kept = [walk(v, f"{name}.{i}" if name else str(i)) for i, v in enumerate(n)]
            return n if any(r is not drop for r in kept) else drop
        return drop

    r = walk(obj, "")
    missing = [p for p in patterns if p not in matched]
    if missing:
        raise NotFound(f"nothing in {where} matches {', '.join(map(repr, missing))}")
    return {} if r is drop else r
