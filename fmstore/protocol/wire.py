"""What fmstore's own collectives send between ranks: JSON text and fixed tensors, never
pickles, and every size received bounded before anything is allocated for it.

torch's ``*_object`` collectives pickle what they send and unpickle what they receive, so a
peer could make every rank run code; they also allocate whatever size a peer announces.
Here each message is a length (one fixed int64 tensor per rank, checked against a limit on
every rank, so that all ranks refuse a bad one together and none waits for the others),
then the bytes.  DCP's own planning collectives still unpickle (``docs/security.md``: the
checkpoint group is one trust domain); these are fmstore's.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import CorruptData, FmstoreError
from ..stores.bounded import decode_json

__all__ = ["MAX_MESSAGE", "broadcast_result", "gather_json", "gather_json_to"]

#: Largest JSON message one rank sends in a gather (errors, views, settings).
MAX_MESSAGE = 16 << 20


def _lengths(pg: Any, n: int) -> list[int]:
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(out, torch.tensor([n], dtype=torch.int64), group=pg)
    return [int(t[0]) for t in out]


def _framed(pg: Any, obj: Any, limit: int) -> tuple[Any, list[int]]:
    """``obj`` as JSON in a buffer padded to the longest message of any rank, and every
    rank's length (checked against ``limit`` on every rank alike)."""
    import torch

    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    lens = _lengths(pg, len(data) if len(data) <= limit else -1)
    bad = [r for r, n in enumerate(lens) if not 0 <= n <= limit]
    if bad:
        raise FmstoreError(
            f"rank {bad[0]} sent a message of {lens[bad[0]]} bytes to a gather (the limit is "
            f"{limit}; -1: its own message was over it)"
        )
    buf = torch.zeros(max(lens), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf, lens


def _decoded(outs: list[Any], lens: list[int]) -> list[Any]:
    got = []
    for r, (t, n) in enumerate(zip(outs, lens, strict=True)):
        try:
            got.append(decode_json(t[:n].numpy().tobytes()))
        except ValueError as e:  # decode_json's own: short, never quoting the input
            raise CorruptData(f"rank {r} sent a gather message that is not JSON ({e})") from None
    return got


def gather_json(pg: Any, obj: Any, *, limit: int = MAX_MESSAGE) -> list[Any]:
    """Every rank's ``obj`` (JSON values: what comes back has lists for tuples), in rank
    order.  A message over ``limit`` bytes, or one that is not JSON, raises on every rank."""
    import torch
    import torch.distributed as dist

    buf, lens = _framed(pg, obj, limit)
    top = buf.numel()
    outs = [torch.empty(top, dtype=torch.uint8) for _ in lens]
    dist.all_gather(outs, buf, group=pg)
    return _decoded(outs, lens)


def gather_json_to(pg: Any, dst: int, obj: Any, *, limit: int) -> list[Any] | None:
    """Every rank's ``obj`` on rank ``dst`` only (in rank order; None on the others): what
    rank ``dst`` receives grows with the ranks, what the others receive does not (one
    length per rank).  A message over ``limit`` bytes raises on every rank."""
    import torch
    import torch.distributed as dist

    buf, lens = _framed(pg, obj, limit)
    top = buf.numel()
    mine = dist.get_rank(pg) == dst
    outs = [torch.empty(top, dtype=torch.uint8) for _ in lens] if mine else None
    dist.gather(buf, outs, group=pg, group_dst=dst)
    if outs is None:
        return None
    return _decoded(outs, lens)


def broadcast_result(pg: Any, src: int, value: bytes | str | None, *, limit: int) -> bytes | str:
    """Rank ``src``'s ``value`` on every rank: its bytes (at most ``limit``), or the text of
    the error it met instead (a ``str``, at most 64 KiB).  Other ranks pass None."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank(pg)
    head = torch.zeros(2, dtype=torch.int64)
    if rank == src:
        if isinstance(value, (bytes, bytearray, memoryview)):
            data, ok = bytes(value), 1
            if len(data) > limit:
                data, ok = f"{len(data)} bytes, more than the {limit} allowed".encode(), 0
        else:
            data, ok = str(value)[:4000].encode(), 0
        head[0], head[1] = ok, len(data)
    dist.broadcast(head, group=pg, group_src=src)
    ok, n = int(head[0]), int(head[1])
    if not 0 <= n <= (limit if ok else 64 << 10):
        raise FmstoreError(f"rank {src} announced a broadcast of {n} bytes (the limit is {limit})")
    buf = torch.empty(n, dtype=torch.uint8)
    if rank == src and n:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if n:
        dist.broadcast(buf, group=pg, group_src=src)
    out = buf.numpy().tobytes()
    return out if ok else out.decode("utf-8", "replace")
