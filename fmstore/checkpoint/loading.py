"""Turning loaded storages into the caller's objects: tensors as views of shared storages
(ties survive), ``map_location``, pickled leaves (opt-in), and the lazy mapping."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .. import runtime
from ..errors import CorruptData
from ..format.dtypes import dtype_from_name
from ..format.manifest import Manifest, TensorEntry
from ..stores.base import Store
from .reader import MapLocation, ReadOptions, StorageReader, place_storage
from .select import has_pickle, tensor_indices
from .tree import decode_tree


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
        self._lock = threading.Lock()
        #: True when load() opened the store for this lazy mapping (LazyDict.close closes it).
        self.owns_store = False

    async def fetch(self, tensor_ids: list[int]) -> None:
        """Load the storages behind ``tensor_ids`` that are not loaded yet."""
        want = sorted({self.manifest.tensors[i].storage for i in tensor_ids} - set(self._placed))
        if not want:
            return
        loaded = await self.reader.load(want)
        for si, u8 in loaded.items():
            placed = await runtime.to_cpu(
                place_storage, u8, self.manifest.storages[si].device, self.map_location
            )
            self._placed.setdefault(si, placed)

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


class LazyDict(Mapping[Any, Any]):
    """A read-only mapping over a dict of the checkpoint: tensors are fetched on first access
    (and cached; tensors sharing storage stay shared).  Nested dicts are LazyDicts too; other
    values (lists, scalars) are built whole on access.  ``materialize()`` loads everything."""

    def __init__(self, mat: Materializer, node: dict[str, Any]) -> None:
        self._mat = mat
        self._node = node
        tag = "dict" if "dict" in node else "odict"
        self._items: dict[Any, Any] = {}
        for k, v in node[tag]:
            key = decode_tree(k, _no_tensor)
            self._items[key] = v

    def __getitem__(self, key: Any) -> Any:
        v = self._items[key]
        if isinstance(v, dict) and ("dict" in v or "odict" in v):
            return LazyDict(self._mat, v)
        return self._mat.build_sync(v)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def holds_mapping(self, key: Any) -> bool:
        """Whether the value at ``key`` is a dict (a LazyDict on access); nothing is read."""
        v = self._items[key]
        return isinstance(v, dict) and ("dict" in v or "odict" in v)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"LazyDict({list(self._items)!r})"

    def materialize(self) -> Any:
        """Load every tensor below this mapping; returns plain dicts."""
        return self._mat.build_sync(self._node)

    @property
    def manifest(self) -> Manifest:
        return self._mat.manifest

    def close(self) -> None:
        """Release the store connection held for later fetches (when load() opened it);
        tensors already fetched stay valid."""
        if self._mat.owns_store:
            self._mat.owns_store = False
            runtime.run(self._mat.store.close())


def _no_tensor(i: int) -> Any:
    raise CorruptData("a dict key refers to a tensor")
