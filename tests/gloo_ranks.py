"""Ranks of a gloo job as processes spawned by the test itself (no torchrun): each rank its
own environment (``FMSTORE_NODE_ID``, ``FMSTORE_CONFIG``: one "node" per rank), the process
group initialized through a file in the test's directory.

``run(fn, envs, *args, init=FILE)`` calls ``fn(rank, *args)`` on ``len(envs)`` ranks and
returns each rank's result (picklable); a rank's exception is raised here with its
traceback's text.  ``init=None``: ``fn`` initializes the process group itself (a script run
as torchrun would, from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` in ``envs``).
Ranks that outlive ``timeout`` are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any


def _main(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    init: str | None,
    env: Mapping[str, str],
    args: tuple[Any, ...],
    out: Any,
) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    if init is not None:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
    try:
        out.put((rank, True, fn(rank, *args)))
    except BaseException as e:  # reported to the test, which raises it
        out.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(
    fn: Callable[..., Any],
    envs: Sequence[Mapping[str, str]],
    *args: Any,
    init: str | None,
    timeout: float = 240,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_main, args=(fn, r, len(envs), init, dict(e), args, out))
        for r, e in enumerate(envs)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    try:
        while len(got) < len(procs):
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queue.Empty:
                left = sorted(set(range(len(procs))) - set(got))
                raise AssertionError(f"ranks {left} hung") from None
            got[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    bad = [f"rank {r}: {v}" for r, (ok, v) in sorted(got.items()) if not ok]
    assert not bad, "\n".join(bad)
    return [got[r][1] for r in range(len(procs))]
