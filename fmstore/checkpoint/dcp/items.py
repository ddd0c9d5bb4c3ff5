"""What a DCP write item holds, as the Writer plans it: its size, its bytes, its offset, and
how a rank's items spread over its streams (pure functions of the plan and the tensors)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

__all__ = ["item_bytes", "offset_of", "part_bytes", "split", "tensor_bytes"]


def split(items: Sequence[WriteItem], n: int) -> list[list[WriteItem]]:
    """Spread items over ``n`` streams, largest first onto the least-loaded one."""
    buckets: list[list[WriteItem]] = [[] for _ in range(n)]
    loads = [0] * n
    for it in sorted(items, key=item_bytes, reverse=True):
        i = loads.index(min(loads))
        buckets[i].append(it)
        loads[i] += max(item_bytes(it), 1)
    return [b for b in buckets if b]


def part_bytes(items: Sequence[WriteItem]) -> int | None:
    """The most bytes a rank's blobs of ``items`` take (None: some item is not a tensor,
    whose size the plan does not give)."""
    if any(it.type == WriteItemType.BYTE_IO or it.tensor_storage_size() is None for it in items):
        return None
    return sum(item_bytes(it) for it in items)


def item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return item.bytes_io_data.nbytes if item.bytes_io_data is not None else 0
    return item.tensor_storage_size() or 0


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The row-major bytes of ``t`` (copied to CPU / made contiguous only when needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    arr: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr)


def offset_of(wi: WriteItem) -> tuple[int, ...] | None:
    return None if wi.index.offset is None else tuple(int(x) for x in wi.index.offset)
