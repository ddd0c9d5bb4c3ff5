"""Records of the exports of a checkpoint in node parts onto a shared tier.

A sharded checkpoint of a job of several nodes lives on node-local tiers in one part per
node (``docs/distributed.md``).  Each node exports its own part to a shared tier (Lustre,
S3); the copy there becomes a checkpoint only when every node's part is there.  Two small
objects per node, in the checkpoint's generation on the shared tier, carry that protocol
through the destination store itself (no node talks to another):

``GEN/part-NODE.json`` (a *part record*)
    written by node ``NODE`` after every blob of its part is copied and verified there:
    its ranks, its blobs (name, size, CRC32C) and the SHA-256 of the global manifest it
    belongs to.  Whoever finds a part record for every part of the manifest writes the
    manifest (create-only, the save's exact bytes): the commit.
``GEN/export-NODE.json`` (an *export lease*)
    written when node ``NODE``'s exporter starts an attempt, renewed while it copies, and
    removed after the commit: while it is younger than the lease lifetime
    (:attr:`~fmstore.protocol.env.Env.lease_ttl`, ``[protocol] lease_ttl``), no sweep and no
    ``gc`` on any node removes anything of that generation, whatever the grace period.
``GEN/retired.json`` (a *retired record*)
    written by a restore that fell back from the step this generation saved (the step is
    abandoned and will be redone under a new generation): no commit of ``GEN`` stands once
    it is there (:mod:`fmstore.tiering.exports.retire`).  Whatever it holds, its name retires.

Both are kept out of the blob names (``BLOB_RE``) so that no reader takes them for data.
This module is torch-free: the orphan sweep (:mod:`.gc`) reads these records too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from ..config import NODE, is_node_id
from ..errors import CorruptData, describe_error, short_repr
from ..format.manifest import (
    field_int,
    field_ints,
    field_list,
    field_number,
    field_str,
    parse_header,
)
from .env import Env

__all__ = [
    "LEASE_RE",
    "NODE",
    "PART_RECORD_RE",
    "RETIRED_NAME",
    "ExportLease",
    "RetiredRecord",
    "field_node",
    "is_node_id",
    "PartRecord",
    "lease_key",
    "manifest_sha256",
    "part_record_key",
    "retired_key",
    "writer_node",
]

PART_FORMAT_NAME = "fmstore-dcp-part"
LEASE_FORMAT_NAME = "fmstore-export-lease"
RETIRED_FORMAT_NAME = "fmstore-dcp-retired"
#: The retired record of a generation (``GEN/retired.json``).
from .decisions import RETIRED_NAME  # noqa: E402  (the decision reads it)

#: A node's id: 1-200 ASCII letters, digits and ``._:@+-``, starting with a letter or a
#: digit (so never ``.``, ``..`` nor a line break).  The one grammar, checked wherever a
#: node id is read: the environment, part and rank records, leases, manifests, peers.
PART_RECORD_RE = re.compile(rf"part-({NODE})\.json", re.ASCII)
LEASE_RE = re.compile(rf"export-({NODE})\.json", re.ASCII)


def field_node(d: dict[str, Any], key: str) -> str:
    """``d[key]``, a node id; ValueError naming the field otherwise."""
    v = d[key]
    if not is_node_id(v):
        raise ValueError(f"field {key!r} is {short_repr(v)}, not a node id")
    return str(v)


#: Largest process id a lease may name (Linux's pid_max is at most 2**22).
MAX_PID = 2**31 - 1


def part_record_key(generation: str, node: str) -> str:
    return f"{generation}/part-{node}.json"


def lease_key(generation: str, node: str) -> str:
    return f"{generation}/export-{node}.json"


def retired_key(generation: str) -> str:
    return f"{generation}/{RETIRED_NAME}"


def manifest_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class PartRecord:
    """Node ``node``'s part of the checkpoint whose manifest hashes to ``manifest_sha256``,
    complete and verified on the tier it lies on."""

    node: str
    ranks: tuple[int, ...]
    generation: str
    manifest_sha256: str
    blobs: tuple[tuple[str, int, int | None], ...]  # (name, size, crc32c)
    written: float = 0.0

    @property
    def size(self) -> int:
        return sum(s for _, s, _ in self.blobs)

    def dumps(self) -> bytes:
        d: dict[str, Any] = {
            "format": PART_FORMAT_NAME,
            "version": 1,
            "node": self.node,
            "ranks": list(self.ranks),
            "generation": self.generation,
            "manifest_sha256": self.manifest_sha256,
            "written": self.written or time.time(),
            "blobs": [{"name": n, "size": s, "crc32c": c} for n, s, c in self.blobs],
        }
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, data: bytes, *, where: str) -> PartRecord:
        d, _v = parse_header(
            data, where=where, format_name=PART_FORMAT_NAME, max_version=1, kind="part record"
        )
        try:
            return cls(
                node=field_node(d, "node"),
                ranks=field_ints(d, "ranks"),
                generation=field_str(d, "generation"),
                manifest_sha256=field_str(d, "manifest_sha256"),
                blobs=tuple(
                    (
                        field_str(b, "name"),
                        field_int(b, "size"),
                        None if b.get("crc32c") is None else field_int(b, "crc32c"),
                    )
                    for b in field_list(d, "blobs")
                ),
                written=field_number(d, "written", 0.0),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptData(
                f"part record at {where} is malformed ({describe_error(e)})"
            ) from None


@dataclass(frozen=True)
class ExportLease:
    """Node ``node``'s exporter (process ``pid``) of a generation was alive at ``renewed``
    (its clock)."""

    node: str
    pid: int
    renewed: float

    def dumps(self) -> bytes:
        d = {
            "format": LEASE_FORMAT_NAME,
            "version": 1,
            "node": self.node,
            "pid": self.pid,
            "renewed": self.renewed,
        }
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, data: bytes, *, where: str) -> ExportLease:
        d, _v = parse_header(
            data, where=where, format_name=LEASE_FORMAT_NAME, max_version=1, kind="export lease"
        )
        try:
            lease = cls(field_node(d, "node"), field_int(d, "pid"), field_number(d, "renewed"))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptData(
                f"export lease at {where} is malformed ({describe_error(e)})"
            ) from None
        if not 0 < lease.pid <= MAX_PID:
            raise CorruptData(f"export lease at {where} names pid {lease.pid}, not a process id")
        return lease

    def alive(self, env: Env, now: float | None = None) -> bool:
        """Whether this lease may still be held, as ``env`` (this node's clock, lifetime and
        allowed skew) sees it at ``now`` (its clock when not given): the one lease rule,
        :func:`fmstore.protocol.decisions.lease_alive` (a renewal further in the future than
        the skew, ``Infinity``, ``1e300`` or ``NaN``, is no renewal: such a lease is dead
        rather than immortal).  A lease of this very node whose process is gone is dead at
        once."""
        if not env.lease_alive(self.renewed, now):
            return False
        # The pid shortcut only ever makes a lease dead sooner, and only when its holder is
        # provably gone: a lease of this node (its id, as env names it) whose process no
        # longer exists.  That process renews nothing and writes nothing more (its manifest
        # write, the one write the lease guards, is made by that process itself), so no
        # commit it makes can land after a removal that trusts it dead.  A pid reused by
        # another process keeps the lease alive (the TTL still ends it): the safe side.
        if self.node == env.here() and self.pid != env.process():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except OSError:
                pass
        return True


@dataclass(frozen=True)
class RetiredRecord:
    """Generation ``generation`` of a step was abandoned by a restore on node ``node`` that
    fell back from that step (at ``written``, its clock)."""

    generation: str
    node: str
    written: float = 0.0

    def dumps(self) -> bytes:
        d = {
            "format": RETIRED_FORMAT_NAME,
            "version": 1,
            "generation": self.generation,
            "node": self.node,
            "written": self.written or time.time(),
        }
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, data: bytes, *, where: str) -> RetiredRecord:
        d, _v = parse_header(
            data, where=where, format_name=RETIRED_FORMAT_NAME, max_version=1, kind="retired record"
        )
        try:
            return cls(
                field_str(d, "generation"), field_node(d, "node"), field_number(d, "written", 0.0)
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptData(
                f"retired record at {where} is malformed ({describe_error(e)})"
            ) from None


#: How a manifest's ``writer`` names the node that wrote it (its clock set ``created``).
WRITER_ON = " on "


def writer_node(env: Env | None = None) -> str:
    """`` on NODE`` for a manifest's ``writer`` (this node's id as ``env`` names it; this
    process's node without one), or ``""`` where the host name is no node id: an operator
    seeing a manifest created in the future learns whose clock set it."""
    here = (env or Env()).here()
    return f"{WRITER_ON}{here}" if is_node_id(here) else ""
