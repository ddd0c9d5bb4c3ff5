"""A ring of bounce buffers between host reads and device destinations.

Loading onto a GPU from ordinary (pageable) memory costs a synchronous copy per tensor
that the driver stages through its own small pinned buffer: the reads and the copies take
turns.  A load that targets a device instead allocates its destinations first, and every
read or decoder fills a *slot* of a ring of pinned host buffers (page-locked once per
process and reused); each filled slot is copied to its destination with
``non_blocking=True`` on a side stream, and an event recorded after the copy says when the
slot may be filled again.  The reads keep their concurrency (one slot each), the copies
overlap them, and the load synchronizes once, at the end.

The same ring runs with CPU destinations (plain host slots, the copy a ``memcpy``): that
is how its correctness is tested without a GPU, through :func:`route_cpu`, which makes
loads onto the CPU go through a ring too and records each slot's use.

Call order for one load: :func:`open_ring` per device; :meth:`RingLoad.slot` waits for a
free slot; fill :meth:`RingLoad.view`; :meth:`RingLoad.submit` queues its copy (or
:meth:`RingLoad.give_back` returns it unused); :meth:`RingLoad.finish` once at the end, or
:meth:`RingLoad.abort` after a failure (the ring is then dropped, not reused: a read
still running in a thread may write into a slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import runtime

#: Bytes per slot: a whole chunk of the default chunk size, so a chunk is decoded into one.
SLOT_BYTES = 32 << 20
#: Slots per ring (8 x 32 MiB = 256 MiB of pinned memory per device, once per process).
SLOTS = 8


@dataclass
class CpuRoute:
    """While :func:`route_cpu` is active: the ring's shape for CPU loads, and its record."""

    slots: int
    slot_bytes: int
    #: (slot index, bytes) of every copy out of a slot, in the order they were queued.
    uses: list[tuple[int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_route: CpuRoute | None = None


@contextlib.contextmanager
def route_cpu(slots: int = 2, slot_bytes: int = 1 << 16) -> Iterator[CpuRoute]:
    """Send loads onto the CPU through a ring of ``slots`` plain buffers while active (for
    tests of the device pipeline without a device); yields the record of slot uses."""
    global _route
    prev, _route = _route, CpuRoute(slots, slot_bytes)
    try:
        yield _route
    finally:
        _route = prev


def cpu_routed() -> bool:
    """Whether loads onto the CPU go through a ring now (see :func:`route_cpu`)."""
    return _route is not None


class Ring:
    """Host slots for one device, reused by one load at a time (see :func:`open_ring`)."""

    def __init__(self, device: torch.device, slots: int, slot_bytes: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.slot_bytes = slot_bytes
        self.bufs = [
            torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(slots)
        ]
        self.stream: Any = torch.cuda.Stream(device) if self.cuda else None


_rings: dict[str, list[Ring]] = {}
_rings_lock = threading.Lock()


def open_ring(device: torch.device) -> RingLoad:
    """A ring for one load onto ``device``: a cached one when free, else a new one."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    route = _route if device.type == "cpu" else None
    if route is not None:
        return RingLoad(Ring(device, route.slots, route.slot_bytes), route)
    key = str(device)
    with _rings_lock:
        free = _rings.get(key)
        ring = free.pop() if free else None
    return RingLoad(ring or Ring(device, SLOTS, SLOT_BYTES), None)


def drop_rings() -> None:
    """Free the cached rings (their pinned memory); the next load allocates again."""
    with _rings_lock:
        _rings.clear()


class RingLoad:
    """One load's use of a ring (runs on fmstore's event loop)."""

    def __init__(self, ring: Ring, route: CpuRoute | None) -> None:
        self.ring = ring
        self.route = route
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(ring.bufs)):
            self._free.put_nowait(i)
        self._events: list[Any] = [None] * len(ring.bufs)
        self._started = False
        self._done = False

    @property
    def slot_bytes(self) -> int:
        return self.ring.slot_bytes

    async def slot(self) -> int:
        """A free slot: the oldest returned one, once its last copy has completed."""
        i = await self._free.get()
        ev = self._events[i]
        if ev is not None and not ev.query():
            await runtime.to_io(ev.synchronize)
        self._events[i] = None
        return i

    def view(self, i: int, n: int) -> memoryview:
        """The first ``n`` bytes of slot ``i``, to fill."""
        arr: Any = self.ring.bufs[i][:n].numpy()
        return memoryview(arr).cast("B")

    def give_back(self, i: int) -> None:
        """Return slot ``i`` without a copy (its fill failed)."""
        self._free.put_nowait(i)

    async def submit(self, i: int, n: int, dest: torch.Tensor) -> None:
        """Queue the copy of slot ``i``'s first ``n`` bytes into ``dest`` (a 1-D uint8 tensor
        of ``n`` bytes on the ring's device); the slot is free again once the copy is."""
        src = self.ring.bufs[i][:n]
        if self.route is not None:
            with self.route.lock:
                self.route.uses.append((i, n))
        if self.ring.cuda:
            stream = self.ring.stream
            if not self._started:
                # Destinations may reuse memory the caller's queued kernels still use.
                stream.wait_stream(torch.cuda.current_stream(self.ring.device))
                self._started = True
            with torch.cuda.stream(stream):
                dest.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            self._events[i] = ev
        else:
            await runtime.to_cpu(dest.copy_, src)
        self._free.put_nowait(i)

    async def copy_from(self, data: memoryview, dest: torch.Tensor) -> None:
        """Send host bytes ``data`` to ``dest`` through the slots, a slot's worth at a time
        (chunks larger than a slot, boxes assembled on the host)."""
        if not len(data):
            return
        src = torch.frombuffer(data, dtype=torch.uint8)
        size = self.slot_bytes
        for pos in range(0, len(data), size):
            n = min(size, len(data) - pos)
            i = await self.slot()
            try:  # torch's copy releases the GIL (a memoryview's slice assignment holds it)
                await runtime.to_cpu(self.ring.bufs[i][:n].copy_, src[pos : pos + n])
            except BaseException:
                self.give_back(i)
                raise
            await self.submit(i, n, dest[pos : pos + n])

    async def finish(self) -> None:
        """Wait once for every queued copy; the ring goes back to the cache."""
        if self._done:
            return
        self._done = True
        if self.ring.cuda and self._started:
            ev = torch.cuda.Event()
            ev.record(self.ring.stream)
            await runtime.to_io(ev.synchronize)
        if self.route is None:
            with _rings_lock:
                _rings.setdefault(str(self.ring.device), []).append(self.ring)

    async def abort(self) -> None:
        """After a failure: wait for the copies already queued (so the destinations may be
        freed) and drop the ring."""
        if self._done:
            return
        self._done = True
        if self.ring.cuda and self._started:
            await runtime.to_io(self.ring.stream.synchronize)


async def run_all(coros: list[Any]) -> None:
    """Await every coroutine; on the first failure cancel the rest, wait for them, re-raise."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def tensors_to(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors onto ``device`` through a ring, storage by storage (tensors that share
    a storage share it on the device too); for checkpoints read whole on the host first
    (DCP directories, ``torch.save`` files)."""
    ring = open_ring(device)
    placed: dict[tuple[int, int], torch.Tensor] = {}
    out: list[torch.Tensor] = []
    try:
        for t in tensors:
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            dest = placed.get(key)
            if dest is None:
                dest = torch.empty(st.nbytes(), dtype=torch.uint8, device=device)
                if st.nbytes():
                    src: Any = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
                    await ring.copy_from(memoryview(src.numpy()).cast("B"), dest)
                placed[key] = dest
            moved = torch.empty(0, dtype=t.dtype, device=device).set_(
                dest.untyped_storage(), t.storage_offset(), t.shape, t.stride()
            )
            if isinstance(t, torch.nn.Parameter):
                moved = torch.nn.Parameter(moved, requires_grad=t.requires_grad)
            elif t.requires_grad:
                moved.requires_grad_(True)
            out.append(moved)
    except BaseException:
        await ring.abort()
        raise
    await ring.finish()
    return out
