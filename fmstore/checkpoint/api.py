"""The public checkpoint API: save / load / async_save and their async twins."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures as cf
import contextlib
import os
import pickle as _pickle
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import runtime
from ..errors import ConfigError, CorruptData, FmstoreError, NotFound, NotSupported
from ..format.manifest import MANIFEST_KEY, Manifest
from ..stores import Location, open_store
from ..stores.base import Store
from .commit import read_bounded_manifest, read_manifest
from .devring import cpu_routed
from .loading import LazyDict, Materializer, PickleRefused, place_tree, select
from .planner import DEFAULT_BLOB_SIZE, DEFAULT_CHUNK_SIZE, Planned, plan_save, resolve_auto
from .reader import MapLocation, ReadOptions
from .select import prune
from .snapshot import STAGING, needs_staging, reserve_staging, take_views
from .sources import HF_NAMES, SourceFile, read_source, source_file
from .tree import UnsupportedValue
from .writer import WriteOptions, write_checkpoint

Uri = str | os.PathLike[str] | Store


@dataclass(frozen=True)
class SaveOptions:
    compression: str = "auto"
    overwrite: bool = False
    pickle: bool = False
    chunk_size: int = DEFAULT_CHUNK_SIZE
    blob_size: int = DEFAULT_BLOB_SIZE
    io_concurrency: int = 8
    max_inflight: int = 1 << 30


def open_location(uri: Uri, *, for_read: bool) -> tuple[Store, bool]:
    """The store rooted at the checkpoint prefix; True when we opened it (and close it)."""
    if isinstance(uri, Store):
        return uri, False
    url = os.fspath(uri)
    if not isinstance(url, str) or not url:
        raise ConfigError(f"checkpoint location must be a path or URL, not {uri!r}")
    loc = Location.parse(url)
    local = loc.local_root
    if for_read and local is not None and not os.path.isdir(local):
        # Opening a POSIX store creates its directory; a load must not leave one behind.
        raise NotFound(f"no checkpoint at {loc.described()}: no such directory", key=MANIFEST_KEY)
    return open_store(url), True


def _plan(obj: Any, o: SaveOptions) -> Planned:
    try:
        return plan_save(
            obj,
            compression=o.compression,
            chunk_size=o.chunk_size,
            blob_size=o.blob_size,
            allow_pickle=o.pickle,
        )
    except UnsupportedValue as e:
        raise TypeError(str(e)) from None


def _wopts(o: SaveOptions) -> WriteOptions:
    return WriteOptions(
        overwrite=o.overwrite, io_concurrency=o.io_concurrency, max_inflight=o.max_inflight
    )


async def _in_runtime(coro: Any) -> Any:
    """Run ``coro`` on fmstore's loop (stores are bound to it) and await it from any loop."""
    if runtime.in_loop_thread():
        return await coro
    return await asyncio.wrap_future(runtime.submit(coro))


async def _save_core(obj: Any, uri: Uri, o: SaveOptions) -> Manifest:
    # Planned off the loop: a lazily loaded state (LazyDict) fetches what it has not
    # fetched yet while it is planned, through this loop.
    planned = await asyncio.to_thread(_plan, obj, o)
    store, owned = open_location(uri, for_read=False)
    staged = needs_staging(planned)
    try:
        if staged:  # device tensors go through the shared staging buffer
            await runtime.to_io(STAGING.acquire)
        try:
            views = await runtime.to_cpu(take_views, planned, copy_all=False)
            if o.compression == "auto":
                planned = resolve_auto(planned, store.url)
            return await write_checkpoint(store, planned.plan, views, _wopts(o))
        finally:
            if staged:
                STAGING.lock.release()
    finally:
        if owned:
            await store.close()


#: Names ``torch.save`` files usually have; a checkpoint saved under one is still a directory.
TORCH_SUFFIXES = (".pt", ".pth", ".ckpt")


class TorchSuffixWarning(UserWarning):
    """``fmstore.save`` to a name that looks like a ``torch.save`` file."""


def _warn_torch_suffix(uri: Uri) -> None:
    if isinstance(uri, Store):
        return
    url = os.fspath(uri)
    if isinstance(url, str) and url.rstrip("/").lower().endswith(TORCH_SUFFIXES):
        warnings.warn(
            f"{url} will be an fmstore checkpoint (a directory), which torch.load cannot "
            "open; fmstore.load reads it, and `fmstore ckpt convert SRC DST.pt` writes a "
            "torch.save file from it",
            TorchSuffixWarning,
            stacklevel=3,
        )


def _options(kw: dict[str, Any]) -> SaveOptions:
    try:
        return SaveOptions(**kw)
    except TypeError as e:
        raise TypeError(f"save(): {e}") from None


async def asave(obj: Any, uri: Uri, **options: Any) -> Manifest:
    """Async twin of :func:`save`.  Tensors must not change until it returns."""
    _warn_torch_suffix(uri)
    return await _in_runtime(_save_core(obj, uri, _options(options)))


def save(
    obj: Any,
    uri: Uri,
    *,
    compression: str = "auto",
    overwrite: bool = False,
    pickle: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    blob_size: int = DEFAULT_BLOB_SIZE,
    io_concurrency: int = 8,
    max_inflight: int = 1 << 30,
) -> Manifest:
    """Save ``obj`` (a state tree as given to ``torch.save``) as a checkpoint at ``uri``.

    Returns once the checkpoint is committed (its manifest written; durable on POSIX).
    ``compression``: ``auto`` (raw on local file systems and memory; on object stores
    byte-grouping + zstd for 16- and 64-bit floats, raw for fp32, zstd for the rest; see
    docs/checkpoint.md), ``raw``, ``zstd`` or ``bytegroup+zstd``; a chunk that does not
    shrink is stored raw.  ``overwrite=True``
    replaces an existing checkpoint atomically (readers see the old or the new one); without
    it an existing checkpoint raises AlreadyExists.  ``pickle=True`` stores values the
    format cannot hold natively as pickles (loading them needs ``weights_only=False``);
    without it such a value raises TypeError naming its path.  A failed save leaves nothing
    visible.
    """
    _warn_torch_suffix(uri)
    o = SaveOptions(
        compression, overwrite, pickle, chunk_size, blob_size, io_concurrency, max_inflight
    )
    return runtime.run(_save_core(obj, uri, o))


# ---- load ---------------------------------------------------------------------------------


async def _load_core(
    uri: Uri,
    map_location: MapLocation,
    lazy: bool,
    keys: str | Sequence[str] | None,
    weights_only: bool,
    mmap: bool,
    verify: bool,
) -> Any:
    if not isinstance(uri, Store):
        # A torch.save, safetensors file or Hugging Face directory, local or on any tier.
        src = await asyncio.to_thread(source_file, _location(uri))
        if src is not None:
            with src:
                return await _load_source(src, map_location, keys, weights_only)
    store, owned = open_location(uri, for_read=True)
    keep_open = False
    try:
        for attempt in range(3):
            try:
                manifest = await read_manifest(store)
            except (NotFound, CorruptData) as e:
                if isinstance(e, NotFound) and not attempt:
                    await _refuse_remote_hf(store)
                if attempt or not await _is_dcp(store, e):
                    raise
                # A checkpoint of torch.distributed.checkpoint: written by fmstore's DCP
                # Writer or by torch's FileSystemWriter; its shards assembled whole.
                native = isinstance(e, NotFound)  # torch's layout: no manifest.json
                sd, placed = await asyncio.to_thread(
                    _load_dcp, store, native, map_location, lazy, keys, weights_only, mmap, verify
                )
                return sd if placed else await _to_map_location(sd, map_location)
            tree = manifest.tree
            if keys is not None:
                pats = [keys] if isinstance(keys, str) else list(keys)
                tree, matched = prune(tree, pats)
                missing = [p for p in pats if p not in matched]
                if missing:
                    raise NotFound(
                        f"no entry of checkpoint {store.url} matches {', '.join(map(repr, missing))}",
                        tier=store.tier,
                        key=MANIFEST_KEY,
                    )
            mat = Materializer(
                store,
                manifest,
                map_location=map_location,
                weights_only=weights_only,
                read=ReadOptions(mmap=mmap, verify=verify),
            )
            if lazy and isinstance(tree, dict) and ("dict" in tree or "odict" in tree):
                keep_open = True
                mat.owns_store = owned
                return LazyDict(mat, tree)
            try:
                return await mat.build(tree)
            except NotFound:
                # An overwrite may have switched generations under us: retry on the new one.
                if attempt == 2 or (await read_manifest(store)).generation == manifest.generation:
                    raise
        raise AssertionError("unreachable")
    finally:
        if owned and not keep_open:
            await store.close()


async def _refuse_remote_hf(store: Store) -> None:
    """Say what to do with a Hugging Face directory on a remote tier (read from local
    directories only), rather than that it has no manifest."""
    if store.local_root is None and any([await store.exists(n) for n in HF_NAMES]):
        raise NotSupported(
            f"{store.url} is a Hugging Face directory, which fmstore reads from a local "
            f"directory: copy it first (`fmstore stage {store.url} DIR`), then load DIR",
            tier=store.tier,
        )


async def _is_dcp(store: Store, error: Exception) -> bool:
    """Whether the manifest could not be read because this is a DCP checkpoint."""
    if isinstance(error, NotFound):
        from .dcp.native import has_native_metadata

        return await has_native_metadata(store)
    from .dcp.manifest import DCP_FORMAT_NAME, sniff_format

    try:
        data = await read_bounded_manifest(store)
        return sniff_format(data) == DCP_FORMAT_NAME
    except (FmstoreError, ValueError, RecursionError):  # a hostile manifest stays its error
        return False


async def _to_map_location(sd: Any, map_location: MapLocation) -> Any:
    """A state read whole on the host, onto the device ``map_location`` names."""
    if map_location is None:
        return sd
    return await place_tree(sd, torch.device(map_location))


def _load_dcp(
    store: Store,
    native: bool,
    map_location: MapLocation,
    lazy: bool,
    keys: str | Sequence[str] | None,
    weights_only: bool,
    mmap: bool,
    verify: bool,
) -> tuple[Any, bool]:
    """The whole state dict of a DCP checkpoint (fmstore's ``fmstore-dcp`` manifest, or
    torch's ``.metadata`` + ``.distcp``): every item's shards assembled; with True when it
    is already on ``map_location``'s device, False when it is on the host."""
    from .dcp.api import load_full_state_dict

    if lazy or keys is not None or mmap:
        raise ConfigError(
            f"{store.url} is a torch.distributed.checkpoint directory: lazy, keys and mmap "
            "are not supported for it (convert it with `fmstore ckpt convert` first)"
        )
    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise ConfigError(
            f"{store.url} is a torch.distributed.checkpoint directory: map_location must be "
            "a device for it"
        )
    onto = None if map_location is None else torch.device(map_location)
    if onto is not None and not native and (onto.type != "cpu" or cpu_routed()):
        # fmstore's layout: read onto the device through the Reader's ring, no host copy.
        sd = load_full_state_dict(
            store, allow_pickle=not weights_only, verify=verify, device=map_location
        )
        return sd, True
    return load_full_state_dict(store, allow_pickle=not weights_only, verify=verify), False


def _location(uri: str | os.PathLike[str]) -> str:
    url = os.fspath(uri)
    if not isinstance(url, str) or not url:
        raise ConfigError(f"checkpoint location must be a path or URL, not {uri!r}")
    return url


async def _load_source(
    src: SourceFile,
    map_location: MapLocation,
    keys: str | Sequence[str] | None,
    weights_only: bool,
) -> Any:
    """A ``torch.save`` file (through the zip guard, with ``torch.load(weights_only=…)``),
    a safetensors file or a Hugging Face directory (read on the host).  Onto a device it
    is read on the host and moved through the ring.  ``lazy`` does not apply: the whole
    file is read (a ``torch.save`` file memory-mapped)."""
    device = isinstance(map_location, (str, torch.device))
    if src.kind != "torch":
        if map_location is not None and not device:
            raise ConfigError(f"{src.name} is a {src.kind} file: map_location must be a device")
        obj = await asyncio.to_thread(read_source, src)
    else:
        obj = await _load_torch_file(src.path, src.name, map_location, weights_only)
    if keys is not None:
        obj = select(obj, [keys] if isinstance(keys, str) else list(keys), src.name)
    return await _to_map_location(obj, map_location) if device else obj


async def _load_torch_file(
    path: str, name: str, map_location: MapLocation, weights_only: bool
) -> Any:
    """A ``torch.save`` file, through the zip guard, with ``torch.load(weights_only=…)``.
    Onto a device it is read on the host (memory-mapped: the file itself when only trusted
    uids can write it, else a private copy); the caller moves it."""
    from .zipguard import torch_file

    device = isinstance(map_location, (str, torch.device))
    where = "cpu" if device else map_location

    def read() -> Any:
        # one open (no symbolic link followed), checked and loaded through that descriptor,
        # or through a private copy when someone else could rewrite the file in place
        with torch_file(path, name=name) as checked:
            return torch.load(checked, map_location=where, weights_only=weights_only, mmap=True)

    try:
        return await asyncio.to_thread(read)
    except _pickle.UnpicklingError as e:
        raise PickleRefused(
            f"{name} holds objects torch.load(weights_only=True) refuses; load with "
            f"weights_only=False if you trust it ({str(e).splitlines()[0][:200]})",
            key=name,
        ) from None


async def aload(
    uri: Uri,
    *,
    map_location: MapLocation = None,
    lazy: bool = False,
    keys: str | Sequence[str] | None = None,
    weights_only: bool = True,
    mmap: bool = False,
    verify: bool = True,
) -> Any:
    """Async twin of :func:`load`."""
    return await _in_runtime(_load_core(uri, map_location, lazy, keys, weights_only, mmap, verify))


def load(
    uri: Uri,
    *,
    map_location: MapLocation = None,
    lazy: bool = False,
    keys: str | Sequence[str] | None = None,
    weights_only: bool = True,
    mmap: bool = False,
    verify: bool = True,
) -> Any:
    """Load the checkpoint at ``uri``.

    Reads the manifest, then only the chunks needed, in parallel, checking every chunk's
    CRC32C (``verify=False`` skips that).  ``map_location`` works as in ``torch.load``
    (str, torch.device, dict of location -> location, or callable(storage, location)).
    ``keys``: names or glob patterns of entries to load (``"model.*"``, ``"optim"``): the
    result keeps only those.  ``lazy=True``: a dict (:class:`LazyDict`) whose tensors are
    fetched on first access, usable wherever a dict from ``torch.load`` is.  ``mmap=True``: on POSIX, uncompressed storages are memory-mapped
    (copy-on-write) instead of read.  Pickled values (saved with ``pickle=True``) need
    ``weights_only=False``.  Errors: NotFound (no checkpoint), CorruptData (bad manifest or
    chunk: names the tensor, blob and store), VersionError (written by a newer fmstore).
    """
    return runtime.run(_load_core(uri, map_location, lazy, keys, weights_only, mmap, verify))


def read_manifest_sync(uri: Uri) -> Manifest:
    """The manifest of the checkpoint at ``uri`` (no tensor data is read)."""

    async def go() -> Manifest:
        store, owned = open_location(uri, for_read=True)
        try:
            return await read_manifest(store)
        finally:
            if owned:
                await store.close()

    return runtime.run(go())


# ---- async_save ---------------------------------------------------------------------------


class SaveHandle:
    """A checkpoint being written in the background by :func:`async_save`."""

    def __init__(self, future: cf.Future[Manifest], uri: Uri) -> None:
        self._future = future
        self.uri = uri

    def result(self, timeout: float | None = None) -> Manifest:
        """Wait until the checkpoint is committed; raises the save's error if it failed."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "writing"
        return f"SaveHandle({os.fspath(self.uri) if not isinstance(self.uri, Store) else self.uri.url!r}, {state})"


_inflight_lock = threading.Lock()
_inflight: SaveHandle | None = None


def _finish_at_exit() -> None:
    """The save still being written when the interpreter exits is committed first: a
    script whose last line is an async save (``trainer.save_checkpoint``) keeps that
    checkpoint.  Its error, if any, stays on its handle.  Registered with threading's exit
    hooks, which run before the thread pools the write uses are shut down (those are
    registered there too, earlier, and the hooks run newest first)."""
    h = _inflight
    if h is not None and not h.done():
        with contextlib.suppress(Exception):
            h.result()


_register_exit = getattr(threading, "_register_atexit", atexit.register)
_register_exit(_finish_at_exit)


def async_save(
    obj: Any,
    uri: Uri,
    *,
    compression: str = "auto",
    overwrite: bool = False,
    pickle: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    blob_size: int = DEFAULT_BLOB_SIZE,
    io_concurrency: int = 8,
    max_inflight: int = 1 << 30,
) -> SaveHandle:
    """Snapshot ``obj`` and write it in the background; returns a :class:`SaveHandle`.

    Returns once every tensor has been copied into a reusable host staging buffer (pinned,
    through a side stream, for CUDA tensors): from then on the caller may change its tensors
    freely, the checkpoint keeps the values of the moment of the call.  The non-tensor parts
    of the tree are captured at call time too.  At most one save is in flight per process:
    a second call first waits for the previous save to finish (its error, if any, stays on
    its own handle), so host memory for staging stays bounded by the largest state saved.
    """
    global _inflight
    _warn_torch_suffix(uri)
    o = SaveOptions(
        compression, overwrite, pickle, chunk_size, blob_size, io_concurrency, max_inflight
    )
    with _inflight_lock:
        prev = _inflight
        if prev is not None:
            cf.wait([prev._future])
        planned = _plan(obj, o)
        STAGING.acquire()
        try:
            views = take_views(planned, copy_all=True)
        except BaseException:
            STAGING.lock.release()
            raise

        async def write() -> Manifest:
            try:
                # Opened here, not in the caller: a POSIX store creates and fsyncs its
                # directories, which must not count towards the caller's stall.
                store, owned = await runtime.to_io(open_location, uri, for_read=False)
                try:
                    plan = planned.plan
                    if o.compression == "auto":
                        plan = resolve_auto(planned, store.url).plan
                    return await write_checkpoint(store, plan, views, _wopts(o))
                finally:
                    if owned:
                        await store.close()
            finally:
                STAGING.lock.release()

        handle = SaveHandle(runtime.submit(write()), uri)
        _inflight = handle
        return handle


def prepare_async_save(obj: Any) -> cf.Future[int]:
    """Get the staging buffer of :func:`async_save` ready for a state like ``obj``.

    Returns at once.  A background thread allocates the buffer (the size a snapshot of
    ``obj`` takes) and faults its pages in, so that the first ``async_save`` stalls the
    caller no longer than the later ones: copying into fresh memory costs a page fault per
    page, several times the copy itself.  Call it once the model and optimizer state exist
    (optimizer moments are created by the first ``step()``).  The future gives the buffer's
    size when it is ready (0 if an ``async_save`` came first and faulted the rest itself).
    Staging stays one buffer, the size of the largest state prepared or saved.
    """
    return reserve_staging(_plan(obj, SaveOptions(pickle=True)))


def wait_for_saves(timeout: float | None = None) -> None:
    """Wait until the in-flight :func:`async_save` (if any) is finished."""
    h = _inflight
    if h is not None:
        cf.wait([h._future], timeout=timeout)
