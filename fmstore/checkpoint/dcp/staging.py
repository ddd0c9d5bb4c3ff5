"""``Stager``: DCP's ``AsyncStager`` with reusable staging buffers.

``dcp.async_save`` first *stages* the state dict (copies it somewhere training will not
touch), then saves the copy in the background.  DCP's default stager allocates a fresh copy
on every save; :class:`Stager` keeps one buffer per tensor and copies into it on every save,
so host memory stays at one state's worth and no allocation (or page-faulting of fresh
memory) is on the training loop's critical path.

* CUDA tensors land in pinned buffers, copied on a side stream (``non_blocking``), and the
  stage waits for that stream before returning: afterwards the caller may change its tensors.
* ``share_memory=True`` puts the buffers in shared memory, so DCP's process-based
  ``async_save`` hands them to its checkpoint process without another copy (torch would copy
  ordinary memory into shared memory on every save).
* Non-tensor leaves are deep-copied (an optimizer's ``param_groups`` can change too).

Reuse is safe only when the previous save no longer reads the buffers.  The stager holds a
*lease* per staged state: :meth:`stage` waits until the previous lease is released.  The
lease is released by fmstore's :class:`~fmstore.checkpoint.dcp.Writer` when its ranks' bytes
are written (thread-based ``async_save``), or by :func:`fmstore.checkpoint.dcp.async_save`
when the save's future completes (both executor types).  With DCP's process-based executor
and a bare ``dcp.async_save`` call neither can see the end of the save: wait for the
previous future before staging again, as DCP asks for its own cached staging.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ..memory import populate

__all__ = ["Stager", "claim_leases", "release_leases"]


class _Lease:
    """Held while a save may still read a staged state."""

    def __init__(self) -> None:
        self.released = threading.Event()
        #: a done-callback will release it (fmstore's async_save)
        self.tracked = False
        #: a Writer in this process is writing from it and will release it when done
        self.seen = False

    def release(self, *_: Any) -> None:
        self.released.set()


# Staged storages (by data pointer) -> the lease covering them, for Writer.write_data.
_leases: dict[int, weakref.ReferenceType[_Lease]] = {}
_leases_lock = threading.Lock()


def _register(ptrs: list[int], lease: _Lease) -> None:
    with _leases_lock:
        ref = weakref.ref(lease)
        for p in [p for p, r in _leases.items() if r() is None]:
            del _leases[p]
        for p in ptrs:
            _leases[p] = ref


def _find_leases(planner: Any) -> list[_Lease]:
    if not _leases:
        return []
    sd = getattr(planner, "state_dict", None)
    if not isinstance(sd, dict):
        return []
    found: dict[int, _Lease] = {}
    for v in _tensors(sd):
        with _leases_lock:
            ref = _leases.get(_ptr(v))
        lease = ref() if ref is not None else None
        if lease is not None:
            found[id(lease)] = lease
    return list(found.values())


def claim_leases(planner: Any) -> list[_Lease]:
    """Mark the leases of staged tensors the save ``planner`` holds as being written from."""
    leases = _find_leases(planner)
    for lease in leases:
        lease.seen = True
    return leases


def release_leases(leases: list[_Lease]) -> None:
    """The save no longer reads these staged states."""
    for lease in leases:
        lease.release()


def _ptr(t: torch.Tensor) -> int:
    local = _local(t)
    try:
        return int(local.untyped_storage().data_ptr())
    except RuntimeError:
        return 0


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return out


class Stager(AsyncStager):
    """Stages state dicts into buffers reused from one save to the next.

    ``pin_memory`` (default: when CUDA is available) pins the buffers of CUDA tensors;
    ``share_memory`` allocates them in shared memory (for the process-based executor);
    ``wait_timeout``: seconds :meth:`stage` waits for the previous save to release the
    buffers before raising ``TimeoutError`` (None: wait as long as it takes).
    """

    # stage() returns only once the copy is complete: nothing to synchronize afterwards.
    _synchronize_after_execute: bool = False

    def __init__(
        self,
        *,
        pin_memory: bool | None = None,
        share_memory: bool = False,
        wait_timeout: float | None = None,
    ) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.share_memory = share_memory
        self.wait_timeout = wait_timeout
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._lease: _Lease | None = None
        self._stream: Any = None
        self._lock = threading.Lock()

    # ---- AsyncStager ------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` in this stager's buffers, complete when it returns."""
        with self._lock:
            self._wait_previous()
            lease = _Lease()
            ptrs: list[int] = []
            cuda_copies = False

            def copy_tensor(path: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
                nonlocal cuda_copies
                src = t.detach()
                buf = self._buffer(path, src)
                if src.device.type == "cuda":
                    cuda_copies = True
                    with torch.cuda.stream(self._side_stream()):
                        buf.copy_(src, non_blocking=True)
                else:
                    buf.copy_(src)
                ptrs.append(int(buf.untyped_storage().data_ptr()))
                return buf

            out = _map(state_dict, (), copy_tensor)
            if cuda_copies:
                self._side_stream().synchronize()
            _register(ptrs, lease)
            self._lease = lease
            return out

    def prepare(self, state_dict: dict[str, Any]) -> Future[int]:
        """Get the buffers of a state like ``state_dict`` ready, off the training loop.

        Returns at once.  A background thread allocates the buffer of every tensor (pinned
        for CUDA tensors: page-locking is the slow part of a first save) and faults its pages
        in, so that the first :meth:`stage` stalls no longer than the later ones.  Call it
        once the model and optimizer state exist (optimizer moments appear at the first
        ``step()``).  The future gives the bytes prepared.  A :meth:`stage` that comes
        meanwhile waits for the buffer being made, then makes the rest itself."""
        todo: list[tuple[tuple[Any, ...], torch.Tensor]] = []

        def note(path: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
            todo.append((path, t.detach()))
            return t

        _map(state_dict, (), note, deep=False)
        fut: Future[int] = Future()

        def run() -> None:
            with contextlib.suppress(OSError, AttributeError):
                # One-time kernel work: let the training threads go first.
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            try:
                done = 0
                for path, src in todo:
                    with self._lock:
                        fresh = (path, src.dtype, tuple(src.shape)) not in self._buffers
                        buf = self._buffer(path, src)
                        if fresh and not buf.is_pinned() and buf.numel():
                            populate(buf.view(-1).view(torch.uint8))
                    done += buf.numel() * buf.element_size()
                fut.set_result(done)
            except BaseException as e:
                fut.set_exception(e)

        threading.Thread(target=run, name="fmstore-stager-prepare", daemon=True).start()
        return fut

    def synchronize_staging(self) -> None:
        """Nothing to do: :meth:`stage` returns a complete copy."""

    def close(self) -> None:
        """Drop the buffers (unpinning them); the stager can still be used afterwards."""
        with self._lock:
            self._buffers.clear()
            self._lease = None

    # ---- lease control ------------------------------------------------------------------

    def track(self, future: Future[Any]) -> None:
        """Release the buffers of the latest :meth:`stage` when ``future`` completes."""
        lease = self._lease
        if lease is not None:
            lease.tracked = True
            future.add_done_callback(lease.release)

    def _wait_previous(self) -> None:
        lease = self._lease
        if lease is None or lease.released.is_set():
            return
        if not (lease.tracked or lease.seen):
            return
        if not lease.released.wait(self.wait_timeout):
            raise TimeoutError(
                f"the previous checkpoint save still uses the staging buffers after "
                f"{self.wait_timeout} s"
            )

    # ---- buffers ------------------------------------------------------------------------

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
        return self._stream

    def _buffer(self, path: tuple[Any, ...], src: torch.Tensor) -> torch.Tensor:
        key = (path, src.dtype, tuple(src.shape))
        buf = self._buffers.get(key)
        if buf is not None:
            return buf
        pin = self.pin_memory and src.device.type == "cuda"
        if self.share_memory:
            buf = torch.empty(src.shape, dtype=src.dtype).share_memory_()
            if pin and buf.numel():
                cudart = torch.cuda.cudart()
                cudart.cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
        else:
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
        # Drop any buffer this path had with another shape or dtype.
        for k in [k for k in self._buffers if k[0] == path]:
            del self._buffers[k]
        self._buffers[key] = buf
        return buf

    @property
    def staged_bytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _map(
    obj: Any,
    path: tuple[Any, ...],
    fn: Callable[[tuple[Any, ...], torch.Tensor], torch.Tensor],
    *,
    deep: bool = True,
) -> Any:
    """Copy a state tree, staging tensors with ``fn`` and deep-copying other leaves
    (``deep=False``: other leaves are kept as they are)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        local = fn(path, obj.to_local())
        return DTensor.from_local(
            local,
            obj.device_mesh,
            obj.placements,
            run_check=False,
            shape=obj.shape,
            stride=obj.stride(),
        )
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if isinstance(obj, dict):
        items = [(k, _map(v, (*path, k), fn, deep=deep)) for k, v in obj.items()]
        return dict(items) if type(obj) is dict else type(obj)(items)
    if isinstance(obj, list):
        return [_map(v, (*path, i), fn, deep=deep) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map(v, (*path, i), fn, deep=deep) for i, v in enumerate(obj))
    return copy.deepcopy(obj) if deep else obj
