"""A restore's reads of blobs held on another node: streamed over the checkpoint group.

When a relaunch puts ranks on other nodes than the save (see :mod:`fmstore.protocol.routing`),
a rank's load plan may read items whose blobs are in another node's part or replica.
:func:`exchange`, called by every rank from :meth:`Reader.read_data` (a collective on the
checkpoint group): every rank says which chunks it needs from which rank, then the pairs
take turns in one order every rank computes alike: the holder reads one chunk and sends it,
the rank that needs it receives it into memory, checks its CRC32C and decodes it into the
destination tensor.  Nothing is written to the receiving node's disk.  A chunk its holder
could not read is announced as such (the pair stays in step) and fails the receiving
rank's read, so every rank passes the candidate over together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ... import runtime
from ...errors import CorruptData, FmstoreError
from ...format.checksum import crc32c
from ...format.manifest import ChunkEntry
from ...protocol.routing import REPLICA, Routes
from ...protocol.wire import gather_json
from ...stores import Store
from .manifest import DcpItem, DcpManifest
from .replicas import open_replicas

if TYPE_CHECKING:
    from .reader import Reader, _Target

__all__ = ["Part", "Peers", "exchange", "read_routed"]


@dataclass(frozen=True)
class Part:
    """A chunk's contribution to one read target: raw bytes [a, b) of the item."""

    target: int
    a: int
    b: int


#: the most chunks one rank may ask of the others in one load (a peer's list is bounded)
MAX_REQUESTS = 1 << 22


@dataclass(frozen=True)
class Peers:
    """How a load reads across nodes: the checkpoint group, this rank, the routes, the URI
    of this node's replicas of the checkpoint, and its manifest (agreed on by every rank:
    a node that lost its part reads it from no disk of its own)."""

    pg: Any
    rank: int
    routes: Routes
    replica_uri: str
    manifest: DcpManifest

    def source(self, saved: int) -> tuple[int, str]:
        return self.routes.source[(self.rank, saved)]


def read_routed(reader: Reader, make: Callable[[], list[_Target]]) -> list[_Target]:
    """Every rank, a load some of whose blobs are elsewhere: ``make`` the read targets,
    read those of this node's part, then :func:`exchange` the others (every rank takes part
    even when its own plan or read failed; the first error is raised after)."""
    err: BaseException | None = None
    targets: list[_Target] = []
    try:
        targets = make()
        local = [t for t in targets if not t.routed]
        if local:  # a node that lost its part has no directory to open
            runtime.run(reader._read(local))
    except BaseException as e:
        err = e
    try:
        exchange(reader, [t for t in targets if t.routed] if err is None else [], err is not None)
    except BaseException as e:
        err = err or e
    if err is not None:
        raise err
    return targets


def exchange(reader: Reader, targets: Sequence[_Target], failed: bool) -> None:
    """Every rank: fill ``targets`` (items whose blobs this rank does not read from its own
    node's part) from their holders, and serve what the others ask of this rank.
    ``failed``: this rank's own read failed already (it still serves and takes part)."""
    import torch
    import torch.distributed as dist

    peers = reader.peers
    m = reader.manifest
    assert peers is not None and m is not None
    needs: dict[tuple[int, int], list[Part]] = {}
    chunk_of: dict[tuple[int, int], tuple[ChunkEntry, DcpItem]] = {}
    for ti, t in enumerate(targets):
        for c in t.item.chunks:
            a, b = max(t.lo, c.raw_offset), min(t.hi, c.raw_offset + c.raw)
            if a < b:
                needs.setdefault((c.blob, c.offset), []).append(Part(ti, a, b))
                chunk_of[(c.blob, c.offset)] = (c, t.item)
    asks = [(peers.source(m.blobs[b].rank)[0], b, o, chunk_of[(b, o)][0].length) for b, o in needs]
    # JSON, not pickles (docs/security.md); each peer's list is checked below
    sent = gather_json(peers.pg, [failed, sorted(asks)])
    everyone: list[tuple[Any, list[Any]]] = [
        (g[0], g[1]) if isinstance(g, list) and len(g) == 2 else (True, []) for g in sent
    ]
    stores: dict[str, Store] = {}
    errors: list[str] = []

    def store(kind: str) -> Store:
        if kind not in stores:
            stores[kind] = (
                open_replicas(peers.replica_uri, reader.store_options)
                if kind == REPLICA
                else reader.store
            )
        return stores[kind]

    def read(who: int, blob: int, off: int, n: int) -> bytes | None:
        """Chunk bytes this rank holds for rank ``who``, None if it may not or cannot."""
        try:
            if not 0 <= blob < len(m.blobs) or off < 0 or n < 0 or off + n > m.blobs[blob].size:
                raise CorruptData(f"rank {who} asked for bytes outside blob {blob}")
            h, kind = peers.routes.source[(who, m.blobs[blob].rank)]
            if h != peers.rank:
                raise FmstoreError(
                    f"rank {who} asked rank {peers.rank} for a blob it is not routed"
                )
            data = runtime.run(store(kind).get_range(m.blob_key(blob), off, off + n))
            if len(data) != n:
                raise CorruptData(f"{len(data)} bytes at {off}, not {n}")
            return data
        except Exception as e:
            errors.append(f"rank {peers.rank} could not read blob {blob} for rank {who}: {e}")
            return None

    def take(blob: int, off: int, data: bytes | memoryview, frm: int) -> None:
        c, item = chunk_of[(blob, off)]
        key = m.blob_key(blob)
        if crc32c(data) != c.crc32c:
            raise CorruptData(
                f"chunk of {item.fqn!r} at bytes {off}..{off + c.length} of {key}, sent by "
                f"rank {frm}: fails its CRC32C on arrival",
                key=key,
            )
        reader._deliver(list(targets), needs[(blob, off)], c, item, memoryview(data), key)

    # Decided alike on every rank from what every rank sent: all go on, or none does.
    bad = [r for r, (f, a) in enumerate(everyone) if f or not _well_formed(a, len(everyone))]
    if bad:
        if not failed:
            raise FmstoreError(f"ranks {bad} failed their reads: no blob is exchanged")
        return
    for who, (_f, asked) in enumerate(everyone):
        for h, blob, off, n in asked:
            if h == who == peers.rank:  # on this node: its replicas (or another part copy)
                data = read(who, blob, off, n)
                if data is not None and not errors:
                    try:
                        take(blob, off, data, who)
                    except Exception as e:
                        errors.append(str(e))
            elif h == peers.rank:
                data = read(who, blob, off, n)
                dist.send(torch.tensor([0 if data is None else 1]), group=peers.pg, group_dst=who)
                if data is not None and n:
                    dist.send(_as_tensor(data), group=peers.pg, group_dst=who)
            elif who == peers.rank:
                ok = torch.zeros(1, dtype=torch.int64)
                dist.recv(ok, group=peers.pg, group_src=h)
                if not int(ok[0]):
                    errors.append(f"rank {h} could not read blob {blob} for rank {who}")
                    continue
                buf = torch.empty(n, dtype=torch.uint8)
                if n:
                    dist.recv(buf, group=peers.pg, group_src=h)
                if not errors:
                    arr: Any = buf.numpy()
                    try:
                        take(blob, off, memoryview(arr), h)
                    except Exception as e:
                        errors.append(str(e))
    if errors:
        raise FmstoreError("; ".join(errors)[:600])


def _well_formed(asked: Any, world: int) -> bool:
    """A peer's requests: a bounded list of (holder rank, blob, offset, length) integers."""
    return (
        isinstance(asked, list)
        and len(asked) <= MAX_REQUESTS
        and all(
            isinstance(a, list)
            and len(a) == 4
            and all(type(x) is int for x in a)
            and 0 <= a[0] < world
            and a[3] >= 0
            for a in asked
        )
    )


def _as_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
