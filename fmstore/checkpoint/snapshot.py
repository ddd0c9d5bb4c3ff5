"""Getting at the bytes of the planned storages: zero-copy views, or a snapshot into
reusable staging buffers (``async_save``, and CUDA tensors in every save).

The staging buffer is one host allocation reused across saves (grown when a bigger state
comes along), so steady-state async checkpointing allocates nothing.  With CUDA tensors it is
pinned and the device-to-host copies run on a side stream that first waits for the caller's
current stream, so they see every kernel queued before the call.

The first snapshot into a fresh buffer pays a page fault per page (see :mod:`.memory`):
nearly all of a first ``async_save``'s stall.  :meth:`Staging.reserve` allocates the buffer
and faults it in a background thread ahead of time; a snapshot that comes while it still runs
stops it and faults the rest itself.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import threading
from typing import Any

import torch

from .memory import advise_huge, huge_pages_pay, populate
from .planner import ALIGN, Planned


def storage_u8(t: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over bytes ``[start, start + nbytes)`` of ``t``'s storage (no copy)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, start, (nbytes,), (1,))


def as_memoryview(u8: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor (no copy)."""
    if u8.numel() == 0:
        return memoryview(bytearray(0))
    arr: Any = u8.detach().numpy()
    return memoryview(arr).cast("B")


class Staging:
    """A reusable host buffer for snapshots; one per process (see :data:`STAGING`).

    Whoever reads or writes the buffer holds it through :meth:`acquire` / ``lock.release()``
    (a save, from its snapshot until its last write; a background populate)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self.lock = threading.Lock()
        self._stop = threading.Event()

    def acquire(self) -> None:
        """Take the buffer for a snapshot: a populate still running stops after its step."""
        self._stop.set()
        self.lock.acquire()

    def get(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        """The first ``nbytes`` of the buffer, grown first if needed (hold the lock)."""
        buf = self._buf
        if buf is None or buf.numel() < nbytes or (pinned and not self._pinned):
            self._buf = None  # free the old one before allocating the new one
            size = max(nbytes, 1)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            if not pinned and huge_pages_pay():
                advise_huge(buf)
            self._buf, self._pinned = buf, pinned
        return buf[:nbytes]

    def reserve(self, nbytes: int, *, pinned: bool = False) -> cf.Future[int]:
        """Grow the buffer to ``nbytes`` and fault its pages in, in a background thread.

        Returns at once; the future gives the buffer's size once it is ready.  Never more
        than one buffer: the thread waits for a save in flight to finish with the old one,
        and the buffer stays the size of the largest state reserved or saved.  A snapshot
        taken meanwhile stops the populate (the future then gives 0).  Pinned buffers are
        resident as soon as they are allocated."""
        fut: cf.Future[int] = cf.Future()
        stop = threading.Event()

        def run() -> None:
            with contextlib.suppress(OSError, AttributeError):
                # One-time kernel work: let the training threads go first.
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            try:
                with self.lock:
                    if stop.is_set():
                        fut.set_result(0)
                        return
                    done = populate(self.get(nbytes, pinned=pinned), stop) or pinned
                    fut.set_result(self.nbytes if done else 0)
            except BaseException as e:
                fut.set_exception(e)

        # The previous reserve's thread gives way to this one (it would fault pages of the
        # buffer this one may replace).
        self._stop.set()
        self._stop = stop
        threading.Thread(target=run, name="fmstore-prefault", daemon=True).start()
        return fut

    def release(self) -> None:
        """Free the buffer (the next snapshot allocates again)."""
        self._buf = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()


STAGING = Staging()


def _pinned(planned: Planned) -> bool:
    cuda = any(sp.device.startswith("cuda") for sp in planned.plan.storages)
    return cuda and torch.cuda.is_available()


def reserve_staging(planned: Planned, staging: Staging = STAGING) -> cf.Future[int]:
    """:meth:`Staging.reserve` the buffer a snapshot of every planned storage takes."""
    return staging.reserve(_layout(planned)[1], pinned=_pinned(planned))


def _layout(planned: Planned) -> tuple[list[int], int]:
    offs, pos = [], 0
    for sp in planned.plan.storages:
        offs.append(pos)
        pos += (sp.nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offs, pos


def needs_staging(planned: Planned) -> bool:
    return any(sp.device != "cpu" for sp in planned.plan.storages)


def take_views(planned: Planned, *, copy_all: bool, staging: Staging = STAGING) -> list[memoryview]:
    """Byte views of every planned storage.

    ``copy_all=False``: CPU storages are viewed in place (the caller must not change them
    until the write finishes: a sync save); device storages are copied to staging.
    ``copy_all=True``: everything is copied, so the caller may change its tensors as soon as
    this returns (``async_save``).  The caller must hold the staging buffer
    (:meth:`Staging.acquire`) until the views are no longer used.
    """
    storages = planned.plan.storages
    cuda = any(sp.device.startswith("cuda") for sp in storages)
    todo = [i for i, sp in enumerate(storages) if copy_all or sp.device != "cpu"]
    views: list[memoryview | None] = [None] * len(storages)
    copied = set(todo)
    for i, sp in enumerate(storages):
        if i not in copied:
            views[i] = as_memoryview(storage_u8(planned.sources[i], sp.start, sp.nbytes))
    if todo:
        offs, total = _layout(planned)
        buf = staging.get(total, pinned=_pinned(planned))
        stream = None
        if cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
        for i in todo:
            sp = storages[i]
            if sp.nbytes == 0:
                views[i] = memoryview(bytearray(0))
                continue
            dst = buf[offs[i] : offs[i] + sp.nbytes]
            src = storage_u8(planned.sources[i], sp.start, sp.nbytes)
            if src.device.type == "cuda" and stream is not None:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
            views[i] = as_memoryview(dst)
        if stream is not None:
            stream.synchronize()
    return [v if v is not None else memoryview(bytearray(0)) for v in views]
