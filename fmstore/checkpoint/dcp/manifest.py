"""The manifest of a multi-rank (``torch.distributed.checkpoint``) checkpoint, as JSON.

DCP's own ``FileSystemWriter`` pickles its ``Metadata`` object; fmstore writes it as JSON
instead (no pickle on the load path), in ``manifest.json`` like every fmstore checkpoint, so
the one commit convention holds: the coordinator writes it last, and a prefix without it is
garbage.  ``"format": "fmstore-dcp"`` tells it apart from a single-process checkpoint.

Layout::

    PREFIX/manifest.json                  the commit (this module)
    PREFIX/GENERATION/r00000-000.bin      data blobs: rank 0's first stream, ...

Each saved item (a tensor chunk of one rank, or a pickled-by-DCP ``BYTE_IO`` value) is split
into chunks of a few MiB, each with its codec and CRC32C (the single-process format's
:class:`~fmstore.format.ChunkEntry`; ``raw_offset`` counts from the item's first byte).
"""

from __future__ import annotations

import base64
import json
import math
import pickle
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...errors import CorruptData, describe_error, short_repr
from ...format.bounds import MAX_DEPTH, chunk_run_problem, is_int
from ...format.dtypes import dtype_from_name, dtype_name
from ...format.manifest import (
    DCP_FORMAT_NAME,
    DCP_FORMAT_VERSION,
    MANIFEST_KEY,
    ChunkEntry,
    field_int,
    field_ints,
    field_list,
    field_str,
    parse_header,
    sniff_format,  # noqa: F401  (re-exported)
)
from ...protocol.records import field_node
from ..layout import GENERATION_RE

__all__ = [
    "DCP_FORMAT_NAME",
    "DCP_FORMAT_VERSION",
    "MANIFEST_KEY",
    "DcpBlob",
    "DcpItem",
    "DcpManifest",
    "DcpPart",
]


#: Most ranks a checkpoint may name (a manifest's ``world_size``).
MAX_WORLD_SIZE = 1 << 20


def _field_time(d: dict[str, Any], key: str) -> float:
    """``d[key]`` (absent: 0.0): a finite, non-negative number of seconds."""
    v = d.get(key, 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e11:
        raise ValueError(f"field {key!r} is {short_repr(v)}, not a time")
    return float(v)


@dataclass(frozen=True)
class DcpBlob:
    """A data object of the checkpoint, at key ``GENERATION/name``, written by ``rank``."""

    name: str
    size: int
    rank: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "rank": self.rank}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DcpBlob:
        return cls(name=field_str(d, "name"), size=field_int(d, "size"), rank=field_int(d, "rank"))


@dataclass(frozen=True)
class DcpPart:
    """One node's part of a checkpoint on a node-local tier: the blobs its ``ranks`` wrote,
    found on that node alone."""

    node: str
    ranks: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "ranks": list(self.ranks)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DcpPart:
        return cls(node=field_node(d, "node"), ranks=field_ints(d, "ranks"))


@dataclass(frozen=True)
class DcpItem:
    """Where one saved item lives.

    ``kind`` is ``"tensor"`` (row-major bytes of a tensor of ``dtype`` and ``shape``) or
    ``"bytes"`` (a ``BYTE_IO`` value).  ``chunks`` cover ``[0, nbytes)`` in order; all of
    them are in one blob, back to back.
    """

    fqn: str
    offset: tuple[int, ...] | None
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: tuple[ChunkEntry, ...]
    index: int | None = None

    @property
    def md_index(self) -> MetadataIndex:
        return MetadataIndex(self.fqn, self.offset, self.index)

    @property
    def stored_bytes(self) -> int:
        return sum(c.length for c in self.chunks)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "fqn": self.fqn,
            "offset": None if self.offset is None else list(self.offset),
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "chunks": [c.to_json() for c in self.chunks],
        }
        if self.index is not None:
            d["index"] = self.index
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DcpItem:
        off = d.get("offset")
        return cls(
            fqn=field_str(d, "fqn"),
            offset=None if off is None else field_ints({"offset": off}, "offset"),
            kind=field_str(d, "kind"),
            dtype=str(d.get("dtype", "")),
            shape=field_ints({"shape": d.get("shape", [])}, "shape"),
            nbytes=field_int(d, "nbytes"),
            chunks=tuple(ChunkEntry.from_json(c) for c in field_list(d, "chunks")),
            index=None if d.get("index") is None else field_int(d, "index"),
        )

    def with_blob(self, blob: int) -> DcpItem:
        chunks = tuple(
            ChunkEntry(
                blob=blob,
                offset=c.offset,
                length=c.length,
                raw_offset=c.raw_offset,
                raw=c.raw,
                codec=c.codec,
                crc32c=c.crc32c,
                group=c.group,
            )
            for c in self.chunks
        )
        return DcpItem(
            self.fqn,
            self.offset,
            self.kind,
            self.dtype,
            self.shape,
            self.nbytes,
            chunks,
            self.index,
        )


# ---- planner_data and other free-form values: tagged JSON ------------------------------


class _Unencodable(Exception):
    pass


def _enc(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return {"__float__": repr(v)}
        return v
    if isinstance(v, torch.Size):
        return {"__size__": [int(x) for x in v]}
    if isinstance(v, tuple):
        return {"__tuple__": [_enc(x) for x in v]}
    if isinstance(v, list):
        return [_enc(x) for x in v]
    if isinstance(v, dict):
        if all(isinstance(k, str) for k in v) and not any(k.startswith("__") for k in v):
            return {k: _enc(x) for k, x in v.items()}
        return {"__dict__": [[_enc(k), _enc(x)] for k, x in v.items()]}
    raise _Unencodable(type(v).__name__)


def _dec(v: Any) -> Any:
    if isinstance(v, list):
        return [_dec(x) for x in v]
    if isinstance(v, dict):
        if "__tuple__" in v:
            return tuple(_dec(x) for x in v["__tuple__"])
        if "__size__" in v:
            return torch.Size(v["__size__"])
        if "__float__" in v:
            return float(v["__float__"])
        if "__dict__" in v:
            return {_dec(k): _dec(x) for k, x in v["__dict__"]}
        if "__pickle__" in v:
            raise _Unencodable("pickle")
        return {k: _dec(x) for k, x in v.items()}
    return v


def encode_value(v: Any, *, allow_pickle: bool, what: str) -> Any:
    """JSON for ``v``; values JSON cannot hold are pickled only when ``allow_pickle``."""
    try:
        return _enc(v)
    except _Unencodable as e:
        if not allow_pickle:
            raise TypeError(
                f"{what} holds a {e} that fmstore stores only as pickle; pass "
                "allow_pickle=True to the Writer to save it anyway"
            ) from None
        return {"__pickle__": base64.b64encode(pickle.dumps(v)).decode()}


def decode_value(v: Any, *, allow_pickle: bool, what: str) -> Any:
    if isinstance(v, dict) and "__pickle__" in v:
        if not allow_pickle:
            raise CorruptData(
                f"{what} was saved as pickle; pass allow_pickle=True to the Reader to load it"
            )
        return pickle.loads(base64.b64decode(v["__pickle__"]))
    if _depth(v) > MAX_DEPTH:
        raise CorruptData(f"{what} is nested deeper than {MAX_DEPTH} levels", key=MANIFEST_KEY)
    try:
        return _dec(v)
    except _Unencodable:
        raise CorruptData(f"{what} holds pickled values; pass allow_pickle=True") from None
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as e:
        raise CorruptData(f"{what} is malformed ({describe_error(e)})", key=MANIFEST_KEY) from None


def _depth(v: Any) -> int:
    """Nesting depth of JSON value ``v``, without recursion (stops counting past MAX_DEPTH)."""
    deepest = 0
    stack = [(v, 0)]
    while stack:
        x, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            break
        if isinstance(x, list):
            stack.extend((y, d + 1) for y in x)
        elif isinstance(x, dict):
            stack.extend((y, d + 1) for y in x.values())
    return deepest


# ---- DCP Metadata <-> JSON --------------------------------------------------------------


def _sd_md_to_json(md: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fqn, m in md.items():
        if isinstance(m, TensorStorageMetadata):
            name = dtype_name(m.properties.dtype)
            if name is None:
                raise TypeError(
                    f"tensor {fqn!r} has dtype {m.properties.dtype}, unknown to fmstore"
                )
            d: dict[str, Any] = {
                "type": "tensor",
                "dtype": name,
                "size": list(m.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks],
            }
            if m.properties.requires_grad:
                d["requires_grad"] = True
            out[fqn] = d
        elif isinstance(m, BytesStorageMetadata):
            out[fqn] = {"type": "bytes"}
        else:
            raise TypeError(f"state_dict_metadata[{fqn!r}] is a {type(m).__name__}")
    return out


def _sd_md_from_json(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fqn, m in d.items():
        if m["type"] == "tensor":
            out[fqn] = TensorStorageMetadata(
                properties=TensorProperties(
                    dtype=dtype_from_name(m["dtype"]),
                    requires_grad=bool(m.get("requires_grad", False)),
                ),
                size=torch.Size(m["size"]),
                chunks=[
                    ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
                    for c in m["chunks"]
                ],
            )
        elif m["type"] == "bytes":
            out[fqn] = BytesStorageMetadata()
        else:
            raise ValueError(f"unknown entry type {m['type']!r} for {fqn!r}")
    return out


@dataclass
class DcpManifest:
    """Everything a reader needs: DCP's ``Metadata`` plus where every item's bytes are."""

    generation: str
    world_size: int
    state_dict_metadata: dict[str, Any]
    items: list[DcpItem]
    blobs: list[DcpBlob]
    planner_data: Any = None
    dcp_version: str | None = None
    storage_meta: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    writer: str = ""
    version: int = 1
    #: one per node when written to a node-local tier by a job of several nodes, else empty
    parts: list[DcpPart] = field(default_factory=list)

    def part_of(self, node: str) -> DcpPart | None:
        return next((p for p in self.parts if p.node == node), None)

    def part_view(self, node: str) -> DcpManifest | None:
        """This manifest restricted to ``node``'s part: its ranks' blobs and the items in
        them (None: no such part)."""
        part = self.part_of(node)
        if part is None:
            return None
        keep = [i for i, b in enumerate(self.blobs) if b.rank in part.ranks]
        index = {old: new for new, old in enumerate(keep)}
        items = [
            it.with_blob(index[it.chunks[0].blob])
            for it in self.items
            if it.chunks and it.chunks[0].blob in index
        ]
        return replace(self, items=items, blobs=[self.blobs[i] for i in keep])

    def part_bytes(self, node: str) -> int:
        part = self.part_of(node)
        return sum(b.size for b in self.blobs if part is None or b.rank in part.ranks)

    def node_of_rank(self, rank: int) -> str | None:
        return next((p.node for p in self.parts if rank in p.ranks), None)

    def storage_for(self, ranks: set[int] | None) -> dict[MetadataIndex, DcpItem]:
        """Each saved item's record; where an item is saved on several nodes (a value DCP
        deduplicated, copied into every node's part), the copy written by one of ``ranks``."""
        out: dict[MetadataIndex, DcpItem] = {}
        for it in self.items:
            mine = (
                ranks is not None
                and bool(it.chunks)
                and self.blobs[it.chunks[0].blob].rank in ranks
            )
            if mine or it.md_index not in out:
                out[it.md_index] = it
        return out

    def blob_key(self, blob: int) -> str:
        return f"{self.generation}/{self.blobs[blob].name}"

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def stored_bytes(self) -> int:
        return sum(b.size for b in self.blobs)

    # -- DCP objects --

    def to_metadata(self, *, allow_pickle: bool = False, ranks: set[int] | None = None) -> Metadata:
        """DCP's ``Metadata``; ``storage_data`` maps each ``MetadataIndex`` to its item (the
        copy in the part of ``ranks`` where there are several, see :meth:`storage_for`)."""
        sm = self.storage_meta
        return Metadata(
            state_dict_metadata=_sd_md_from_json(self.state_dict_metadata),
            planner_data=decode_value(
                self.planner_data, allow_pickle=allow_pickle, what="the checkpoint's planner data"
            ),
            storage_data=self.storage_for(ranks),
            storage_meta=StorageMeta(
                checkpoint_id=sm.get("checkpoint_id"),
                save_id=sm.get("save_id"),
                modules=list(sm.get("modules", [])),
            ),
            version=self.dcp_version,
        )

    @classmethod
    def from_metadata(
        cls,
        md: Metadata,
        *,
        generation: str,
        world_size: int,
        items: list[DcpItem],
        blobs: list[DcpBlob],
        allow_pickle: bool,
        writer: str,
        parts: list[DcpPart] | None = None,
    ) -> DcpManifest:
        sm = md.storage_meta
        parts = list(parts or [])
        return cls(
            parts=parts if len(parts) > 1 else [],
            version=2 if len(parts) > 1 else 1,
            generation=generation,
            world_size=world_size,
            state_dict_metadata=_sd_md_to_json(md.state_dict_metadata),
            items=items,
            blobs=blobs,
            planner_data=encode_value(
                md.planner_data, allow_pickle=allow_pickle, what="the save planner's planner_data"
            ),
            dcp_version=md.version,
            storage_meta={}
            if sm is None
            else {
                "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
                "save_id": sm.save_id,
                "modules": list(sm.modules),
            },
            writer=writer,
        )

    # -- JSON --

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": DCP_FORMAT_NAME,
            "version": self.version,
            "generation": self.generation,
            "created": self.created,
            "writer": self.writer,
            "world_size": self.world_size,
            "dcp_version": self.dcp_version,
            "storage_meta": self.storage_meta,
            "planner_data": self.planner_data,
            "state_dict_metadata": self.state_dict_metadata,
            "blobs": [b.to_json() for b in self.blobs],
            "items": [i.to_json() for i in self.items],
        }
        if self.parts:
            d["parts"] = [p.to_json() for p in self.parts]
        return d

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def loads(cls, data: bytes, *, where: str = "") -> DcpManifest:
        """Parse a manifest; :class:`CorruptData` / :class:`VersionError` naming ``where``."""
        suffix = f" at {where}" if where else ""
        d, version = parse_header(
            data,
            where=where,
            format_name=DCP_FORMAT_NAME,
            max_version=DCP_FORMAT_VERSION,
            kind="multi-rank (DCP) checkpoint",
        )
        try:
            m = cls(
                generation=field_str(d, "generation"),
                world_size=field_int(d, "world_size"),
                state_dict_metadata=dict(d["state_dict_metadata"]),
                items=[DcpItem.from_json(i) for i in field_list(d, "items")],
                blobs=[DcpBlob.from_json(b) for b in field_list(d, "blobs")],
                planner_data=d.get("planner_data"),
                dcp_version=d.get("dcp_version"),
                storage_meta=dict(d.get("storage_meta") or {}),
                created=_field_time(d, "created"),
                writer=str(d.get("writer", "")),
                version=version,
                parts=[DcpPart.from_json(p) for p in d.get("parts") or []],
            )
            _sd_md_from_json(m.state_dict_metadata)  # parses, or raises below
            sm = m.storage_meta
            if not all(
                isinstance(sm.get(k), (str, type(None))) for k in ("checkpoint_id", "save_id")
            ):
                raise ValueError("storage_meta ids are not strings")
            if not isinstance(sm.get("modules", []), list):
                raise ValueError("storage_meta.modules is not a list")
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise CorruptData(
                f"not a valid checkpoint{suffix}: manifest is malformed ({describe_error(e)})",
                key=MANIFEST_KEY,
            ) from None
        m.validate(where)
        return m

    def validate(self, where: str = "") -> None:
        """Cross-check offsets and sizes so a reader never indexes out of range nor
        allocates more than the blobs can hold (O(items + chunks), no data read)."""
        suffix = f" at {where}" if where else ""

        def bad(why: str) -> CorruptData:
            return CorruptData(f"not a valid checkpoint{suffix}: {why}", key=MANIFEST_KEY)

        if not GENERATION_RE.match(self.generation):
            raise bad(f"generation {self.generation[:80]!r} is not a generation's name")
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise bad(f"world_size {self.world_size} is not 1..{MAX_WORLD_SIZE}")
        for b in self.blobs:
            if b.size < 0:
                raise bad(f"blob {b.name!r} has negative size {b.size}")
            if not 0 <= b.rank < self.world_size:
                raise bad(f"blob {b.name!r} names rank {b.rank}, outside the world")
        if self.parts:
            ranks = sorted(r for p in self.parts for r in p.ranks)
            if ranks != list(range(self.world_size)):
                raise bad(f"parts hold ranks {ranks[:16]}, not each of the {self.world_size}")
            if len({p.node for p in self.parts}) != len(self.parts):
                raise bad("two parts name the same node")
        held: dict[str, int] = {}
        for it in self.items:
            what = f"item {it.fqn!r} (offset {list(it.offset or ())})"
            if it.kind == "tensor":
                try:
                    itemsize = dtype_from_name(it.dtype).itemsize
                except KeyError:
                    raise bad(f"{what}: unknown dtype {it.dtype!r}") from None
                if any(n < 0 for n in it.shape) or (
                    it.offset is not None and len(it.offset) != len(it.shape)
                ):
                    raise bad(f"{what}: bad shape {list(it.shape)}")
                if math.prod(it.shape) * itemsize != it.nbytes:
                    raise bad(f"{what}: nbytes {it.nbytes} does not match shape {list(it.shape)}")
            elif it.kind != "bytes":
                raise bad(f"{what}: unknown kind {it.kind!r}")
            why, pos = chunk_run_problem(it.chunks, self.blobs)
            if why:
                raise bad(f"{what}: {why}")
            if pos != it.nbytes:
                raise bad(f"{what}: chunks cover {pos} of its {it.nbytes} bytes")
            held[it.fqn] = held.get(it.fqn, 0) + it.nbytes
        for fqn, md in self.state_dict_metadata.items():
            why = _md_problem(md, held.get(fqn, 0))
            if why:
                raise bad(f"state_dict_metadata[{fqn!r}]: {why}")


def _md_problem(md: dict[str, Any], held: int) -> str | None:
    """Why a tensor's metadata cannot be true: sizes and chunk boxes out of range, or a whole
    tensor larger than the bytes saved for it (a loader allocates the whole tensor)."""
    if md.get("type") != "tensor":
        return None
    size = md.get("size")
    if not isinstance(size, list) or not all(is_int(n) and n >= 0 for n in size):
        return f"size {size!r} is not a list of non-negative ints"
    total = math.prod(size) * dtype_from_name(md["dtype"]).itemsize
    if total > held:
        return f"a tensor of size {size} ({total} bytes) has only {held} bytes saved"
    for c in md.get("chunks", ()):
        offs, lens = c.get("offsets"), c.get("sizes")
        if (
            not isinstance(offs, list)
            or not isinstance(lens, list)
            or len(offs) != len(size)
            or len(lens) != len(size)
            or not all(is_int(x) and is_int(n) for x, n in zip(offs, lens, strict=True))
            or any(x < 0 or n < 0 or x + n > s for x, n, s in zip(offs, lens, size, strict=True))
        ):
            return f"chunk {c!r} does not fit size {size}"
    return None
