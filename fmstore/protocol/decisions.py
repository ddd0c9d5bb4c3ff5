"""The decisions of the tiering protocol, as pure functions of facts their callers read.

No I/O and no torch here: a caller reads a manifest, a listing, part records or leases
from a store, passes what it read (and its clock) in, and acts on the answer.  Each
decision is stated once, so that the code which commits, supersedes, releases or counts a
step cannot disagree with itself, and each can be tested without a store.  The invariants
these decisions keep are in ``docs/distributed.md`` ("Invariants").

* :func:`manifest_facts` and :func:`step_committed`: is a step committed on a tier (its
  manifest parses as fmstore's, names a generation, blobs with sizes, was not created in
  the future, and its blobs are there with those sizes);
* :func:`record_holds`: does a part record vouch for a part (by its content, never by
  who wrote it);
* :func:`lease_alive`, :func:`may_remove_part`, :func:`commit_holds`: may a node take its
  part out of an uncommitted export, and may a committer write the manifest;
* :func:`replica_export_due`: does the holder of a lost node's replica export its part.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config import is_node_id
from ..errors import CorruptData, describe_error, short_repr
from ..format.manifest import (
    DCP_FORMAT_NAME,
    DCP_FORMAT_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    field_int,
    field_ints,
    field_list,
    field_str,
    parse_header,
    sniff_format,
)

__all__ = [
    "BlobFact",
    "ManifestFacts",
    "Problem",
    "commit_holds",
    "lease_alive",
    "manifest_facts",
    "may_remove_part",
    "record_holds",
    "replica_export_due",
    "step_committed",
]

#: The newest version of each manifest format this fmstore reads.
#: The retired record of a generation (written by a restore that passed its step over).
RETIRED_NAME = "retired.json"
_MAX_VERSION = {FORMAT_NAME: FORMAT_VERSION, DCP_FORMAT_NAME: DCP_FORMAT_VERSION}


class Problem(enum.Enum):
    """Why a step is not counted as committed on a tier (a code, never a message)."""

    CREATED_IN_FUTURE = "created_in_future"
    NO_PART_HERE = "no_part_here"
    BLOB_MISSING = "blob_missing"
    BLOB_SIZE = "blob_size"
    RETIRED = "retired"


@dataclass(frozen=True)
class BlobFact:
    name: str
    size: int
    rank: int | None = None  # a DCP blob's writing rank


@dataclass(frozen=True)
class ManifestFacts:
    """What counting a step needs of its manifest, validated (:func:`manifest_facts`)."""

    format: str
    version: int
    generation: str
    created: float
    blobs: tuple[BlobFact, ...]
    parts: tuple[tuple[str, tuple[int, ...]], ...]  # (node, ranks) of a checkpoint in parts
    crc32c: int
    writer: str = ""  # "fmstore 0.4 on n1": what wrote it, and on which node

    @property
    def written_by(self) -> str | None:
        """The node whose clock set ``created``: the one its ``writer`` names (``… on
        NODE``), else the node of rank 0 (a sharded save's coordinator) of a checkpoint in
        parts; None where the manifest does not say."""
        _, on, node = self.writer.rpartition(" on ")
        if on and is_node_id(node):
            return node
        return next((n for n, ranks in self.parts if 0 in ranks), None)

    @property
    def stored_bytes(self) -> int:
        return sum(b.size for b in self.blobs)

    def blobs_of(self, node: str | None) -> tuple[BlobFact, ...] | None:
        """The blobs a copy holds: node ``node``'s part of a checkpoint in node parts on a
        node-local tier (None: that node holds no part), every blob otherwise."""
        if node is None or not self.parts:
            return self.blobs
        ranks = next((set(r) for n, r in self.parts if n == node), None)
        if ranks is None:
            return None
        return tuple(b for b in self.blobs if b.rank in ranks)


def _name(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v or "/" in v or "\\" in v or v.startswith("."):
        raise ValueError(f"{what} {short_repr(v)} is not a plain name")
    return v


def manifest_facts(data: bytes, *, crc32c: int, where: str) -> ManifestFacts:
    """The facts of the manifest ``data`` (whose CRC32C is ``crc32c``): its format is one of
    fmstore's and a version this fmstore reads, it names a generation and blobs with sizes,
    and its creation time is a finite number.  ``CorruptData`` (``VersionError``) naming
    ``where`` otherwise; nothing else is read or trusted."""
    fmt = sniff_format(data)
    max_version = _MAX_VERSION.get(fmt or "")
    if fmt is None or max_version is None:
        raise CorruptData(f"not a checkpoint manifest at {where} (format {short_repr(fmt)})")
    d, version = parse_header(
        data, where=where, format_name=fmt, max_version=max_version, kind="checkpoint manifest"
    )
    try:
        gen = _name(d.get("generation"), "generation")
        created = d.get("created", 0.0)
        if isinstance(created, bool) or not isinstance(created, int | float):
            raise ValueError(f"created {short_repr(created)} is not a number")
        if not math.isfinite(created) or created < 0:
            raise ValueError(f"created {created!r} is not a time")
        blobs = []
        for b in field_list(d, "blobs"):
            if not isinstance(b, dict):
                raise ValueError("a blob entry is not an object")
            size = field_int(b, "size")
            if size < 0:
                raise ValueError(f"blob size {size} is negative")
            rank = field_int(b, "rank") if fmt == DCP_FORMAT_NAME and "rank" in b else None
            blobs.append(BlobFact(_name(field_str(b, "name"), "blob name"), size, rank))
        parts = []
        for p in d.get("parts") or []:
            if not isinstance(p, dict):
                raise ValueError("a part entry is not an object")
            parts.append((field_str(p, "node"), field_ints(p, "ranks")))
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptData(
            f"checkpoint manifest at {where} is malformed ({describe_error(e)})"
        ) from None
    writer = d.get("writer")
    return ManifestFacts(
        fmt,
        version,
        gen,
        float(created),
        tuple(blobs),
        tuple(parts),
        crc32c,
        writer[:300] if isinstance(writer, str) else "",
    )


def step_committed(
    facts: ManifestFacts,
    *,
    sizes: Mapping[str, int] | None,
    node: str | None,
    now: float,
    skew: float,
) -> Problem | None:
    """None when a copy whose manifest has ``facts`` counts as committed; else why not.

    ``sizes``: the listing of the copy's generation (blob name -> size); None when this
    very manifest (same checksum) was validated on this tier before, so that a rescan
    lists nothing.  ``node``: this node on a node-local tier (only its part is there),
    None on a shared one.  ``now``: this node's clock; ``skew``: how far clocks may be
    apart (a manifest created later than ``now + skew`` was not written by a save)."""
    if facts.created > now + skew:
        return Problem.CREATED_IN_FUTURE
    blobs = facts.blobs_of(node)
    if blobs is None:
        return Problem.NO_PART_HERE
    if sizes is None:
        return None
    if RETIRED_NAME in sizes:
        # Retired by a restore that passed the step over (docs/distributed.md, I6): a
        # committer that died between its manifest write and its second look at the fence
        # left a manifest naming a generation that must never count.
        return Problem.RETIRED
    for b in blobs:
        got = sizes.get(b.name)
        if got is None:
            return Problem.BLOB_MISSING
        if got != b.size:
            return Problem.BLOB_SIZE
    return None


def record_holds(
    record_blobs: Iterable[tuple[str, int, int | None]],
    part_blobs: Iterable[tuple[str, int, int | None]],
    sizes: Mapping[str, int],
) -> bool:
    """Whether a part record vouches for a part: it lists exactly the part's blobs (names,
    sizes and CRC32Cs as the manifest implies them, ``part_blobs``) and each is there
    (``sizes``, a listing of the generation) with its size.  Who wrote the record does not
    count: a record with no blobs, or another part's, vouches for nothing."""
    want = sorted(part_blobs)
    if sorted(record_blobs) != want or not want:
        return False
    return all(sizes.get(name) == size for name, size, _ in want)


def lease_alive(renewed: float, *, now: float, ttl: float, skew: float) -> bool:
    """Whether a lease last renewed at ``renewed`` (its writer's clock) may still be held,
    seen from a clock reading ``now`` that may be ``skew`` ahead of or behind the writer's.
    A renewal further in the future than that (``Infinity``, ``1e300``) or ``NaN`` is no
    renewal: such a lease is dead, never immortal."""
    return abs(now - renewed) < ttl + skew


def may_remove_part(
    node: str,
    leases: Mapping[str, float],
    *,
    committed: bool,
    now: float,
    ttl: float,
    skew: float,
) -> bool:
    """Whether node ``node``, having removed its part record of an uncommitted export, may
    delete its part's blobs: no manifest is there (``committed`` False, looked at after
    the leases were read) and no other node holds a lease (``leases``: node -> renewal,
    read after the record was removed) that may still be alive.  Else it puts its record
    back and leaves the part to the sweep (see "Supersede and commit" in
    ``docs/distributed.md`` for why this order is safe under any interleaving)."""
    if committed:
        return False
    return not any(
        lease_alive(r, now=now, ttl=ttl, skew=skew) for n, r in leases.items() if n != node
    )


def commit_holds(renewed: float, *, now: float, ttl: float, skew: float) -> bool:
    """Whether a committer whose lease was renewed at ``renewed`` (before it listed the
    part records) may still write the manifest at ``now`` (its clock): its lease must look
    alive to every node, whose clocks may be ``skew`` ahead, for the whole write, for which
    half the lifetime is set aside."""
    return now + ttl / 2 < renewed + ttl - skew


def replica_export_due(
    node: str,
    records: Mapping[str, float],
    leases: Mapping[str, float],
    *,
    committed: bool,
    now: float,
    after: float,
    ttl: float,
    skew: float,
) -> bool:
    """Whether the node holding node ``node``'s replica exports that part in its place: the
    step is not committed on the destination, ``node``'s part record is not there
    (``records``: node -> when each part record there was written), another node's part
    has waited for it at least ``after`` seconds, and ``node`` holds no live export lease
    (``leases``: node -> last renewal).  Two exporters of one part (``node`` came back) are
    safe: a part record is trusted by its content, not by who wrote it."""
    if committed or node in records:
        return False
    others = [w for n, w in records.items() if n != node]
    if not others or now - min(others) < after:
        return False
    renewed = leases.get(node)
    return renewed is None or not lease_alive(renewed, now=now, ttl=ttl, skew=skew)
