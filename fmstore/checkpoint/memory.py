"""Host memory for loaded storages and snapshot staging: big buffers in huge pages.

Reading or copying into fresh memory costs a page fault per 4 KiB page on first touch:
measured 0.37 s of CPU per 440 MiB, most of the gap between a cold load and a read into
warm memory, and most of the first ``async_save``'s extra stall.  Advised into transparent
huge pages (Linux, where THP is ``always`` or ``madvise``) the same touch costs 0.16 s.
The tensors stay ordinary torch CPU tensors; the advice is skipped where unsupported.

On a virtual machine whose balloon reports free memory to the host (virtio-balloon free page
reporting) a first touch costs far more: the host faults and zeroes the page again.  The
kernel reports free blocks of ``page_reporting_order`` (2 MiB here) and up, what a huge
page is made of, while 4 KiB faults are served first from smaller free fragments that were
never reported.  Measured on such a machine, first touch of 1 GiB: 0.3-5.9 s (median 3.0)
in huge pages, 0.2-3.4 s (median 0.8) in 4 KiB pages, against 0.08-0.35 s for the copy into
warm memory; :func:`huge_pages_pay` says whether to advise.  :func:`populate` pays the
first-touch cost ahead of time, in a background thread, for ``async_save``'s staging buffer.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from typing import Any

import torch

from ..buffers import HUGE_MIN

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14
#: Pages faulted per step of :func:`populate`: a stop request waits for one step at most.
POPULATE_STEP = 64 << 20
_libc: Any = None


def _madvise() -> Any:
    """libc's madvise through ctypes, which releases the GIL for the call (Python's
    ``mmap.madvise`` holds it: a populate would freeze the training loop's thread)."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = libc
    return _libc.madvise


_huge_pay: bool | None = None


def huge_pages_pay() -> bool:
    """False where free page reporting hands 2 MiB blocks back to the host (see above):
    there a fresh huge page always costs a host fault."""
    global _huge_pay
    if _huge_pay is None:
        try:
            with open("/sys/module/page_reporting/parameters/reported_kib") as f:
                _huge_pay = int(f.read()) == 0  # nothing reported yet: no balloon uses it
        except (OSError, ValueError):
            _huge_pay = True
    return _huge_pay


def advise_huge(t: torch.Tensor) -> None:
    """Advise the pages of CPU tensor ``t`` (not touched yet) into transparent huge pages."""
    nbytes = t.numel() * t.element_size()
    if nbytes < HUGE_MIN or sys.platform != "linux" or t.device.type != "cpu":
        return
    try:
        addr = t.data_ptr()
        lo = (addr + mmap.PAGESIZE - 1) & ~(mmap.PAGESIZE - 1)
        hi = (addr + nbytes) & ~(mmap.PAGESIZE - 1)
        _madvise()(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a failure is harmless
    except (OSError, AttributeError):
        pass


def populate(t: torch.Tensor, stop: threading.Event | None = None) -> bool:
    """Fault in every page of CPU uint8 tensor ``t`` now, so that a later copy into it runs
    at memory speed.  Contents are left as they are where the kernel can populate without
    writing (``MADV_POPULATE_WRITE``); elsewhere the pages are zeroed, so the caller must
    own ``t`` exclusively.  Works in :data:`POPULATE_STEP` steps and returns False as soon
    as ``stop`` is set (the rest faults on first touch as usual), True when done."""
    n = t.numel() * t.element_size()
    page = mmap.PAGESIZE
    kernel = sys.platform == "linux"
    for off in range(0, n, POPULATE_STEP):
        if stop is not None and stop.is_set():
            return False
        size = min(POPULATE_STEP, n - off)
        if kernel:
            # Whole pages around the range: the pages holding t's bytes are mapped, and
            # populating neighbours' bytes in them changes nothing.
            addr = t.data_ptr() + off
            lo, hi = addr & ~(page - 1), (addr + size + page - 1) & ~(page - 1)
            try:
                kernel = _madvise()(lo, hi - lo, _MADV_POPULATE_WRITE) == 0
            except (OSError, AttributeError):
                kernel = False
            if kernel:
                continue
        t.view(torch.uint8).reshape(-1)[off : off + size].zero_()  # releases the GIL too
    return True


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised CPU uint8 tensor of ``nbytes``, in huge pages when big."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    advise_huge(t)
    return t
