"""What the page cache holds of a file: the kernel's ``cachestat`` (Linux 6.5+)."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest


def cachestat(path) -> tuple[int, int]:
    """(pages cached, pages dirty: write-back not started) of the file at ``path`` (or
    open as descriptor ``path``); skips the test on a kernel without the call."""
    libc = ctypes.CDLL(None, use_errno=True)
    rng = (ctypes.c_uint64 * 2)(0, 0)  # offset 0, length 0: the whole file
    stats = (ctypes.c_uint64 * 5)()  # cache, dirty, writeback, evicted, recently evicted
    fd = path if isinstance(path, int) else os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, rng, stats, 0) != 0:
            err = ctypes.get_errno()
            if err == errno.ENOSYS:
                pytest.skip("this kernel has no cachestat (Linux 6.5+)")
            raise OSError(err, os.strerror(err))
    finally:
        if fd is not path:
            os.close(fd)
    return stats[0], stats[1]
