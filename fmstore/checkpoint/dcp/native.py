"""Reading checkpoints written by torch's own ``FileSystemWriter`` (the native DCP layout).

Layout (torch's, not fmstore's)::

    PREFIX/.metadata          DCP's ``Metadata`` object, pickled (the commit)
    PREFIX/__R_N.distcp       rank R's N-th data file: items back to back

Every item is a byte range ``[offset, offset + length)`` of one data file: a tensor shard
as one ``torch.save`` archive, or a ``BYTE_IO`` value (non-tensor entries, ``torch.save``
bytes too).  DCP stores no checksums.

Nothing here runs code from the checkpoint:

* ``.metadata`` is a pickle (torch itself reads it with plain ``pickle.load``).  torch's
  ``weights_only`` unpickler cannot read it (it refuses the protocol-4 opcodes DCP writes),
  so it is read with a :class:`pickle.Unpickler` whose ``find_class`` admits only DCP's
  metadata classes, ``torch.Size``, dtypes and layouts; any other global is refused unless
  the caller passes ``allow_pickle=True`` (then it is unpickled as torch does: trust only
  checkpoints you wrote).  The file is read only when at most :data:`MAX_METADATA_BYTES`.
* Tensors are decoded with ``torch.load(weights_only=True)``; ``BYTE_IO`` values are
  handed to the caller's decoder (the Reader's ``weights_only`` check).
* Every offset and length is checked against the data file's size, and every tensor's
  declared size against the bytes saved for it, before anything is read or allocated.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import math
import pathlib
import pickle
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dmd
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from ... import runtime
from ...errors import CorruptData, FmstoreError, InvalidKey, NotFound, describe_error
from ...format.dtypes import dtype_from_name, dtype_name
from ...keys import validate_key
from ...stores import Store
from ..zipguard import check_torch_zip, load_refusal

__all__ = [
    "MAX_METADATA_BYTES",
    "METADATA_KEY",
    "NativeCheckpoint",
    "NativeItem",
    "check_archive",
    "decode_tensor",
    "has_native_metadata",
    "read_item",
    "read_native",
    "read_native_data",
]

METADATA_KEY = ".metadata"
#: A ``.metadata`` file larger than this is refused before it is read.
MAX_METADATA_BYTES = 256 << 20
#: Bytes of items fetched at once by :func:`read_native_data`.
MAX_INFLIGHT = 512 << 20

_RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")


def _safe_globals() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    out: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _get_layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        # StorageMeta.checkpoint_id: a path, kept as a pure path (no file system access).
        ("pathlib", "PosixPath"): pathlib.PurePosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib._local", "PosixPath"): pathlib.PurePosixPath,
        ("collections", "OrderedDict"): dict,
    }
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    ):
        out[("torch.distributed.checkpoint.metadata", name)] = getattr(dmd, name)
    for name, v in vars(torch).items():
        if isinstance(v, torch.dtype):
            out[("torch", name)] = v
    return out


def _get_layout(name: str) -> torch.layout:
    """torch.serialization._get_layout, restricted to the layouts torch defines."""
    for v in vars(torch).values():
        if isinstance(v, torch.layout) and str(v) == name:
            return v
    raise pickle.UnpicklingError(f"unknown layout {name!r}")


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata classes; any other global is refused."""

    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"global {module[:100]}.{name[:100]} is not DCP metadata"
            ) from None


@dataclass(frozen=True)
class NativeItem:
    """One saved item: bytes ``[start, start + length)`` of data file ``path``."""

    fqn: str
    offset: tuple[int, ...] | None
    index: int | None
    kind: str  # "tensor" or "bytes"
    dtype: str  # fmstore dtype name ("" for bytes)
    shape: tuple[int, ...]  # the saved shard's sizes
    path: str
    start: int
    length: int

    @property
    def md_index(self) -> dmd.MetadataIndex:
        return dmd.MetadataIndex(self.fqn, self.offset, self.index)

    @property
    def nbytes(self) -> int:
        if self.kind != "tensor":
            return self.length
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize

    def where(self, url: str) -> str:
        span = f"bytes {self.start}..{self.start + self.length}"
        return f"{short(self.fqn)} ({span} of {self.path} in {url})"


@dataclass
class NativeCheckpoint:
    """A native DCP checkpoint: torch's ``Metadata`` (``storage_data`` maps each index to
    its :class:`NativeItem`) and the size of every data file."""

    url: str
    metadata: dmd.Metadata
    items: list[NativeItem]
    files: dict[str, int] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        ranks = {int(m.group(1)) for p in self.files if (m := _RANK_FILE.fullmatch(p))}
        return len(ranks) or 1

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def stored_bytes(self) -> int:
        return sum(self.files.values())

    @property
    def version(self) -> str:
        return str(self.metadata.version or "")

    def to_metadata(self) -> dmd.Metadata:
        md = self.metadata
        return dmd.Metadata(
            state_dict_metadata=md.state_dict_metadata,
            planner_data=md.planner_data,
            storage_data={it.md_index: it for it in self.items},
            storage_meta=dmd.StorageMeta(),
            version=md.version,
        )


async def has_native_metadata(store: Store) -> bool:
    """Whether ``store`` holds a ``.metadata`` file (torch's commit)."""
    try:
        await store.stat(METADATA_KEY)
    except NotFound:
        return False
    return True


async def read_native(store: Store, *, allow_pickle: bool = False) -> NativeCheckpoint:
    """The checked metadata of the native DCP checkpoint in ``store`` (NotFound when there
    is no ``.metadata``; CorruptData naming the field when it cannot be true)."""
    where = f"{store.url}/{METADATA_KEY}"
    size = (await store.stat(METADATA_KEY)).size
    if size > MAX_METADATA_BYTES:
        raise CorruptData(
            f"{where} has {size} bytes, more than the {MAX_METADATA_BYTES} fmstore reads",
            tier=store.tier,
            key=METADATA_KEY,
        )
    data = await store.get_range(METADATA_KEY, 0, size)
    md, items = await runtime.to_cpu(_parse, data, where, allow_pickle)
    files: dict[str, int] = {}
    for path in sorted({it.path for it in items}):
        try:
            files[path] = (await store.stat(path)).size
        except NotFound:
            raise CorruptData(
                f"{path} is missing: {where} names it", tier=store.tier, key=path
            ) from None
    for it in items:
        if it.start + it.length > files[it.path]:
            raise CorruptData(
                f"not a valid checkpoint at {where}: item {it.fqn!r} declares bytes "
                f"{it.start}..{it.start + it.length} of {it.path}, which has {files[it.path]}",
                tier=store.tier,
                key=METADATA_KEY,
            )
    return NativeCheckpoint(store.url, md, items, files)


def _parse(data: bytes, where: str, allow_pickle: bool) -> tuple[dmd.Metadata, list[NativeItem]]:
    """``.metadata``'s checked contents: off the event loop (a big pickle takes seconds)."""
    md = _checked(_unpickle(data, where, allow_pickle), where)
    return md, _items(md, where)


def _unpickle(data: bytes, where: str, allow_pickle: bool) -> dmd.Metadata:
    if not _MetadataUnpickler.allowed:
        _MetadataUnpickler.allowed = _safe_globals()
    try:
        # allow_pickle: the caller trusts this checkpoint (and it is read as torch does).
        unpickler = pickle.Unpickler if allow_pickle else _MetadataUnpickler
        md = unpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        if "is not DCP metadata" in str(e):
            raise CorruptData(
                f"{where} holds objects other than DCP metadata ({e}); fmstore does not "
                "unpickle them: pass allow_pickle=True if you trust this checkpoint",
                key=METADATA_KEY,
            ) from None
        raise CorruptData(f"not a valid checkpoint at {where}: {e}", key=METADATA_KEY) from None
    except Exception as e:  # a garbled pickle raises almost anything
        raise CorruptData(
            f"not a valid checkpoint at {where}: .metadata does not parse ({describe_error(e)})",
            key=METADATA_KEY,
        ) from None
    if not isinstance(md, dmd.Metadata):
        raise CorruptData(
            f"not a valid checkpoint at {where}: holds a {type(md).__name__}, not DCP Metadata",
            key=METADATA_KEY,
        )
    return md


def short(v: Any, depth: int = 3) -> str:
    """A bounded repr of a value read from a file, for error messages: at most a few
    elements per container and ``depth`` levels, strings and numbers cut short.  Never
    calls the value's own ``__repr__`` (a pickled list DAG a few levels deep has an
    exponential one)."""
    if isinstance(v, bool) or v is None or isinstance(v, (float, torch.dtype)):
        return repr(v)
    if isinstance(v, int):
        return repr(v) if v.bit_length() <= 128 else f"<an int of {v.bit_length()} bits>"
    if isinstance(v, (str, bytes)):
        return repr(v[:80]) + ("..." if len(v) > 80 else "")
    name = type(v).__name__[:60]
    if depth <= 0:
        return f"<{name}>"
    if isinstance(v, (list, tuple, set, frozenset)):
        head = [short(x, depth - 1) for x in list(itertools.islice(v, 4))]
        more = ", ..." if len(v) > 4 else ""
        return f"{name}({', '.join(head)}{more})"
    if isinstance(v, dict):
        pairs = [
            f"{short(k, depth - 1)}: {short(x, depth - 1)}"
            for k, x in itertools.islice(v.items(), 4)
        ]
        return "{" + ", ".join(pairs) + (", ..." if len(v) > 4 else "") + "}"
    attrs = getattr(v, "__dict__", None)
    if isinstance(attrs, dict):
        shown = itertools.islice(attrs.items(), 6)
        return f"{name}({', '.join(f'{str(k)[:40]}={short(x, depth - 1)}' for k, x in shown)})"
    return f"<{name}>"


_MISSING = object()


def _checked(md: dmd.Metadata, where: str) -> dmd.Metadata:
    """``md`` rebuilt from its checked fields: a pickle may give a ``Metadata`` (or any
    of DCP's classes) no attributes at all, or attributes of any type.  The state-dict
    metadata is rebuilt from the fields fmstore checked, so the planners torch runs on it
    meet only well-formed values."""

    def bad(why: str) -> CorruptData:
        return CorruptData(f"not a valid checkpoint at {where}: {why}"[:500], key=METADATA_KEY)

    fields = {
        k: getattr(md, k, _MISSING)
        for k in ("state_dict_metadata", "storage_data", "planner_data", "version")
    }
    sdm, sd, pd, version = fields.values()
    if not isinstance(sdm, dict) or not isinstance(sd, dict):
        raise bad("state_dict_metadata or storage_data is missing or not a dict")
    if version is _MISSING or (version is not None and not isinstance(version, str)):
        raise bad(f"version {short(version)} is not a str")
    if pd is _MISSING or pd is None:
        pd = None
    elif not isinstance(pd, dict) or not all(
        isinstance(k, str)
        and isinstance(v, (tuple, list))
        and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v)
        for k, v in pd.items()
    ):
        raise bad(f"planner_data {short(pd)} is not a map of names to key paths")
    else:
        pd = {k: tuple(v) for k, v in pd.items()}
    clean: dict[str, Any] = {}
    for fqn, m in sdm.items():
        if not isinstance(fqn, str):
            raise bad(f"state_dict_metadata key {short(fqn)} is not a str")
        if isinstance(m, dmd.BytesStorageMetadata):
            clean[fqn] = dmd.BytesStorageMetadata()
            continue
        props = getattr(m, "properties", None)
        dtype = getattr(props, "dtype", None)
        size, chunks = _ints(getattr(m, "size", None)), getattr(m, "chunks", None)
        if (
            not isinstance(m, dmd.TensorStorageMetadata)
            or not isinstance(dtype, torch.dtype)
            or dtype_name(dtype) is None
            or size is None
            or not isinstance(chunks, list)
        ):
            raise bad(
                f"state_dict_metadata[{short(fqn)}]: {short(m)} is not a tensor's "
                "metadata (dtype, size, chunks)"
            )
        boxes = []
        for c in chunks:
            offs, lens = _ints(getattr(c, "offsets", None)), _ints(getattr(c, "sizes", None))
            if (
                offs is None
                or lens is None
                or len(offs) != len(size)
                or len(lens) != len(size)
                or any(o + n > s for o, n, s in zip(offs, lens, size, strict=True))
            ):
                raise bad(
                    f"state_dict_metadata[{short(fqn)}]: chunk {short(c)} does not fit "
                    f"size {list(size)}"
                )
            boxes.append(dmd.ChunkStorageMetadata(torch.Size(offs), torch.Size(lens)))
        # Strided, unpinned (pinning needs a GPU); whether it needs a gradient is kept.
        grad = getattr(props, "requires_grad", False) is True
        clean[fqn] = dmd.TensorStorageMetadata(
            dmd.TensorProperties(dtype=dtype, requires_grad=grad), torch.Size(size), boxes
        )
    return dmd.Metadata(
        state_dict_metadata=clean, planner_data=pd, storage_data=sd, version=version
    )


def _ints(v: Any) -> tuple[int, ...] | None:
    if not isinstance(v, (tuple, list)) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v
    ):
        return None
    return tuple(v)


def _items(md: dmd.Metadata, where: str) -> list[NativeItem]:
    """Every saved item of ``md`` (as :func:`_checked` returns it), checked: sizes, boxes,
    offsets, paths."""

    def bad(why: str) -> CorruptData:
        return CorruptData(f"not a valid checkpoint at {where}: {why}"[:500], key=METADATA_KEY)

    sdm, sd = md.state_dict_metadata, md.storage_data
    shapes: dict[
        str, tuple[tuple[int, ...], str, list[tuple[tuple[int, ...], tuple[int, ...]]]]
    ] = {}
    for fqn, m in sdm.items():
        if isinstance(m, dmd.TensorStorageMetadata):
            name = dtype_name(m.properties.dtype)
            assert name is not None  # checked by _checked
            boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks]
            shapes[fqn] = (tuple(m.size), name, boxes)
    items: list[NativeItem] = []
    held: dict[str, int] = {}
    for idx, info in sd.items():
        key, offset, index = (getattr(idx, k, _MISSING) for k in ("fqn", "offset", "index"))
        if not isinstance(idx, dmd.MetadataIndex) or not isinstance(key, str):
            raise bad(f"storage_data key {short(idx)} is not a MetadataIndex")
        fqn = key
        path, start, length = (
            getattr(info, k, None) for k in ("relative_path", "offset", "length")
        )
        if not isinstance(path, str) or _ints((start, length)) is None:
            raise bad(f"storage_data[{short(fqn)}]: bad file, offset or length ({short(info)})")
        assert isinstance(start, int) and isinstance(length, int)
        try:
            validate_key(path)
        except InvalidKey as e:
            raise bad(
                f"storage_data[{short(fqn)}]: file {path!r} is not a key ({e.message})"
            ) from None
        if getattr(info, "transform_descriptors", None):
            raise bad(
                f"storage_data[{short(fqn)}] was written with stream transforms "
                f"{short(info.transform_descriptors)} (compression extensions), which fmstore "
                "does not read"
            )
        if fqn not in sdm:
            raise bad(f"storage_data names {short(fqn)}, which state_dict_metadata lacks")
        index = index if isinstance(index, int) and not isinstance(index, bool) else None
        if fqn not in shapes:
            if offset is not None and offset is not _MISSING:
                raise bad(f"storage_data[{short(fqn)}]: a bytes entry with a tensor offset")
            items.append(NativeItem(fqn, None, index, "bytes", "", (), path, start, length))
            continue
        size, name, boxes = shapes[fqn]
        offs = _ints(offset)
        lens = next((n for o, n in boxes if o == offs), None)
        if offs is None or lens is None:
            raise bad(f"storage_data[{short(fqn)}]: offset {short(offset)} is none of its chunks")
        raw = math.prod(lens) * dtype_from_name(name).itemsize
        if raw > length:
            raise bad(
                f"storage_data[{short(fqn)}] (offset {list(offs)}): a shard of {list(lens)} "
                f"({raw} bytes) cannot be stored in {length} bytes"
            )
        held[fqn] = held.get(fqn, 0) + raw
        items.append(NativeItem(fqn, offs, index, "tensor", name, lens, path, start, length))
    for fqn, (size, name, _) in shapes.items():
        total = math.prod(size) * dtype_from_name(name).itemsize
        if total > held.get(fqn, 0):
            raise bad(
                f"state_dict_metadata[{short(fqn)}]: a tensor of size {list(size)} ({total} bytes) "
                f"has only {held.get(fqn, 0)} bytes saved"
            )
    return items


async def read_item(store: Store, item: NativeItem) -> bytes:
    """The stored bytes of ``item`` (CorruptData when the file is shorter)."""
    try:
        data = await store.get_range(item.path, item.start, item.start + item.length)
    except NotFound:
        raise CorruptData(
            f"{item.path} is missing (it holds {item.fqn!r})", tier=store.tier, key=item.path
        ) from None
    if len(data) != item.length:
        raise CorruptData(
            f"{item.where(store.url)} is cut short: {len(data)} bytes read",
            tier=store.tier,
            key=item.path,
        )
    return data


def check_archive(data: bytes, item: NativeItem, url: str, *, crc: bool = True) -> None:
    """Check that ``data`` is one ``torch.save`` archive of disjoint, stored, uniquely named
    members (:func:`~fmstore.checkpoint.zipguard.check_torch_zip`: nothing is inflated and
    no member is read twice, whatever its central directory lists), then with ``crc`` the
    CRC32 it records for every member (torch itself does not check them on load)."""
    check_torch_zip(data, name=f"corrupt item {item.where(url)}", key=item.path)
    if not crc:
        return
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            bad = z.testzip()
            why = "" if bad is None else f"member {bad[:100]!r} fails its CRC32"
    except Exception as e:  # zipfile raises many kinds on a garbled archive
        why = f"not a torch.save archive ({str(e)[:200] or type(e).__name__})"
    if why:
        raise CorruptData(f"corrupt item {item.where(url)}: {why}", key=item.path)


def decode_tensor(data: bytes, item: NativeItem, url: str, *, verify: bool = True) -> torch.Tensor:
    """The tensor ``torch.save`` wrote for ``item``, checked against its metadata (and its
    archive's CRC32s when ``verify``; its members and their sizes whatever ``verify`` says,
    before torch reads any)."""
    check_archive(data, item, url, crc=verify)
    try:
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorruptData(
            f"corrupt item {item.where(url)}: not a tensor torch can load ({load_refusal(e)})",
            key=item.path,
        ) from None
    want = dtype_from_name(item.dtype)
    if not isinstance(t, torch.Tensor) or t.dtype != want or tuple(t.shape) != item.shape:
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise CorruptData(
            f"corrupt item {item.where(url)}: holds {got}, the metadata says "
            f"{want} {list(item.shape)}",
            key=item.path,
        )
    return t


def read_native_data(
    store: Store,
    plan: LoadPlan,
    planner: LoadPlanner,
    storage_data: dict[Any, NativeItem],
    byte_io: Callable[[NativeItem, bytes], io.BytesIO],
    *,
    verify: bool = True,
) -> None:
    """DCP's ``read_data`` for a native checkpoint: items fetched concurrently, at most
    :data:`MAX_INFLIGHT` bytes at once, then decoded and handed to the planner."""
    reqs = []
    for req in plan.items:
        item = storage_data.get(req.storage_index)
        if item is None:
            raise CorruptData(
                f"checkpoint {store.url} has no data for {req.storage_index.fqn!r}",
                tier=store.tier,
                key=METADATA_KEY,
            )
        reqs.append((req, item))
    reqs.sort(key=lambda r: (r[1].path, r[1].start))
    i = 0
    while i < len(reqs):
        j, held = i, 0
        while j < len(reqs) and (j == i or held + reqs[j][1].length <= MAX_INFLIGHT):
            held += reqs[j][1].length
            j += 1
        batch = reqs[i:j]
        sem = asyncio.Semaphore(16)

        async def one(item: NativeItem, sem: asyncio.Semaphore = sem) -> bytes:
            async with sem:
                return await read_item(store, item)

        async def fetch(batch: list[Any] = batch) -> list[bytes]:
            return list(await asyncio.gather(*(one(it) for _, it in batch)))

        datas = runtime.run(fetch())
        for (req, item), data in zip(batch, datas, strict=True):
            if req.type == LoadItemType.BYTE_IO:
                check_archive(data, item, store.url, crc=verify)
                planner.load_bytes(req, byte_io(item, data))
                continue
            if item.kind != "tensor":
                raise CorruptData(f"{item.where(store.url)} is a value, the plan reads a tensor")
            t = decode_tensor(data, item, store.url, verify=verify)
            for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                t = t.narrow(dim, o, n)
            dest = planner.resolve_tensor(req).detach()
            if dest.shape != t.shape:
                raise FmstoreError(
                    f"{item.fqn}: destination has shape {tuple(dest.shape)}, the plan reads "
                    f"{tuple(t.shape)}"
                )
            dest.copy_(t)
            planner.commit_tensor(req, dest)
        i = j


async def verify_native(
    store: Store,
    ck: NativeCheckpoint,
    *,
    progress: Callable[[int], None] | None = None,
    concurrency: int = 4,
) -> tuple[int, int, list[str]]:
    """Read every item and check it: the bytes are there, the ``torch.save`` archive's
    CRC32s hold, and a tensor decodes to the dtype and shape its metadata says.  Returns the
    items and bytes found good and one line per problem (never raises for bad data)."""
    gate = asyncio.Semaphore(concurrency)
    good = [0, 0]
    problems: list[str] = []

    def check(item: NativeItem, data: bytes) -> None:
        if item.kind == "tensor":
            decode_tensor(data, item, store.url)
        else:
            check_archive(data, item, store.url)

    async def one(item: NativeItem) -> None:
        async with gate:
            try:
                data = await read_item(store, item)
                await runtime.to_cpu(check, item, data)
            except CorruptData as e:
                problems.append(e.message)
            else:
                good[0] += 1
                good[1] += item.length
        if progress is not None:
            progress(item.length)

    await asyncio.gather(*(one(it) for it in ck.items))
    return good[0], good[1], sorted(problems)
