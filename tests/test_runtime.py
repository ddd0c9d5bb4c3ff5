from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading

import pytest

from fmstore import runtime
from fmstore.stores import open_store


async def _add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


def test_run_returns_result_and_raises_errors():
    assert runtime.run(_add(2, 3)) == 5

    async def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        runtime.run(boom())


def test_run_from_many_threads():
    results: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        for _ in range(50):
            v = runtime.run(_add(i, 1))
            with lock:
                results.append(v)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set(results)) == list(range(1, 9)) and len(results) == 400


def test_run_refuses_calls_from_the_loop_thread():
    async def nested() -> None:
        runtime.run(_add(1, 1))

    with pytest.raises(RuntimeError, match="await instead"):
        runtime.run(nested())


def test_run_timeout_cancels():
    cancelled = threading.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        runtime.run(slow(), timeout=0.2)
    assert cancelled.wait(5)


def test_pools_run_off_the_loop():
    async def where() -> tuple[str, str]:
        io = await runtime.to_io(lambda: threading.current_thread().name)
        cpu = await runtime.to_cpu(lambda: threading.current_thread().name)
        return io, cpu

    io, cpu = runtime.run(where())
    assert io.startswith("fmstore-io") and cpu.startswith("fmstore-cpu")


def _child_roundtrip(root: str, q) -> None:  # runs in a forked or spawned child
    store = open_store(root)
    runtime.run(store.put("child", b"from child"))
    q.put(runtime.run(store.get("child")))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_usable_in_child_processes(tmp_path, method):
    # Use the loop in the parent first, so a fork inherits a running loop thread.
    store = open_store(str(tmp_path))
    runtime.run(store.put("parent", b"p"))
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=_child_roundtrip, args=(str(tmp_path), q))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0 and got == b"from child"
    assert runtime.run(store.get("parent")) == b"p"  # the parent's loop still works


CTRL_C_ON_ANOTHER_THREAD = r"""
import asyncio, signal, sys, threading
from fmstore import runtime

# As in a terminal's foreground, even when the test runner was started in the background.
signal.signal(signal.SIGINT, signal.default_int_handler)

async def body():
    await asyncio.sleep(0.5)  # the main thread is asleep in run() by now
    # The kernel may hand a process's SIGINT to any thread: here, the loop thread.
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
    await asyncio.sleep(600)

try:
    runtime.run(body())
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_ctrl_c_delivered_to_another_thread_still_interrupts_run():
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", CTRL_C_ON_ANOTHER_THREAD], capture_output=True, timeout=120
    )
    assert p.returncode == 130, p.stderr.decode()


def test_run_passes_on_the_coroutines_own_timeout_error():
    async def body():
        raise TimeoutError("the server took too long")

    with pytest.raises(TimeoutError, match="the server took too long"):
        runtime.run(body(), timeout=60)
