"""Reading a checkpoint: manifest first, then only the chunks needed, in parallel.

On object stores neighbouring chunks of one blob are fetched with one ranged read (fewer
round trips); a lone raw chunk is read straight into the destination tensor's memory
(``Store.get_into``).  On stores with local files every raw chunk is read straight into
its tensor (``preadv``), one open file per chunk.  Every chunk's CRC32C is checked before it is
decoded or used; a mismatch raises :class:`~fmstore.errors.CorruptData` naming the tensor,
the blob and the store.  With ``mmap=True`` on a store with local files (``local_root``: POSIX),
storages held as raw contiguous chunks are memory-mapped copy-on-write instead of read:
zero copies, pages fault in on first touch (checksums, when verified, touch them once).
"""

from __future__ import annotations

import asyncio
import mmap as _mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from .. import runtime
from ..errors import CorruptData, NotFound, StoreUnavailable
from ..format.checksum import crc32c
from ..format.codecs import decode_into
from ..format.manifest import ChunkEntry, Manifest
from ..stores.base import Store
from .devring import RingLoad, open_ring, run_all
from .memory import empty_bytes
from .snapshot import as_memoryview

#: Chunks of one blob closer than this are fetched with one ranged read.
COALESCE_GAP = 1 << 20
#: ... as long as the merged read stays below this.
COALESCE_MAX = 16 << 20
#: Raw chunks are read and checksummed in pieces of this size (cache-sized).
CRC_PIECE = 4 << 20


@dataclass(frozen=True)
class ReadOptions:
    mmap: bool = False
    verify: bool = True
    concurrency: int = 16


class StorageReader:
    """Loads storages of one manifest into CPU uint8 tensors (thread-safe, async)."""

    def __init__(
        self, store: Store, manifest: Manifest, options: ReadOptions = ReadOptions()
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.options = options
        self._names: dict[int, str] = {}
        for t in manifest.tensors:
            self._names.setdefault(t.storage, t.name)
        self._maps: dict[int, _mmap.mmap] = {}
        self._local = store.local_root is not None

    def storage_name(self, si: int) -> str:
        return self._names.get(si, f"<storage {si}>")

    def _corrupt(self, si: int, c: ChunkEntry, why: str) -> CorruptData:
        key = self.manifest.blob_key(c.blob)
        return CorruptData(
            f"corrupt chunk of tensor {self.storage_name(si)!r} (bytes {c.raw_offset}..{c.raw_offset + c.raw}) "
            f"in blob {key!r} of {self.store.url}: {why}",
            tier=self.store.tier,
            key=key,
        )

    async def load(self, indices: list[int]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        work: list[tuple[int, ChunkEntry, memoryview]] = []
        mmap = self.options.mmap and self._local
        for si in indices:
            s = self.manifest.storages[si]
            if mmap and self._mappable(si):
                out[si] = await runtime.to_io(self._map_storage, si)
                continue
            dest = empty_bytes(s.nbytes)
            out[si] = dest
            view = as_memoryview(dest)
            for c in s.chunks:
                work.append((si, c, view[c.raw_offset : c.raw_offset + c.raw]))
        gate = asyncio.Semaphore(max(1, self.options.concurrency))
        if self._local:
            # Local reads cost a syscall, not a round trip: every chunk is read on its own,
            # raw ones straight into their tensor (coalescing would read neighbours into a
            # temporary and copy them out: twice the memory traffic and page faults).
            groups = [[w] for w in sorted(work, key=lambda w: (w[1].blob, w[1].offset))]
        else:
            groups = _coalesce(work)
        await asyncio.gather(*(self._read_group(g, gate) for g in groups))
        return out

    async def load_to(self, targets: dict[int, torch.device]) -> dict[int, torch.Tensor]:
        """Load storages straight onto their devices (``targets``: storage -> device)
        through a ring of bounce buffers per device (see :mod:`.devring`): destinations
        are allocated first, every chunk is read or decoded into a slot and copied from
        there.  On a failure the copies queued are waited for and nothing is returned."""
        out = {si: torch.empty(self.manifest.storages[si].nbytes, dtype=torch.uint8, device=dev)
               for si, dev in targets.items()}  # fmt: skip
        rings: dict[str, RingLoad] = {}
        for dev in targets.values():
            if str(dev) not in rings:
                rings[str(dev)] = open_ring(dev)
        raw: list[tuple[int, ChunkEntry, torch.Tensor, RingLoad]] = []
        packed: list[tuple[int, ChunkEntry, torch.Tensor]] = []
        for si, dev in targets.items():
            dest = out[si]
            for c in self.manifest.storages[si].chunks:
                part = dest[c.raw_offset : c.raw_offset + c.raw]
                if c.codec == "raw":
                    raw.append((si, c, part, rings[str(dev)]))
                else:
                    packed.append((si, c, part))
        gate = asyncio.Semaphore(max(1, self.options.concurrency))
        # (storage, chunk, memoryview) groups for the coalescer: the view is never written.
        none = memoryview(b"")
        groups = (
            [[(si, c, none)] for si, c, _ in packed] if self._local else
            _coalesce([(si, c, none) for si, c, _ in packed])
        )  # fmt: skip
        dest_of = {(si, c.raw_offset): d for si, c, d in packed}

        async def decoded(group: list[tuple[int, ChunkEntry, memoryview]]) -> None:
            async with gate:
                key = self.manifest.blob_key(group[0][1].blob)
                lo = min(c.offset for _, c, _ in group)
                hi = max(c.offset + c.length for _, c, _ in group)
                data = memoryview(await self._get_range(key, lo, hi))
            for si, c, _ in group:
                stored = data[c.offset - lo : c.offset - lo + c.length]
                await self._check(si, c, stored)
                ring = rings[str(targets[si])]
                await self._decode_to(si, c, stored, dest_of[(si, c.raw_offset)], ring)

        try:
            await run_all(
                [self._raw_to(si, c, d, ring, gate) for si, c, d, ring in raw]
                + [decoded(g) for g in groups]
            )
        except BaseException:
            for ring in rings.values():
                await ring.abort()
            raise
        for ring in rings.values():
            await ring.finish()
        return out

    async def _raw_to(
        self, si: int, c: ChunkEntry, dest: torch.Tensor, ring: RingLoad, gate: asyncio.Semaphore
    ) -> None:
        """A raw chunk into ``dest`` through the ring, a slot at a time (in order, so its
        CRC32C is computed as the pieces arrive)."""
        if c.length != c.raw:
            raise self._corrupt(si, c, "raw chunk length does not match its size")
        key = self.manifest.blob_key(c.blob)
        path = self.store.local_path(key)
        crc = 0
        async with gate:
            for pos in range(0, c.raw, ring.slot_bytes):
                n = min(ring.slot_bytes, c.raw - pos)
                i = await ring.slot()
                try:
                    piece = ring.view(i, n)
                    if path is not None:
                        crc = await runtime.to_io(
                            self._read_local, path, key, c.offset + pos, piece, crc
                        )
                    else:
                        await self._get_into(key, c.offset + pos, piece)
                        if self.options.verify:
                            crc = await runtime.to_cpu(crc32c, piece, crc)
                except BaseException:
                    ring.give_back(i)
                    raise
                await ring.submit(i, n, dest[pos : pos + n])
        if self.options.verify and crc != c.crc32c:
            raise self._corrupt(
                si, c, f"checksum mismatch (crc32c {crc:08x}, expected {c.crc32c:08x})"
            )

    async def _decode_to(
        self, si: int, c: ChunkEntry, stored: memoryview, dest: torch.Tensor, ring: RingLoad
    ) -> None:
        """Decode a checked chunk into a slot (a temporary when larger than one) and on."""
        if c.raw > ring.slot_bytes:
            tmp = memoryview(bytearray(c.raw))
            try:
                await runtime.to_cpu(decode_into, c.codec, stored, tmp, c.group)
            except CorruptData as e:
                raise self._corrupt(si, c, e.message) from None
            await ring.copy_from(tmp, dest)
            return
        i = await ring.slot()
        try:
            await runtime.to_cpu(decode_into, c.codec, stored, ring.view(i, c.raw), c.group)
        except BaseException as e:
            ring.give_back(i)
            if isinstance(e, CorruptData):
                raise self._corrupt(si, c, e.message) from None
            raise
        await ring.submit(i, c.raw, dest)

    # ---- ranged reads ----------------------------------------------------------------

    async def _read_group(
        self, group: list[tuple[int, ChunkEntry, memoryview]], gate: asyncio.Semaphore
    ) -> None:
        async with gate:
            key = self.manifest.blob_key(group[0][1].blob)
            if len(group) == 1 and group[0][1].codec == "raw":
                si, c, dest = group[0]
                if c.length != c.raw:
                    raise self._corrupt(si, c, "raw chunk length does not match its size")
                await self._read_raw_checked(si, c, key, dest)
                return
            lo = min(c.offset for _, c, _ in group)
            hi = max(c.offset + c.length for _, c, _ in group)
            data = memoryview(await self._get_range(key, lo, hi))
        for si, c, dest in group:
            stored = data[c.offset - lo : c.offset - lo + c.length]
            await self._check(si, c, stored)
            try:
                await runtime.to_cpu(decode_into, c.codec, stored, dest, c.group)
            except CorruptData as e:
                raise self._corrupt(si, c, e.message) from None

    async def _read_raw_checked(self, si: int, c: ChunkEntry, key: str, dest: memoryview) -> None:
        """Read a raw chunk straight into ``dest``, checksumming it in pieces while each piece
        is still in the CPU cache (one pass over memory instead of two)."""
        path = self.store.local_path(key)
        if path is not None:
            # One blocking call per chunk: one open file (the kernel's readahead follows it
            # through the whole chunk), reads and CRC in the same thread, no hop per piece.
            crc = await runtime.to_io(self._read_local, path, key, c.offset, dest)
        elif not self.options.verify:
            await self._get_into(key, c.offset, dest)
            return
        else:
            # On S3 one ranged GET per chunk (split into parallel part-sized GETs by the
            # store) beats sequential small ones.
            await self._get_into(key, c.offset, dest)
            crc = await runtime.to_cpu(crc32c, dest)
        if self.options.verify and crc != c.crc32c:
            raise self._corrupt(
                si, c, f"checksum mismatch (crc32c {crc:08x}, expected {c.crc32c:08x})"
            )

    def _read_local(self, path: str, key: str, start: int, dest: memoryview, crc: int = 0) -> int:
        """``pread`` ``dest`` from ``path`` at ``start``; the CRC32C of what was read
        (continuing ``crc``)."""
        n = len(dest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise NotFound(
                f"blob missing from checkpoint {self.store.url}", tier=self.store.tier, key=key
            ) from None
        except OSError as e:
            raise StoreUnavailable(f"cannot open blob: {e}", tier=self.store.tier, key=key) from e
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, start, n, os.POSIX_FADV_SEQUENTIAL)
            pos = 0
            while pos < n:
                piece = dest[pos : pos + CRC_PIECE]
                got = os.preadv(fd, [piece], start + pos)
                if got == 0:
                    raise CorruptData(
                        f"blob is truncated (ends before byte {start + n})",
                        tier=self.store.tier,
                        key=key,
                    )
                if self.options.verify:
                    crc = crc32c(piece[:got], crc)
                pos += got
            return crc
        except OSError as e:
            raise StoreUnavailable(f"cannot read blob: {e}", tier=self.store.tier, key=key) from e
        finally:
            os.close(fd)

    async def _get_into(self, key: str, start: int, dest: memoryview) -> None:
        try:
            await self.store.get_into(key, start, dest)
        except NotFound:
            raise NotFound(
                f"blob missing from checkpoint {self.store.url}", tier=self.store.tier, key=key
            ) from None
        except ValueError as e:  # InvalidRange: the blob is shorter than the manifest says
            raise CorruptData(f"blob is truncated ({e})", tier=self.store.tier, key=key) from None

    async def _get_range(self, key: str, lo: int, hi: int) -> bytes:
        try:
            return await self.store.get_range(key, lo, hi)
        except NotFound:
            raise NotFound(
                f"blob missing from checkpoint {self.store.url}", tier=self.store.tier, key=key
            ) from None
        except ValueError as e:
            raise CorruptData(f"blob is truncated ({e})", tier=self.store.tier, key=key) from None

    async def _check(self, si: int, c: ChunkEntry, stored: memoryview) -> None:
        if not self.options.verify:
            return
        if len(stored) != c.length:
            raise self._corrupt(si, c, f"read {len(stored)} bytes, expected {c.length}")
        got = await runtime.to_cpu(crc32c, stored)
        if got != c.crc32c:
            raise self._corrupt(
                si, c, f"checksum mismatch (crc32c {got:08x}, expected {c.crc32c:08x})"
            )

    # ---- memory-mapped storages ------------------------------------------------------

    def _mappable(self, si: int) -> bool:
        chunks = self.manifest.storages[si].chunks
        if not chunks:
            return False
        pos = chunks[0].offset
        for c in chunks:
            if c.codec != "raw" or c.blob != chunks[0].blob or c.offset != pos:
                return False
            pos += c.length
        return True

    def _map_storage(self, si: int) -> torch.Tensor:
        chunks = self.manifest.storages[si].chunks
        bi = chunks[0].blob
        mm = self._maps.get(bi)
        if mm is None:
            path = self.store.local_path(self.manifest.blob_key(bi))
            assert path is not None  # only called where the store has local files
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                raise NotFound(
                    "blob missing from checkpoint",
                    tier=self.store.tier,
                    key=self.manifest.blob_key(bi),
                ) from None
            try:
                s = self.manifest.storages[si]
                if os.fstat(fd).st_size < chunks[0].offset + s.nbytes:  # also: mmap of 0 bytes
                    raise self._corrupt(si, chunks[0], "blob is shorter than the manifest says")
                # ACCESS_COPY: tensors are writable, writes never reach the file.
                mm = _mmap.mmap(fd, 0, access=_mmap.ACCESS_COPY)
            finally:
                os.close(fd)
            self._maps[bi] = mm
        s = self.manifest.storages[si]
        start = chunks[0].offset
        if start + s.nbytes > len(mm):
            raise self._corrupt(si, chunks[0], "blob is shorter than the manifest says")
        if self.options.verify:
            view = memoryview(mm)
            try:
                for c in chunks:
                    got = crc32c(view[c.offset : c.offset + c.length])
                    if got != c.crc32c:
                        raise self._corrupt(
                            si, c, f"checksum mismatch (crc32c {got:08x}, expected {c.crc32c:08x})"
                        )
            finally:
                view.release()
        return torch.frombuffer(mm, dtype=torch.uint8, count=s.nbytes, offset=start)


def _coalesce(
    work: list[tuple[int, ChunkEntry, memoryview]],
) -> list[list[tuple[int, ChunkEntry, memoryview]]]:
    work = sorted(work, key=lambda w: (w[1].blob, w[1].offset))
    groups: list[list[tuple[int, ChunkEntry, memoryview]]] = []
    for w in work:
        c = w[1]
        if groups:
            g = groups[-1]
            first, last = g[0][1], g[-1][1]
            if (
                last.blob == c.blob
                and c.offset - (last.offset + last.length) <= COALESCE_GAP
                and c.offset + c.length - first.offset <= COALESCE_MAX
            ):
                g.append(w)
                continue
        groups.append([w])
    return groups


# ---- from storages to tensors ------------------------------------------------------------

MapLocation = Any


def target_device(map_location: MapLocation, saved: str) -> str | None:
    """Where a storage saved on ``saved`` goes (None: the callable decides)."""
    if map_location is None:
        return saved
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    if isinstance(map_location, dict):
        return str(map_location.get(saved, saved))
    if callable(map_location):
        return None
    raise TypeError(
        f"map_location must be None, a str, a torch.device, a dict or a callable, not {map_location!r}"
    )


def device_for(map_location: MapLocation, saved: str) -> torch.device | None:
    """The device a storage saved on ``saved`` is loaded onto, known before it is read.

    A callable ``map_location`` is asked once with an empty CPU storage: where it puts that
    one, the real one goes (read straight onto that device).  None when it keeps the storage
    on the CPU: it is then called with the loaded storage, as ``torch.load`` does."""
    dev = target_device(map_location, saved)
    if dev is None:
        probe = map_location(torch.UntypedStorage(0), saved)
        if probe is None:
            dev = saved
        else:
            if isinstance(probe, torch.TypedStorage):
                probe = probe._untyped_storage
            if probe.device.type == "cpu":
                return None
            return torch.device(probe.device)
    try:
        device = torch.device(dev)
    except RuntimeError:
        raise CorruptData(f"a storage's device {dev!r} is not a device name") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"the checkpoint holds tensors saved on {saved} but CUDA is not available here; "
            "pass map_location='cpu' (or another device) to load()"
        )
    return device


def place_storage(u8: torch.Tensor, saved: str, map_location: MapLocation) -> torch.Tensor:
    """Move a loaded CPU storage (uint8 tensor) where ``map_location`` says, as torch.load does."""
    dev = target_device(map_location, saved)
    if dev is None:
        result = map_location(u8.untyped_storage(), saved)
        if result is None:
            dev = saved
        else:
            if isinstance(result, torch.TypedStorage):
                result = result._untyped_storage
            return torch.empty(0, dtype=torch.uint8, device=result.device).set_(
                result, 0, (result.nbytes(),), (1,)
            )
    try:
        device = torch.device(dev)
    except RuntimeError:
        raise CorruptData(f"a storage's device {dev!r} is not a device name") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"the checkpoint holds tensors saved on {saved} but CUDA is not available here; "
            "pass map_location='cpu' (or another device) to load()"
        )
    return u8 if device.type == "cpu" else u8.to(device)
