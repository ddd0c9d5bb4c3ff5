"""Getting at the bytes of the planned storages: zero-copy views, or a snapshot into
reusable staging buffers (``async_save``, and CUDA tensors in every save).

The staging buffer is one host allocation reused across saves (grown when a bigger state
comes along), so steady-state async checkpointing allocates nothing.  With CUDA tensors it is
pinned and the device-to-host copies run on a side stream that first waits for the caller's
current stream, so they see every kernel queued before the call.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .memory import advise_huge
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
    """A reusable host buffer for snapshots; one per process (see :data:`STAGING`)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self.lock = threading.Lock()

    def get(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < nbytes or (pinned and not self._pinned):
            self._buf = None  # free the old one before allocating the new one
            size = max(nbytes, 1)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            if not pinned:
                advise_huge(buf)
            self._buf, self._pinned = buf, pinned
        return buf[:nbytes]

    def release(self) -> None:
        """Free the buffer (the next snapshot allocates again)."""
        self._buf = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()


STAGING = Staging()


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
    this returns (``async_save``).  The caller must hold ``staging.lock`` until the views
    are no longer used.
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
        buf = staging.get(total, pinned=cuda and torch.cuda.is_available())
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
