"""Checking every chunk of a checkpoint against its CRC32C without decoding it.

One check for both formats (a single-process checkpoint and a multi-rank DCP one), used by
``fmstore ckpt verify``, the tier mover (before and after a copy) and the policies.

The manifest records a CRC32C per chunk; chunks lie at known offsets of their blob, with
zero bytes between them, so each blob's whole CRC32C follows from the manifest alone
(:func:`blob_checksums`).  That lets a check skip reading a blob whose storage vouches for
its bytes: ``store_checksums=True`` compares each blob's whole CRC32C with the one the
store computed itself when it took the bytes (:meth:`~fmstore.stores.base.Store.stored_crc32c`,
on S3 the server's checksum, which it checked against the one the uploader sent), and with
``written`` the CRC32C a copy took of the very bytes it wrote and synced.  A blob with
neither is read back and checked chunk by chunk, as without them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias, cast

from .. import runtime
from ..errors import CorruptData, InvalidRange, NotFound
from ..format.checksum import crc32c
from ..format.manifest import DCP_FORMAT_NAME, MANIFEST_KEY, Manifest, sniff_format
from ..stores.base import Store
from ..stores.crc import combine_all
from .commit import manifest_bytes

if TYPE_CHECKING:
    from .dcp.manifest import DcpManifest
    from .dcp.native import NativeCheckpoint

    AnyManifest: TypeAlias = Manifest | DcpManifest | NativeCheckpoint
    #: A manifest fmstore committed itself (``manifest.json``), of either format.
    AnyCommitted: TypeAlias = Manifest | DcpManifest


#: Chunks of one blob are read in runs of at most this many bytes (memory stays bounded).
READ_RUN = 64 << 20


@dataclass(frozen=True)
class BadChunk:
    """A chunk that failed: the tensor (or state-dict entry) it belongs to, where it is,
    and why."""

    tensor: str
    blob: str
    offset: int
    reason: str

    def __str__(self) -> str:
        return f"tensor {self.tensor!r} blob {self.blob} offset {self.offset}: {self.reason}"


@dataclass
class VerifyResult:
    """Outcome of :func:`verify_checkpoint`.  ``problems``: one line per problem (a missing
    or unreadable manifest, a missing or wrong-sized blob, a chunk failing its checksum);
    ``bad``: the failed chunks among them.  ``ok`` when there is none."""

    url: str
    tier: str
    chunks: int = 0
    bytes: int = 0
    manifest_crc32c: int | None = None
    problems: list[str] = field(default_factory=list)
    bad: list[BadChunk] = field(default_factory=list)
    #: Blobs vouched for without reading them: by the store's own checksum, by the
    #: checksum of the bytes the copy wrote.  The others were read back.
    by_store_checksum: int = 0
    by_written_checksum: int = 0
    read_back: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class _Chunk:
    name: str
    offset: int
    length: int
    crc32c: int


def _layout(m: Manifest | DcpManifest) -> dict[int, list[_Chunk]]:
    """Each blob's chunks, sorted by offset, named by the tensor they hold."""
    by_blob: dict[int, list[_Chunk]] = {}
    if isinstance(m, Manifest):
        names: dict[int, str] = {}
        for t in m.tensors:
            names.setdefault(t.storage, t.name)
        for si, s in enumerate(m.storages):
            name = names.get(si, f"<storage {si}>")
            for c in s.chunks:
                by_blob.setdefault(c.blob, []).append(_Chunk(name, c.offset, c.length, c.crc32c))
    else:
        for it in m.items:
            for c in it.chunks:
                by_blob.setdefault(c.blob, []).append(_Chunk(it.fqn, c.offset, c.length, c.crc32c))
    for chunks in by_blob.values():
        chunks.sort(key=lambda c: c.offset)
    return by_blob


def blob_checksums(m: Manifest | DcpManifest) -> list[int | None]:
    """Each blob's whole-object CRC32C, combined from its chunks' CRCs.

    Chunks start at aligned offsets; the writer fills the gaps with zero bytes, whose CRC
    is known, so the whole blob's checksum follows from the manifest without reading it.
    None for a blob whose chunks overlap or overrun it (not written by this format), which
    can then only be checked by reading it."""
    layout = _layout(m)
    out: list[int | None] = []
    for i in range(len(m.blobs)):
        size = m.blobs[i].size
        pieces: list[tuple[int, int]] = []
        pos = 0
        for c in layout.get(i, []):
            if c.offset < pos:
                break
            if c.offset > pos:
                pieces.append((_zeros_crc(c.offset - pos), c.offset - pos))
            pieces.append((c.crc32c, c.length))
            pos = c.offset + c.length
        else:
            if pos <= size:
                if pos < size:
                    pieces.append((_zeros_crc(size - pos), size - pos))
                out.append(combine_all(pieces))
                continue
        out.append(None)
    return out


_MiB_ZEROS_CRC = crc32c(bytes(1 << 20))


def _zeros_crc(n: int) -> int:
    """CRC32C of ``n`` zero bytes, without allocating more than 1 MiB."""
    whole, rest = divmod(n, 1 << 20)
    pieces = [(_MiB_ZEROS_CRC, 1 << 20)] * whole
    if rest:
        pieces.append((crc32c(bytes(rest)), rest))
    return combine_all(pieces)


async def read_committed(store: Store) -> tuple[bytes, AnyCommitted]:
    """The manifest fmstore committed at ``store``'s root, of either of its formats (a
    single-process checkpoint or one written by the DCP ``Writer``), with its bytes.

    NotFound when the prefix holds no checkpoint; VersionError (a CorruptData) when it was
    written by a newer fmstore; CorruptData when it does not parse."""
    data = await manifest_bytes(store)
    if DCP_FORMAT_NAME.encode() in data and sniff_format(data) == DCP_FORMAT_NAME:
        from .dcp.manifest import DcpManifest  # imports torch.distributed: only when needed

        return data, DcpManifest.loads(data, where=f"{store.url}/{MANIFEST_KEY}")
    return data, Manifest.loads(data, where=store.url)


async def read_any_manifest(store: Store, *, native: bool = False) -> tuple[bytes, AnyManifest]:
    """The committed manifest at ``store``'s root, of either format (NotFound / CorruptData).

    ``native``: without a ``manifest.json``, also accept a checkpoint written by torch's
    own ``FileSystemWriter`` (its ``.metadata``, read without unpickling code; the bytes
    returned are then empty)."""
    try:
        return await read_committed(store)
    except NotFound:
        if not native:
            raise
        from .dcp.native import has_native_metadata, read_native

        if not await has_native_metadata(store):
            raise
        return b"", await read_native(store)


async def verify_checkpoint(
    store: Store,
    manifest: AnyManifest | None = None,
    *,
    progress: Callable[[int], None] | None = None,
    concurrency: int = 16,
    store_checksums: bool = False,
    written: Mapping[str, int] | None = None,
) -> VerifyResult:
    """Check every blob's size and every chunk's CRC32C (computed in the CPU pool) against
    the manifest, read from ``store`` when not given.

    ``store_checksums``: a blob whose whole CRC32C the store computed itself is checked
    against it instead of being read (see the module docstring).  ``written``: CRC32Cs of
    blobs by key, taken from the bytes a copy wrote to ``store`` and synced; a blob listed
    with the checksum the manifest implies is checked by its size alone.  Only for a copy
    just made by this process: a read-back of pages it has just written comes from the
    page cache and would prove nothing more.

    Never raises for bad data: problems are listed in the result (a missing manifest is a
    problem too).  Only what is proven is a problem: a manifest or blob the store says is
    not there, a wrong size, bytes that fail their checksum or do not parse.  A read that
    fails otherwise (:class:`~fmstore.errors.PermissionDenied`, a store outage:
    :class:`~fmstore.errors.StoreUnavailable`, any other error) leaves the copy's state
    unknown and is raised: a caller retries later and never deletes a copy on it.
    ``progress(n)`` is called with the stored bytes of each run of chunks checked.
    """
    res = VerifyResult(url=store.url, tier=store.tier)
    if manifest is None:
        try:
            data, manifest = await read_any_manifest(store, native=True)
        except (NotFound, CorruptData) as e:
            res.problems.append(str(e))
            return res
        if data:
            res.manifest_crc32c = crc32c(data)
    if not isinstance(manifest, Manifest):
        # A DCP checkpoint (torch.distributed is loaded already): fmstore's or torch's layout.
        from .dcp.native import NativeCheckpoint, verify_native

        if isinstance(manifest, NativeCheckpoint):
            # torch's own layout: no checksums but the CRC32s of each item's zip archive.
            found = await verify_native(store, manifest, progress=progress)
            res.chunks, res.bytes, res.problems = found
            return res
    m = cast("Manifest | DcpManifest", manifest)
    gate = asyncio.Semaphore(concurrency)

    def fail(name: str, key: str, offset: int, reason: str) -> None:
        res.bad.append(BadChunk(name, key, offset, reason))
        res.problems.append(f"blob {key}: chunk of {name!r} at offset {offset} {reason}")

    async def one(blob: int, chunks: list[_Chunk]) -> None:
        key = m.blob_key(blob)
        stored: int | None = None
        async with gate:
            try:
                if store_checksums:
                    size, stored = await store.stored_crc32c(key)
                else:
                    size = (await store.stat(key)).size
            except NotFound:
                res.problems.append(f"blob {key} is missing")
                res.bad.extend(BadChunk(c.name, key, c.offset, "blob missing") for c in chunks)
                return
        want = m.blobs[blob].size
        if size != want:
            res.problems.append(f"blob {key} has {size} bytes, the manifest says {want}")
            res.bad.extend(
                BadChunk(c.name, key, c.offset, "blob has the wrong size") for c in chunks
            )
            return
        want_crc = whole[blob] if whole is not None else None
        if want_crc is not None and written is not None and written.get(key) == want_crc:
            res.by_written_checksum += 1
            count(chunks)
            return
        if want_crc is not None and stored is not None:
            if stored == want_crc:
                res.by_store_checksum += 1
                count(chunks)
            else:
                res.problems.append(
                    f"blob {key}: the store's CRC32C {stored:08x} is not the {want_crc:08x} "
                    "its chunks' checksums give"
                )
                res.bad.extend(
                    BadChunk(c.name, key, c.offset, "blob fails its checksum") for c in chunks
                )
            return
        res.read_back += 1
        i = 0
        while i < len(chunks):
            j, start = i + 1, chunks[i].offset
            while j < len(chunks) and chunks[j].offset + chunks[j].length - start <= READ_RUN:
                j += 1
            end = max(c.offset + c.length for c in chunks[i:j])
            async with gate:
                try:
                    data = memoryview(await store.get_range(key, start, end))
                except NotFound:
                    data = memoryview(b"")
                except (CorruptData, InvalidRange) as e:  # the store's proof: bad bytes
                    for c in chunks[i:j]:
                        fail(c.name, key, c.offset, f"is unreadable ({e.message})")
                    i = j
                    continue
                # Any other error (PermissionDenied, StoreUnavailable, ...) proves nothing
                # about the bytes: it is raised, never a verdict.
                for c in chunks[i:j]:
                    piece = data[c.offset - start : c.offset - start + c.length]
                    if len(piece) != c.length:
                        fail(c.name, key, c.offset, f"({c.length} bytes) is cut short")
                    elif await runtime.to_cpu(crc32c, piece) != c.crc32c:
                        fail(c.name, key, c.offset, f"({c.length} bytes) fails its checksum")
                    else:
                        res.chunks += 1
                        res.bytes += c.length
            if progress is not None:
                progress(sum(c.length for c in chunks[i:j]))
            i = j

    def count(chunks: list[_Chunk]) -> None:
        res.chunks += len(chunks)
        res.bytes += sum(c.length for c in chunks)
        if progress is not None:
            progress(sum(c.length for c in chunks))

    whole = blob_checksums(m) if store_checksums or written else None
    layout = _layout(m)
    await asyncio.gather(*(one(b, layout.get(b, [])) for b in range(len(m.blobs))))
    res.problems.sort()
    res.bad.sort(key=lambda b: (b.blob, b.offset))
    return res
