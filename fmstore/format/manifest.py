"""The checkpoint manifest: versioned dataclasses <-> JSON.

A checkpoint is a prefix holding data blobs (``GEN/NNNNNN.bin``) and one ``manifest.json``
written last; the manifest *is* the commit.  See ``docs/format.md`` for the full layout.

Compatibility rule: a reader accepts every ``version <= FORMAT_VERSION`` and raises
:class:`~fmstore.errors.VersionError` for newer ones; anything that does not parse as a
manifest raises :class:`~fmstore.errors.CorruptData` ("not a valid checkpoint").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptData, VersionError, describe_error, short_repr
from ..stores.bounded import decode_json
from .bounds import chunk_run_problem, is_int, view_problem
from .dtypes import dtype_itemsize
from .treecheck import tree_problem

FORMAT_NAME = "fmstore-checkpoint"
#: The ``format`` of a multi-rank checkpoint's manifest (:mod:`fmstore.checkpoint.dcp`).
DCP_FORMAT_NAME = "fmstore-dcp"
#: The newest manifest version this fmstore reads.  Version 1: one part (every blob where
#: the manifest is).  Version 2: ``parts``, one per node of a node-local tier; a save writes
#: 2 only when there are several parts, so an older fmstore still reads everything else,
#: and reports a version-2 manifest as a newer format, never as damage.
DCP_FORMAT_VERSION = 2
FORMAT_VERSION = 1
MANIFEST_KEY = "manifest.json"


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk of a storage: ``raw`` bytes at ``raw_offset`` of the storage, stored as
    ``length`` bytes at ``offset`` of blob ``blob`` with ``codec`` (``group``: element size for
    byte grouping); ``crc32c`` is the checksum of the stored bytes."""

    blob: int
    offset: int
    length: int
    raw_offset: int
    raw: int
    codec: str
    crc32c: int
    group: int = 1

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "blob": self.blob,
            "offset": self.offset,
            "length": self.length,
            "raw_offset": self.raw_offset,
            "raw": self.raw,
            "codec": self.codec,
            "crc32c": self.crc32c,
        }
        if self.group != 1:
            d["group"] = self.group
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChunkEntry:
        return cls(
            blob=field_int(d, "blob"),
            offset=field_int(d, "offset"),
            length=field_int(d, "length"),
            raw_offset=field_int(d, "raw_offset"),
            raw=field_int(d, "raw"),
            codec=field_str(d, "codec"),
            crc32c=field_int(d, "crc32c"),
            group=field_int(d, "group", 1),
        )


@dataclass(frozen=True)
class StorageEntry:
    """A span of bytes shared by one or more tensors (tied weights, views): saved once."""

    nbytes: int
    device: str
    chunks: tuple[ChunkEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "nbytes": self.nbytes,
            "device": self.device,
            "chunks": [c.to_json() for c in self.chunks],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StorageEntry:
        return cls(
            nbytes=field_int(d, "nbytes"),
            device=field_str(d, "device"),
            chunks=tuple(ChunkEntry.from_json(c) for c in field_list(d, "chunks")),
        )


@dataclass(frozen=True)
class TensorEntry:
    """A tensor: a view (byte ``offset``, ``shape``, ``stride`` in elements) of a storage."""

    name: str
    storage: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool = False
    parameter: bool = False
    numpy: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "storage": self.storage,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "offset": self.offset,
        }
        if self.requires_grad:
            d["requires_grad"] = True
        if self.parameter:
            d["parameter"] = True
        if self.numpy:
            d["numpy"] = True
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorEntry:
        return cls(
            name=field_str(d, "name"),
            storage=field_int(d, "storage"),
            dtype=field_str(d, "dtype"),
            shape=field_ints(d, "shape"),
            stride=field_ints(d, "stride"),
            offset=field_int(d, "offset"),
            requires_grad=bool(d.get("requires_grad", False)),
            parameter=bool(d.get("parameter", False)),
            numpy=bool(d.get("numpy", False)),
        )


@dataclass(frozen=True)
class BlobEntry:
    """A data object of the checkpoint, at key ``GENERATION/name``."""

    name: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BlobEntry:
        return cls(name=field_str(d, "name"), size=field_int(d, "size"))


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs, in one JSON document written last."""

    generation: str
    tree: Any
    tensors: tuple[TensorEntry, ...]
    storages: tuple[StorageEntry, ...]
    blobs: tuple[BlobEntry, ...]
    created: float = 0.0
    writer: str = ""
    pickled: bool = False
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        """One line (the generated repr printed every tensor and chunk: screens of text
        in a notebook); the entries are in the fields."""
        from ..units import human_bytes

        def n(count: int, what: str) -> str:
            return f"{count} {what}{'' if count == 1 else 's'}"

        return (
            f"<Manifest {self.generation}: {n(len(self.tensors), 'tensor')}, "
            f"{human_bytes(self.nbytes)} in {n(len(self.blobs), 'blob')} "
            f"({human_bytes(self.stored_bytes)} stored)>"
        )

    def blob_key(self, blob: int) -> str:
        return f"{self.generation}/{self.blobs[blob].name}"

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.storages)

    @property
    def stored_bytes(self) -> int:
        return sum(b.size for b in self.blobs)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "generation": self.generation,
            "created": self.created,
            "writer": self.writer,
            "pickled": self.pickled,
            "tree": self.tree,
            "tensors": [t.to_json() for t in self.tensors],
            "storages": [s.to_json() for s in self.storages],
            "blobs": [b.to_json() for b in self.blobs],
            "extra": self.extra,
        }

    def dumps(self) -> bytes:
        # allow_nan=False: non-finite floats are tagged in the tree, never bare NaN tokens.
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def loads(cls, data: bytes, *, where: str = "") -> Manifest:
        """Parse a manifest; CorruptData / VersionError with ``where`` in the message."""
        suffix = f" at {where}" if where else ""
        d, version = parse_header(
            data,
            where=where,
            format_name=FORMAT_NAME,
            max_version=FORMAT_VERSION,
            kind="valid checkpoint",
        )
        try:
            m = cls(
                generation=str(d["generation"]),
                tree=d["tree"],
                tensors=tuple(TensorEntry.from_json(t) for t in field_list(d, "tensors")),
                storages=tuple(StorageEntry.from_json(s) for s in field_list(d, "storages")),
                blobs=tuple(BlobEntry.from_json(b) for b in field_list(d, "blobs")),
                created=field_number(d, "created", 0.0),
                writer=str(d.get("writer", "")),
                pickled=bool(d.get("pickled", False)),
                version=version,
                extra=dict(d.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptData(
                f"not a valid checkpoint{suffix}: manifest is malformed ({describe_error(e)})",
                key=MANIFEST_KEY,
            ) from None
        m.validate(where)
        return m

    def validate(self, where: str = "") -> None:
        """Cross-check indices, sizes and views so a reader never indexes out of range nor
        allocates more than the blobs can hold (O(tensors + chunks), no data read)."""
        suffix = f" at {where}" if where else ""

        def bad(why: str) -> CorruptData:
            return CorruptData(f"not a valid checkpoint{suffix}: {why}", key=MANIFEST_KEY)

        for i, b in enumerate(self.blobs):
            if b.size < 0:
                raise bad(f"blobs[{i}] ({b.name!r}) has negative size {b.size}")
        for si, s in enumerate(self.storages):
            why, pos = chunk_run_problem(s.chunks, self.blobs)
            if why:
                raise bad(f"storages[{si}].{why}")
            for ci, c in enumerate(s.chunks):
                if c.group < 1:
                    raise bad(f"storages[{si}].chunks[{ci}].group {c.group} is not positive")
            if pos != s.nbytes:
                raise bad(f"storages[{si}].nbytes {s.nbytes} != {pos} bytes of its chunks")
        for t in self.tensors:
            if not 0 <= t.storage < len(self.storages):
                raise bad(f"tensor {t.name!r}: storage {t.storage} is not a storage index")
            try:
                itemsize = dtype_itemsize(t.dtype)
            except KeyError:
                raise bad(f"tensor {t.name!r}: unknown dtype {t.dtype!r}") from None
            why = view_problem(
                t.shape, t.stride, t.offset, itemsize, self.storages[t.storage].nbytes
            )
            if why:
                raise bad(f"tensor {t.name!r} does not fit its storage: {why}")
        why = tree_problem(self.tree, len(self.tensors))
        if why:
            raise bad(f"tree: {why}")


# JSON field readers for manifests: a value of the wrong type is a ValueError naming the
# field (Manifest.loads turns it into CorruptData), never a silent int("12") or int(1.5).


def field_int(d: dict[str, Any], key: str, default: int | None = None) -> int:
    v = d.get(key, default) if default is not None else d[key]
    if not is_int(v):
        raise ValueError(f"field {key!r} is {short_repr(v)}, not an int")
    return v


def field_number(d: dict[str, Any], key: str, default: float | None = None) -> float:
    """``d[key]`` (absent: ``default``; without one, a ``KeyError``), a JSON number, as a
    float: never ``float()`` of a string, whose error quotes all of it."""
    v = d.get(key, default) if default is not None else d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"field {key!r} is {short_repr(v)}, not a number")
    return float(v)


def field_str(d: dict[str, Any], key: str) -> str:
    v = d[key]
    if not isinstance(v, str):
        raise ValueError(f"field {key!r} is {short_repr(v)}, not a string")
    return v


def field_list(d: dict[str, Any], key: str) -> list[Any]:
    v = d[key]
    if not isinstance(v, list):
        raise ValueError(f"field {key!r} is not a list")
    return v


def field_ints(d: dict[str, Any], key: str) -> tuple[int, ...]:
    """``d[key]``, a list of JSON integers, as a tuple; ValueError naming the field otherwise."""
    v = field_list(d, key)
    if not all(type(x) is int for x in v):
        raise ValueError(f"field {key!r} is {short_repr(v)}, not a list of ints")
    return tuple(v)


def parse_header(
    data: bytes, *, where: str, format_name: str, max_version: int, kind: str
) -> tuple[dict[str, Any], int]:
    """Parse a manifest's JSON and check its format name and version, for every manifest
    kind: ``CorruptData`` ("not a KIND") or ``VersionError`` past ``max_version``."""
    suffix = f" at {where}" if where else ""
    try:
        d = decode_json(data)
    except ValueError as e:  # decode_json's own: short, never quoting the input
        raise CorruptData(f"not a valid checkpoint{suffix}: manifest is not JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != format_name:
        fmt = d.get("format") if isinstance(d, dict) else None
        raise CorruptData(
            f"not a {kind}{suffix}: manifest format is {fmt!r}, expected {format_name!r}"
        )
    version = d.get("version")
    if not isinstance(version, int) or version < 1:
        raise CorruptData(f"not a valid checkpoint{suffix}: bad format version {version!r}")
    if version > max_version:
        raise VersionError(
            f"checkpoint{suffix} has {format_name} version {version}, newer than the "
            f"{max_version} this fmstore reads; upgrade fmstore to load it"
        )
    return d, version


def sniff_format(data: bytes) -> str | None:
    """The ``format`` field of a manifest's bytes, or None when it is not a JSON object."""
    try:
        d = decode_json(data)
    except ValueError:
        return None
    return d.get("format") if isinstance(d, dict) else None
