"""Replicas of each node's part of a checkpoint on other nodes' node-local tiers.

With ``[tiers.X] replicas = k`` on a node-local tier (``scope = "node"``), every rank of a
job that spans several nodes sends the blobs of its part to its ``k`` *holders* (ranks on
other nodes, placed over failure domains by :mod:`.placement`), over the checkpoint group
(gloo, never the training group), once the save is committed and its manifest is on every
node.  Each holder checks every chunk's CRC32C against the manifest on arrival and writes
the bytes under ``.replicas/KEY/`` of its own tier (``KEY`` the checkpoint's key): blobs,
then the sender's rank record, then (every part it holds written) the placement and the
manifest.  Removing or releasing the checkpoint's own part (``KEY/``) never touches that
prefix, and the orphan sweep keeps it (its manifest names its generation).  A node keeps
the replicas of the newest step of each run it received: the next step's replica, once
every rank's is written, removes older ones.

A restore that finds nodes without their part (replaced, NVMe wiped) fetches each such
part from a surviving holder (the first in the save's preference order): the holder reads
it and sends it over the checkpoint group, the replaced node's ranks check every chunk's
CRC32C on arrival and write the part back where it belongs; any failure on any rank makes
every rank pass the candidate over together (to a shared tier, or an older step).  See
``docs/distributed.md``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ... import runtime
from ...errors import AlreadyExists, ConfigError, CorruptData, FmstoreError
from ...format.checksum import crc32c
from ...protocol.placement import MAX_REPLICAS, capped, domains_of, holders
from ...protocol.problems import Code, code_of
from ...protocol.wire import gather_json
from ...stores import Location, PutOptions, Store, beneath, open_store, split_tier
from ...stores.bounded import RECORD_LIMIT, decode_json, manifest_limit, read_bounded
from ..commit import commit_manifest, read_bounded_manifest
from ..layout import RANK_RECORD_RE, REPLICA_PREFIX, parse_step
from .manifest import MANIFEST_KEY, DcpManifest
from .nodes import RankRecord, rank_record_key

if TYPE_CHECKING:
    from .replica_stream import Received, Stream

__all__ = [
    "PLACEMENT_KEY",
    "REPLICA_PREFIX",
    "fetch",
    "holders_of",
    "open_replicas",
    "placement_of",
    "plan",
    "replica_uri",
    "replicas_of",
    "replicate",
    "sources",
]

#: beside a replica's manifest: the save's placement (rank -> its holders, in order)
PLACEMENT_KEY = "placement.json"

log = logging.getLogger("fmstore.checkpoint")


def replicas_of(uri: str, config: Any = None) -> int:
    """The configured ``replicas`` of ``uri``'s tier in ``config`` (default the process's;
    0 outside the configured tiers)."""
    return _setting(uri, config)[0]


def _setting(uri: str, config: Any = None) -> tuple[int, str | None]:
    """``uri``'s tier's ``replicas`` and this node's failure domain for it."""
    from ...config import failure_domain, get_config

    cfg = config if config is not None else get_config()
    name, _rest = split_tier(uri, cfg)
    if name is None:
        return 0, None
    t = cfg.tier(name)
    return (t.replicas, failure_domain(t)) if t.scope == "node" else (0, None)


def replica_uri(uri: str, config: Any = None) -> str:
    """``nvme:run/step_X`` -> ``nvme:.replicas/run/step_X``."""
    name, rest = split_tier(uri, config)
    if name is None:
        raise FmstoreError(f"replicas need a configured tier, not {uri!r}")
    return f"{name}:{REPLICA_PREFIX}/{rest.strip('/')}"


def open_replicas(where: str, so: dict[str, Any], *, create: bool = False) -> Store:
    """The store at ``where`` (a :func:`replica_uri`; any other URI is just opened), once
    its tier's ``.replicas`` directory, on a POSIX tier, is one the tier's users share
    safely (:func:`~fmstore.stores.beneath.shared_dir`: made by ``create`` with the tier
    root's owner; a link or someone else's raises
    :class:`~fmstore.errors.PermissionDenied`)."""
    cfg = so.get("config")
    store = open_store(where, **so)  # makes the tier's root where it is missing
    name, rest = split_tier(where, cfg)
    if name is None or not rest.strip("/").startswith(REPLICA_PREFIX + "/"):
        return store
    base = Location.parse(f"{name}:", cfg).local_root
    if base is not None:
        root = os.open(base, beneath.DIR_FLAGS)
        try:
            fd = beneath.shared_dir(root, REPLICA_PREFIX, tier=name, create=create)
            if fd is not None:
                os.close(fd)
        finally:
            os.close(root)
    return store


def placement_of(
    m: DcpManifest, k: int, domains: Mapping[str, str] | None = None
) -> dict[int, tuple[int, ...]] | None:
    """Rank -> the ranks holding its ``k`` replicas, in preference order, over the nodes of
    ``m``'s parts (:func:`.placement.holders`); None where there is no placement."""
    return holders([(p.node, sorted(p.ranks)) for p in m.parts], k, domains)


def holders_of(
    rank_nodes: Sequence[str], k: int, said: Sequence[object] | None = None
) -> dict[int, tuple[int, ...]] | None:
    """The placement of a save whose rank ``r`` runs on node ``rank_nodes[r]`` and says its
    node's failure domain is ``said[r]`` (None: it names none), known at planning, before
    any manifest exists: the same as :func:`placement_of` of its manifest with the domains
    :func:`_agree` checks after the commit.  Raises :class:`ValueError` where a node's ranks
    say different domains or something that is not one (:func:`.placement.domains_of`)."""
    nodes = [
        (n, [r for r, x in enumerate(rank_nodes) if x == n]) for n in dict.fromkeys(rank_nodes)
    ]
    domains = domains_of(nodes, said if said is not None else [None] * len(rank_nodes))
    return holders(nodes, k, domains if len(domains) == len(nodes) else None)


def sources_of(placement: dict[int, tuple[int, ...]], rank: int) -> tuple[int, ...]:
    """The ranks whose replica ``rank`` holds."""
    return tuple(r for r, hs in sorted(placement.items()) if rank in hs)


def _blobs_of(m: DcpManifest, rank: int) -> list[int]:
    return [i for i, b in enumerate(m.blobs) if b.rank == rank]


def check_blob(m: DcpManifest, blob: int, data: bytes, where: str) -> None:
    """Raise :class:`CorruptData` unless ``data`` is blob ``blob`` of ``m``: its size, and the
    CRC32C of every chunk the manifest puts in it."""
    b = m.blobs[blob]
    if len(data) != b.size:
        raise CorruptData(f"{where}: {len(data)} bytes, not {b.size}", key=m.blob_key(blob))
    for it in m.items:
        for c in it.chunks:
            if c.blob == blob and crc32c(data[c.offset : c.offset + c.length]) != c.crc32c:
                raise CorruptData(
                    f"{where}: chunk of {it.fqn!r} at offset {c.offset} fails its CRC32C",
                    key=m.blob_key(blob),
                )


def _tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _send(pg: Any, to: int, rec: bytes | None, blobs: list[bytes]) -> list[Any]:
    """Post the sends of one part (a header, the rank record, the blobs); ``rec`` None: the
    sender could not read it (the header says so and nothing follows)."""
    import torch
    import torch.distributed as dist

    head = torch.tensor([0 if rec is None else 1, len(rec or b"")], dtype=torch.int64)
    works = [dist.isend(head, group=pg, group_dst=to)]
    if rec is not None:
        for data in [rec, *blobs]:
            if data:
                works.append(dist.isend(_tensor(data), group=pg, group_dst=to))
    return works


def _recv(pg: Any, frm: int, sizes: list[int]) -> tuple[bytes, list[bytes]] | str:
    """The part ``frm`` sends (its rank record, then blobs of ``sizes``, the manifest's), or
    why not: it could not read it, or its header announces a record that cannot be one
    (nothing is allocated for a size over :data:`RECORD_LIMIT`)."""
    import torch
    import torch.distributed as dist

    head = torch.zeros(2, dtype=torch.int64)
    dist.recv(head, group=pg, group_src=frm)
    ok, rec_size = int(head[0]), int(head[1])
    if ok == 0:
        return "it could not read it"
    if ok != 1 or not 0 <= rec_size <= RECORD_LIMIT:
        return f"its header announces a rank record of {rec_size} bytes (at most {RECORD_LIMIT})"
    out: list[bytes] = []
    for n in [rec_size, *sizes]:
        t = torch.empty(n, dtype=torch.uint8)
        if n:
            dist.recv(t, group=pg, group_src=frm)
        out.append(t.numpy().tobytes())
    return out[0], out[1:]


async def _read(store: Store, m: DcpManifest, rank: int) -> tuple[bytes, list[bytes]]:
    rec = await read_bounded(
        store, rank_record_key(m.generation, rank), RECORD_LIMIT, what="rank record"
    )
    return rec, [await store.get(m.blob_key(i)) for i in _blobs_of(m, rank)]


async def _write(
    store: Store, m: DcpManifest, rank: int, rec: bytes, blobs: Sequence[bytes], where: str
) -> None:
    """Check then write ``rank``'s part (blobs, then its record) into ``store``."""
    ids = _blobs_of(m, rank)
    for i, data in zip(ids, blobs, strict=True):
        check_blob(m, i, data, f"{where}, rank {rank}'s blob {m.blobs[i].name}")
    r = RankRecord.loads(rec, where=f"{where}, rank {rank}'s record")
    if r.generation != m.generation or r.rank != rank:
        raise CorruptData(f"{where}: the record of rank {rank} is of another save")
    for i, data in zip(ids, blobs, strict=True):
        await store.put(m.blob_key(i), data, PutOptions(mode="overwrite"))
    await store.put(rank_record_key(m.generation, rank), rec, PutOptions(mode="overwrite"))


async def _put_manifest(store: Store, data: bytes) -> None:
    try:
        # same-or-fail: the same manifest is there once a partner has replicated already
        await commit_manifest(store, data, "same-or-fail")
    except AlreadyExists:
        # a replica of an earlier save to the same key: this save's replaces it
        await commit_manifest(store, data, "replace")


async def _put_placed(store: Store, hmap: dict[int, tuple[int, ...]], manifest: bytes) -> None:
    """The save's placement (:data:`PLACEMENT_KEY`), then its manifest: the replicas count."""
    placed = json.dumps({"holders": [[r, list(h)] for r, h in hmap.items()]}).encode()
    await store.put(PLACEMENT_KEY, placed, PutOptions(mode="overwrite"))
    await _put_manifest(store, manifest)


def _reason(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:300]


def _gather(pg: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON values: a setting, an error's text), never a pickle."""
    return gather_json(pg, obj)


def _agree(uri: str, m: DcpManifest, pg: Any, cfg: Any) -> tuple[int, dict[str, str] | None]:
    """Every rank's ``replicas`` setting and failure domain, gathered as JSON and checked:
    the ``k`` every node's config says (a :class:`ConfigError` where they differ) and each
    node's domain (None unless every node reports one)."""
    k = replicas_of(uri, cfg)
    try:
        domain = _setting(uri, cfg)[1]
    except ConfigError as e:  # every rank must answer: sent as a name that is not one
        log.warning("%s: %s", uri, e)
        domain = "?"
    sent = _gather(pg, [k, domain])
    if not all(
        isinstance(x, list)
        and len(x) == 2
        and type(x[0]) is int
        and (x[1] is None or isinstance(x[1], str))
        for x in sent
    ):
        raise CorruptData(f"{uri}: a rank sent a replicas setting that is not one")
    wanted = {x[0] for x in sent}
    if len(wanted) > 1:
        raise ConfigError(
            f"{uri} is committed, but its nodes disagree on [tiers] replicas "
            f"({sorted(wanted)}): no replica is made until every node's config says the same"
        )
    k = wanted.pop()
    if not k:
        return 0, None
    try:
        domains = domains_of([(p.node, p.ranks) for p in m.parts], [x[1] for x in sent])
    except ValueError as e:
        raise ConfigError(
            f"{uri} is committed, but {e} (one name per node, from $FMSTORE_FAILURE_DOMAIN "
            "or [tiers] failure_domain): no replica is made"
        ) from None
    if domains and len(domains) != len(m.parts):
        log.warning(
            "%s: only %d of %d nodes name their failure domain: replicas go around the "
            "ring of nodes",
            uri,
            len(domains),
            len(m.parts),
        )
    if k > capped(k, len(m.parts)) > 0:
        log.warning(
            "%s: replicas = %d, but a save of %d nodes places %d: each part on every other node",
            uri,
            k,
            len(m.parts),
            capped(k, len(m.parts)),
        )
    return k, (domains if len(domains) == len(m.parts) else None)


def replicate(
    uri: str,
    manifest: bytes,
    pg: Any,
    so: dict[str, Any] | None = None,
    inbox: Stream | None = None,
) -> None:
    """Every rank, after the commit of ``uri`` (``manifest``: its bytes): make this node's
    replicas of the parts it holds count, for the placement of :mod:`.placement`.
    ``inbox``: what this rank received while the save wrote (:mod:`.replica_stream`): each
    replica counts once its blob table equals the manifest's, then its record, the
    placement and the manifest are written.  Without one (a save in DCP's checkpoint
    process, which cannot reach the replica group), each rank reads its part back and
    sends it to each of its holders.  Raises on every rank when some replica could not be
    made (the checkpoint stays committed, older replicas stay)."""
    import torch.distributed as dist

    m = DcpManifest.loads(manifest, where=f"{uri}/{MANIFEST_KEY}")
    # Decided alike on every rank: nodes whose configs disagree would wait for each other.
    so = dict(so or {})
    cfg = so.get("config")
    k, domains = _agree(uri, m, pg, cfg)
    hmap = placement_of(m, k, domains) if k else None
    if hmap is None:
        return
    rank = dist.get_rank(pg)
    if inbox is not None:
        err = _count(m, manifest, inbox, hmap)
    else:
        err = _read_back(uri, m, manifest, pg, hmap, so)
    bad = [e for e in _gather(pg, err) if e]
    if bad:
        raise FmstoreError(
            f"{uri} is committed, but not every node's part has its replica ({'; '.join(bad)})"[
                :600
            ]
        )
    # Every replica of this step is written: each node drops its older ones of this run.
    part = next(p for p in m.parts if rank in p.ranks)
    if rank == min(part.ranks):
        try:
            runtime.run(_drop_older(uri, so))
        except Exception as e:  # kept a while longer; the next save retries
            log.warning("could not remove older replicas beside %s: %s", uri, e)


def table(m: DcpManifest, rank: int) -> dict[str, tuple[int, list[tuple[int, int, int]]]]:
    """``rank``'s blobs in ``m``: name -> size and its chunks' (offset, length, CRC32C)."""
    out: dict[str, tuple[int, list[tuple[int, int, int]]]] = {
        m.blobs[i].name: (m.blobs[i].size, []) for i in _blobs_of(m, rank)
    }
    names = [b.name for b in m.blobs]
    for it in m.items:
        for c in it.chunks:
            if m.blobs[c.blob].rank == rank:
                out[names[c.blob]][1].append((c.offset, c.length, c.crc32c))
    return {k: (n, sorted(cs)) for k, (n, cs) in out.items()}


def mismatch(m: DcpManifest, src: int, got: Received, where: str) -> str:
    """Why what a holder received of rank ``src``'s part is not its replica in ``m`` ('' if
    it is): the stream failed, a blob's size or a chunk's offset, length or CRC32C differs
    from the manifest's, or the rank record is not ``src``'s of this save."""
    if got.error:
        return got.error
    if {k: (n, sorted(cs)) for k, (n, cs) in got.blobs.items()} != table(m, src):
        return f"{where} of rank {src} differs from the manifest (blob sizes or chunks)"
    try:
        rec = RankRecord.loads(got.record or b"", where=f"{where}, rank {src}'s record")
    except CorruptData as e:
        return str(e)[:300]
    if rec.generation != m.generation or rec.rank != src:
        return f"{where}: the record of rank {src} is of another save"
    return ""


def _count(m: DcpManifest, manifest: bytes, inbox: Stream, hmap: dict[int, tuple[int, ...]]) -> str:
    """The replicas ``inbox`` received, counted against ``m`` and the placement ``hmap``
    the commit's check agreed on: '' or why not."""
    inbox.times["committed"] = time.perf_counter()
    try:
        got = inbox.wait_received()
        if inbox.send_error:
            return inbox.send_error
        if (inbox.holders, inbox.sources) != (hmap[inbox.rank], sources_of(hmap, inbox.rank)):
            return f"rank {inbox.rank}: the placement planned differs from the committed one"
        where = f"rank {inbox.rank}'s replica at {inbox.store.url}"
        for src, r in sorted(got.items()):
            if why := mismatch(m, src, r, where):
                inbox.discard(src)  # blobs the manifest does not name: not left to the sweep
                return why
            key = rank_record_key(m.generation, src)
            runtime.run(inbox.store.put(key, r.record or b"", PutOptions(mode="overwrite")))
        if got:
            runtime.run(_put_placed(inbox.store, hmap, manifest))
        inbox.times["counted"] = time.perf_counter()
    except Exception as e:
        return f"rank {inbox.rank} could not write its replicas: {_reason(e)}"
    return ""


def _read_back(
    uri: str,
    m: DcpManifest,
    manifest: bytes,
    pg: Any,
    pmap: dict[int, tuple[int, ...]],
    so: dict[str, Any],
) -> str:
    """Each rank's part read back from its tier and sent to its holders: '' or why not."""
    import torch.distributed as dist

    rank = dist.get_rank(pg)
    err = ""
    rec: bytes | None = None
    blobs: list[bytes] = []
    try:
        rec, blobs = runtime.run(_read(open_store(uri, **so), m, rank))
    except Exception as e:
        err = f"rank {rank} could not read its part: {_reason(e)}"
    works = [w for h in pmap[rank] for w in _send(pg, h, rec, blobs)]
    store: Store | None = None
    if sources_of(pmap, rank):
        try:  # every send to this rank is still received below: the ranks stay in step
            store = open_replicas(replica_uri(uri, so.get("config")), so, create=True)
        except Exception as e:
            err = err or f"rank {rank} cannot hold replicas: {_reason(e)}"
    for src in sources_of(pmap, rank):
        got = _recv(pg, src, [m.blobs[i].size for i in _blobs_of(m, src)])
        if isinstance(got, str):
            err = err or f"rank {src} could not send its part to rank {rank}: {got}"
            continue
        if store is None:
            continue
        try:
            runtime.run(_write(store, m, src, got[0], got[1], f"replica at {store.url}"))
        except Exception as e:
            err = err or f"rank {rank} could not write the replica of rank {src}: {_reason(e)}"
    for w in works:
        w.wait()
    if not err and store is not None:
        try:
            runtime.run(_put_placed(store, pmap, manifest))
        except Exception as e:
            err = f"rank {rank} could not write its replicas' manifest: {_reason(e)}"
    return err


async def _drop_older(uri: str, so: dict[str, Any]) -> None:
    name, rest = split_tier(uri, so.get("config"))
    root, _, last = rest.strip("/").rpartition("/")
    step = parse_step(last)
    if name is None or step is None:
        return
    where = f"{name}:{REPLICA_PREFIX}/{root}" if root else f"{name}:{REPLICA_PREFIX}"
    store = open_replicas(where, so)
    async for o in store.list("", recursive=False):
        s = parse_step(o.key.rstrip("/"))
        if o.is_dir and s is not None and s < step:
            keys = [x.key async for x in store.list(o.key, recursive=True) if not x.is_dir]
            # the manifest last: what is left of a half-removed replica stays kept
            keys.sort(key=lambda k: k.endswith(MANIFEST_KEY))
            await store.delete_many(keys)


async def held(uri: str, so: dict[str, Any]) -> tuple[str | None, tuple[int, ...]]:
    """The sha256 of the manifest of the replicas this node holds for ``uri`` and the ranks
    whose replica is complete (its record written after its blobs); (None, ()) if none (no
    manifest there, or a proven bad one: :func:`~.problems.code_of`).  A read that failed
    without a verdict raises: what this node holds is unknown (I3 of docs/distributed.md)."""
    try:
        store = open_replicas(replica_uri(uri, so.get("config")), so)
        data = await read_bounded_manifest(store)
        m = DcpManifest.loads(data, where=f"{store.url}/{MANIFEST_KEY}")
        # one listing, not a look-up per rank of a world_size the manifest declares
        found = [
            RANK_RECORD_RE.match(o.key.rsplit("/", 1)[-1])
            async for o in store.list(f"{m.generation}/", recursive=False)
        ]
        ranks = sorted({r for f in found if f and (r := int(f.group(1))) < m.world_size})
    except Exception as e:
        if code_of(e) not in (Code.NO_MANIFEST, Code.UNUSABLE):
            raise
        return None, ()  # none here, or not one: holds nothing a restore could use
    return hashlib.sha256(data).hexdigest(), tuple(ranks)


def plan(
    digest: str,
    held_by: Sequence[tuple[str | None, tuple[int, ...]]],
    lacking: Sequence[int],
    prefer: Sequence[Mapping[int, int]] | None = None,
) -> dict[int, int] | None:
    """Rank lacking its part -> the rank that sends it, or None if some part has no holder:
    of the ranks whose node holds its replica of the manifest of sha256 ``digest`` and
    lacks nothing, the one whose node comes first among the save's holders of that part
    (``prefer[i][r]``: the place of rank ``i``'s node among rank ``r``'s holders; unknown:
    last), the lowest rank among equals."""
    out: dict[int, int] = {}
    gone = set(lacking)
    for r in lacking:
        cands = [
            i
            for i, (d, ranks) in enumerate(held_by)
            if d == digest and r in ranks and i not in gone
        ]
        if not cands:
            return None
        out[r] = min(cands, key=lambda i: (prefer[i].get(r, MAX_REPLICAS) if prefer else 0, i))
    return out


async def _preference(uri: str, so: dict[str, Any], m: DcpManifest) -> list[list[int]]:
    """[saved rank, the place of this node among its holders] for each rank whose holders
    the replicas here name (their ``placement.json``, written with them); [] if none."""
    from ...config import node_id

    part = m.part_of(node_id())
    store = open_replicas(replica_uri(uri, so.get("config")), so)
    data = await read_bounded(store, PLACEMENT_KEY, manifest_limit(), what="placement")
    rows = decode_json(data).get("holders")
    mine = set(part.ranks) if part is not None else set()
    out: list[list[int]] = []
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, list) and len(row) == 2 and type(row[0]) is int:
            hs = row[1] if isinstance(row[1], list) else []
            j = next(
                (j for j, h in enumerate(hs[:MAX_REPLICAS]) if type(h) is int and h in mine), None
            )
            if j is not None:
                out.append([row[0], j])
    return out


def sources(
    uri: str,
    so: dict[str, Any],
    m: DcpManifest,
    digest: str,
    held_by: Sequence[tuple[str | None, tuple[int, ...]]],
    lacking: Sequence[int],
    pg: Any,
) -> dict[int, int] | None:
    """Every rank: :func:`plan` with each node's place among the save's holders of each
    part, gathered as JSON (a malformed or unreadable answer counts as no preference)."""
    try:
        mine = runtime.run(_preference(uri, so, m)) if any(d == digest for d, _r in held_by) else []
    except Exception:  # no placement here (none held, or of an earlier release): no order
        mine = []
    prefer: list[dict[int, int]] = []
    for got in _gather(pg, mine):
        ok = isinstance(got, list) and len(got) <= m.world_size
        rows = got if ok else []
        prefer.append(
            {
                r: j
                for x in rows
                if isinstance(x, list) and len(x) == 2 and all(type(v) is int for v in x)
                for r, j in [x]
            }
        )
    return plan(digest, held_by, lacking, prefer)


def fetch(uri: str, so: dict[str, Any], m: DcpManifest, routes: dict[int, int], pg: Any) -> str:
    """Every rank: the parts of ``routes``' ranks sent by their holders and written back on
    their own nodes; '' or why this rank failed (never raises: every rank must answer)."""
    import torch.distributed as dist

    rank = dist.get_rank(pg)
    err = ""
    works: list[Any] = []
    for r, h in sorted(routes.items()):
        if rank != h:
            continue
        rec: bytes | None = None
        blobs: list[bytes] = []
        try:
            where = replica_uri(uri, so.get("config"))
            rec, blobs = runtime.run(_read(open_replicas(where, so), m, r))
        except Exception as e:
            err = f"rank {h} could not read the replica of rank {r}: {_reason(e)}"
        works += _send(pg, r, rec, blobs)
    if rank in routes:
        h = routes[rank]
        got = _recv(pg, h, [m.blobs[i].size for i in _blobs_of(m, rank)])
        if isinstance(got, str):
            err = f"rank {h} could not send the replica of rank {rank}: {got}"
        else:
            try:
                store = open_store(uri, **so)
                where = f"replica of rank {rank} from rank {h}"
                runtime.run(_write(store, m, rank, got[0], got[1], where))
            except Exception as e:
                err = f"rank {rank}: {_reason(e)}"
    for w in works:
        w.wait()
    return err
