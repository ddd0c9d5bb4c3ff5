"""One background event loop per process, and the sync facade over it.

Every store method is ``async``; training loops are not.  :func:`run` submits a coroutine
to a single event loop running in a daemon thread and waits for it.  The loop is created
lazily under a lock, recreated after ``fork`` (DataLoader workers), and refuses calls made
from inside itself (that would deadlock).  Blocking file I/O runs in :func:`io_pool`,
CPU-heavy work (compression, checksums, memcpy; they release the GIL) in :func:`cpu_pool`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures as cf
import contextlib
import contextvars
import functools
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_io_pool: cf.ThreadPoolExecutor | None = None
_cpu_pool: cf.ThreadPoolExecutor | None = None

#: Objects with an ``async close()`` to run on the loop before it stops at exit (S3 clients:
#: their connection pools would otherwise be torn down by garbage collection, with warnings).
_closables: weakref.WeakSet[Any] = weakref.WeakSet()

#: Threads for blocking file I/O: enough to keep a parallel file system busy.
IO_THREADS = int(os.environ.get("FMSTORE_IO_THREADS", "32"))
#: Threads for CPU work; these libraries release the GIL, so one per core.
CPU_THREADS = int(os.environ.get("FMSTORE_CPU_THREADS", str(os.cpu_count() or 2)))


def _start() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    with _lock:
        if _loop is not None and _thread is not None and _thread.is_alive():
            return _loop
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        thread = threading.Thread(target=main, name="fmstore-loop", daemon=True)
        thread.start()
        ready.wait()
        _loop, _thread = loop, thread
        return loop


def loop() -> asyncio.AbstractEventLoop:
    """The process's fmstore event loop, started on first use."""
    lp = _loop
    if lp is not None and _thread is not None and _thread.is_alive():
        return lp
    return _start()


def in_loop_thread() -> bool:
    return _thread is not None and threading.current_thread() is _thread


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the fmstore loop and return its result (the sync facade).

    Raises ``RuntimeError`` when called from the loop thread itself, and ``TimeoutError``
    (after cancelling the coroutine) when ``timeout`` seconds pass.
    """
    if in_loop_thread():
        coro.close()
        raise RuntimeError(
            "fmstore.runtime.run() called from the fmstore event loop; await instead"
        )
    fut = asyncio.run_coroutine_threadsafe(coro, loop())
    try:
        return wait(fut, timeout)
    except cf.TimeoutError:
        if fut.done():  # the coroutine's own TimeoutError
            raise
        fut.cancel()
        raise TimeoutError(f"fmstore operation did not finish within {timeout} s") from None
    except KeyboardInterrupt:
        fut.cancel()
        raise


#: How often a main thread waiting on the loop wakes up (see :func:`wait`).
WAKE_S = 0.2


def wait(fut: cf.Future[T], timeout: float | None = None) -> T:
    """``fut.result(timeout)``, and Ctrl-C still interrupts it on the main thread.

    The kernel hands a process's SIGINT to any of its threads that does not block it; when
    that is not the main thread, CPython only notes the signal, and a main thread asleep on
    a lock without a timeout never runs the handler: the process ignores Ctrl-C until the
    wait ends.  Waking every :data:`WAKE_S` seconds lets the handler run and raise
    ``KeyboardInterrupt`` here."""
    if threading.current_thread() is not threading.main_thread():
        return fut.result(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = WAKE_S if deadline is None else min(WAKE_S, deadline - time.monotonic())
        if left <= 0:
            return fut.result(0)  # raises TimeoutError unless it has just finished
        done, _ = cf.wait([fut], timeout=left)
        if done:
            return fut.result()


def submit(coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
    """Schedule ``coro`` on the fmstore loop without waiting; returns a concurrent future."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


def io_pool() -> cf.ThreadPoolExecutor:
    global _io_pool
    if _io_pool is None:
        with _lock:
            if _io_pool is None:
                _io_pool = cf.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="fmstore-io")
    return _io_pool


def cpu_pool() -> cf.ThreadPoolExecutor:
    global _cpu_pool
    if _cpu_pool is None:
        with _lock:
            if _cpu_pool is None:
                _cpu_pool = cf.ThreadPoolExecutor(CPU_THREADS, thread_name_prefix="fmstore-cpu")
    return _cpu_pool


def _in(pool: cf.Executor, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Awaitable[T]:
    ctx = contextvars.copy_context()
    call = functools.partial(ctx.run, fn, *args, **kwargs)
    return asyncio.get_running_loop().run_in_executor(pool, call)


async def to_io(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run blocking I/O ``fn`` in the I/O pool, off the event loop."""
    return await _in(io_pool(), fn, *args, **kwargs)


async def to_cpu(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run CPU-heavy ``fn`` in the CPU pool, off the event loop."""
    return await _in(cpu_pool(), fn, *args, **kwargs)


def close_at_exit(obj: Any) -> None:
    """Have ``await obj.close()`` run on the loop when the process exits (held weakly)."""
    _closables.add(obj)


#: What a forked child inherited from its parent's loop: the loop and the clients on it,
#: kept referenced for the child's lifetime.  Their sockets (and the epoll instance) are
#: shared with the parent: were the child to drop a client it inherited (say, a DataLoader
#: worker discarding its copy of a store), garbage collection would close the connections,
#: which unregisters the parent's sockets from the shared epoll, and the parent's next
#: response on a pooled connection would never arrive.
_inherited: list[Any] = []


def _after_fork_in_child() -> None:
    # The loop thread and pool threads do not survive fork; the lock may be held by a
    # thread that no longer exists.  Start afresh on first use in the child.
    global _lock, _loop, _thread, _io_pool, _cpu_pool, _closables
    _lock = threading.Lock()
    _inherited.extend([_loop, *_closables])
    _closables = weakref.WeakSet()  # the parent's clients share its sockets: never close them here
    _loop = _thread = None
    _io_pool = _cpu_pool = None


def shutdown() -> None:
    """Stop the loop thread and the pools (called at exit; safe to call twice)."""
    global _loop, _thread, _io_pool, _cpu_pool
    with _lock:
        lp, th = _loop, _thread
        _loop = _thread = None
        pools = [p for p in (_io_pool, _cpu_pool) if p is not None]
        _io_pool = _cpu_pool = None
    if lp is not None and th is not None and th.is_alive():
        closables = list(_closables)
        if closables:

            async def close_all() -> None:
                await asyncio.gather(*(o.close() for o in closables), return_exceptions=True)

            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close_all(), lp).result(timeout=5)
        lp.call_soon_threadsafe(lp.stop)
        th.join(timeout=5)
    for p in pools:
        p.shutdown(wait=False, cancel_futures=True)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown)
