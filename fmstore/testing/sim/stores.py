"""The simulation's in-memory stores (every call a scheduling point, with typed transient
faults), the checkpoints its nodes hold, and the copy engine's byte-exact fake."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from ...errors import AlreadyExists, NotFound, StoreUnavailable
from ...format.checksum import crc32c
from ...stores.base import PutOptions, Store
from ...stores.types import ObjectMeta
from .scheduler import Scheduler

__all__ = ["SimStore", "checkpoint", "fake_copy", "fake_verify"]


class SimStore(Store):
    """An in-memory store whose every call is a scheduling point (``sched``); with
    ``flaky`` > 0 a call fails with a typed transient error (:class:`StoreUnavailable`) at
    that rate, a write or delete half the time after it landed (its outcome unknown to the
    caller)."""

    def __init__(
        self, name: str, sched: Scheduler, on_delete: Callable[[str], None], flaky: float = 0.0
    ) -> None:
        self.tier = name
        self.url = f"sim://{name}"
        self.data: dict[str, bytes] = {}
        self.sched = sched
        self.on_delete = on_delete
        self.flaky = flaky

    def _fail(self, key: str) -> bool:
        """Whether this call fails; raises at once when it fails before landing."""
        if not self.flaky or self.sched.rng.random() >= self.flaky:
            return False
        self.sched.trace.append(f"  (transient error on {key})")
        if self.sched.rng.random() < 0.5:
            raise StoreUnavailable("transient error", tier=self.tier, key=key)
        return True

    async def put(self, key: str, data: Any, options: PutOptions = PutOptions()) -> ObjectMeta:
        await self.sched.point(f"put {key}")
        landed_then_fail = self._fail(key)
        if options.mode == "create" and key in self.data:
            self.sched.note("exists")
            raise AlreadyExists(key, tier=self.tier, key=key)
        self.data[key] = bytes(data)
        self.sched.writes += 1
        self.sched.note(f"{len(self.data[key])} bytes, crc32c {crc32c(self.data[key]):08x}")
        if landed_then_fail:
            raise StoreUnavailable("transient error after the write", tier=self.tier, key=key)
        return ObjectMeta(key, len(self.data[key]))

    async def open_writer(self, key: str, options: PutOptions = PutOptions()) -> Any:
        raise NotImplementedError

    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        await self.sched.point(f"get {key}")
        self._read_fault(key)
        if key not in self.data:
            self.sched.note("missing")
            raise NotFound(key, tier=self.tier, key=key)
        self.sched.note(f"crc32c {crc32c(self.data[key]):08x}")
        return self.data[key][start:end]

    async def stat(self, key: str) -> ObjectMeta:
        await self.sched.point(f"stat {key}")
        self._read_fault(key)
        if key not in self.data:
            self.sched.note("missing")
            raise NotFound(key, tier=self.tier, key=key)
        self.sched.note(f"{len(self.data[key])} bytes")
        return ObjectMeta(key, len(self.data[key]), mtime=self.sched.now)

    async def list(  # type: ignore[override]
        self, prefix: str = "", *, recursive: bool = True, **_: Any
    ) -> AsyncIterator[ObjectMeta]:
        await self.sched.point(f"list {prefix}")
        self._read_fault(prefix)
        out: dict[str, ObjectMeta] = {}
        for k in sorted(self.data):
            if not k.startswith(prefix):
                continue
            rest = k[len(prefix) :]
            if not recursive and "/" in rest:
                d = prefix + rest.split("/", 1)[0] + "/"
                out[d] = ObjectMeta(d, 0, is_dir=True)
            else:
                out[k] = ObjectMeta(k, len(self.data[k]), mtime=self.sched.now)
        self.sched.note(" ".join(k[len(prefix) :] for k in out) or "none")
        if not out:
            raise NotFound(prefix, tier=self.tier, key=prefix)
        for m in out.values():
            yield m

    async def delete(self, key: str) -> None:
        await self.sched.point(f"delete {key}")
        landed_then_fail = self._fail(key)
        self.sched.note("deleted" if key in self.data else "absent")
        if key in self.data:
            self.on_delete(key)
            del self.data[key]
            self.sched.writes += 1
        if landed_then_fail:
            raise StoreUnavailable("transient error after the delete", tier=self.tier, key=key)

    def _read_fault(self, key: str) -> None:
        if self._fail(key):
            raise StoreUnavailable("transient error", tier=self.tier, key=key)

    async def copy(self, src: str, dst: str, options: PutOptions = PutOptions()) -> ObjectMeta:
        raise NotImplementedError


@functools.cache
def checkpoint(nodes: tuple[str, ...], step: int) -> tuple[bytes, dict[str, bytes]]:
    """A sharded checkpoint of ``nodes`` x one rank saved at ``step``: its manifest and its
    blobs by name."""
    from dataclasses import replace

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from ...checkpoint.dcp.manifest import DcpBlob, DcpItem, DcpManifest, DcpPart
    from ...format.manifest import ChunkEntry

    blobs, items, payloads = [], [], {}
    for r in range(len(nodes)):
        data = bytes([r + 1, step]) * (50 + r)
        name = f"{r:06d}.bin"
        payloads[name] = data
        blobs.append(DcpBlob(name, len(data), r))
        chunk = ChunkEntry(r, 0, len(data), 0, len(data), "raw", crc32c(data))
        items.append(DcpItem(f"x{r}", None, "bytes", "", (), len(data), (chunk,)))
    md = Metadata(state_dict_metadata={it.fqn: BytesStorageMetadata() for it in items})
    m = DcpManifest.from_metadata(
        md,
        generation=f"g{step:012d}-00000001",
        world_size=len(nodes),
        items=items,
        blobs=blobs,
        allow_pickle=False,
        writer="sim",
        parts=[DcpPart(n, (r,)) for r, n in enumerate(nodes)],
    )
    return replace(m, created=1_000_000.0).dumps(), payloads


class _Check:
    def __init__(self, ok: bool) -> None:
        self.ok = ok


async def fake_verify(store: Store, manifest: Any = None, **_: Any) -> _Check:
    """Byte-exact: every blob of ``manifest`` there with the CRC32C its chunks imply."""
    from ...checkpoint.verify import blob_checksums

    crcs = blob_checksums(manifest)
    for i in range(len(manifest.blobs)):
        try:
            data = await store.get(manifest.blob_key(i))
        except NotFound:
            return _Check(False)
        if len(data) != manifest.blobs[i].size or crc32c(data) != crcs[i]:
            return _Check(False)
    return _Check(True)


async def fake_copy(src: Store, dst: Store, view: Any, *_: Any, **__: Any) -> tuple[Any, int, int]:
    """The copy engine, byte-exact, one put per blob (each a scheduling point)."""
    for i in range(len(view.blobs)):
        await dst.put(view.blob_key(i), await src.get(view.blob_key(i)))
    return await fake_verify(dst, view), view.stored_bytes, 0
