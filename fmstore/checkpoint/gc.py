"""Garbage collection: remove what crashed or superseded saves left behind.

Under a root, an object ``P/GEN/NNNNNN.bin`` (generation and blob names as in
:mod:`.layout`) belongs to the checkpoint at prefix ``P`` only while ``P/manifest.json``
names ``GEN``.  Everything else of that shape is garbage: blobs of a save that never
committed (no manifest at ``P``), and generations an overwrite superseded.  Other objects
are never touched; a manifest that does not parse keeps its prefix untouched.  POSIX temp
files of interrupted writes are removed too.

A generation holding a rank record (``rank-NNNNNN.json``) that no manifest names is a
*pending* part of a sharded checkpoint on a node-local tier: its save may have committed on
another node, whose manifest has not reached this one yet.  It is never garbage here,
however old; only a restore's collective decides about it (``docs/distributed.md``).

On a shared tier, the copy of a checkpoint in node parts being exported by the nodes
(:mod:`~fmstore.protocol.records`) holds part records (``part-NODE.json``) and export leases
(``export-NODE.json``) beside its blobs until it commits.  Such a generation is kept while
any lease in it is alive, whatever ``older_than``; when it goes, its part records go
first, then it is looked at again (a lease renewed, a part record written since the scan,
a manifest naming it: it stays), then its blobs and leases, so a node that exports into it
meanwhile does not commit over missing blobs.

``older_than`` protects saves still running: a generation is removed only when it was
started, and last written, at least that many seconds ago.  "Written" is when each object
was written *there*: a copy carries its source's modification time (a POSIX tier keeps it),
so on a file system the later of the file's mtime and ctime (a copy's ctime is the copy's
own) counts.  ``live`` (URLs under the store) are destinations of copies in progress on this
node (their journals): nothing under them goes.  Never run gc with a small ``older_than``
while a save under the same root may be in progress.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import runtime
from ..errors import CorruptData, FmstoreError, NotFound
from ..format.manifest import MANIFEST_KEY, Manifest
from ..protocol.env import Env
from ..protocol.records import LEASE_RE, PART_RECORD_RE, RETIRED_NAME, ExportLease
from ..stores import open_store
from ..stores.base import ObjectMeta, Store
from ..stores.bounded import LEASE_LIMIT, read_bounded
from .commit import read_bounded_manifest
from .layout import BLOB_RE, GENERATION_RE, RANK_RECORD_RE, generation_age


@dataclass
class GcReport:
    checkpoints: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    removed_bytes: int = 0
    young: list[str] = field(default_factory=list)
    #: pending parts (``P/GEN``) of sharded checkpoints on a node-local tier: kept
    pending: list[str] = field(default_factory=list)
    #: generations some node exports into now (a live lease, or a live journal here): kept
    exporting: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    temp_files: int = 0
    dry_run: bool = False


_Gens = dict[tuple[str, str], list[tuple[str, int, float | None]]]


def written_at(meta: ObjectMeta) -> float | None:
    """When ``meta``'s object was written where it lies: on a file system the later of its
    mtime and ctime (a copy carries its source's mtime; its ctime is its own), elsewhere
    the store's modification time (S3: the upload's)."""
    if meta.stat is not None:
        return max(meta.stat.st_mtime, meta.stat.st_ctime)
    return meta.mtime


async def _scan(store: Store) -> tuple[dict[str, str | None], _Gens, set[tuple[str, str]]]:
    manifests: dict[str, str | None] = {}
    gens: _Gens = {}
    pending: set[tuple[str, str]] = set()
    async for m in store.list("", recursive=True):
        if m.is_dir:
            continue
        parts = m.key.split("/")
        if parts[-1] == MANIFEST_KEY:
            manifests["/".join(parts[:-1])] = None
        elif (
            len(parts) >= 2
            and GENERATION_RE.match(parts[-2])
            and (
                BLOB_RE.match(parts[-1])
                or PART_RECORD_RE.fullmatch(parts[-1])
                or LEASE_RE.fullmatch(parts[-1])
                or parts[-1] == RETIRED_NAME
            )
        ):
            gens.setdefault(("/".join(parts[:-2]), parts[-2]), []).append(
                (m.key, m.size, written_at(m))
            )
        elif len(parts) >= 2 and RANK_RECORD_RE.match(parts[-1]) and GENERATION_RE.match(parts[-2]):
            pending.add(("/".join(parts[:-2]), parts[-2]))
    for prefix in manifests:
        key = f"{prefix}/{MANIFEST_KEY}" if prefix else MANIFEST_KEY
        try:
            data = await read_bounded_manifest(store, key)
            manifests[prefix] = _generation_of(data)
        except Exception:
            manifests[prefix] = "?"  # unreadable: keep everything under it
    return manifests, gens, pending


def _generation_of(data: bytes) -> str:
    """The generation a manifest names: single-process or multi-rank (DCP) checkpoint."""
    from .dcp.manifest import DCP_FORMAT_NAME, DcpManifest, sniff_format

    if sniff_format(data) == DCP_FORMAT_NAME:
        return DcpManifest.loads(data).generation
    return Manifest.loads(data).generation


async def find_checkpoints_async(store: Store) -> list[str]:
    manifests, _, _ = await _scan(store)
    return sorted(p for p, g in manifests.items() if g not in (None, "?"))


def find_checkpoints(root: str | Store) -> list[str]:
    """Prefixes (relative to ``root``) of the committed checkpoints under ``root``."""

    async def go() -> list[str]:
        store = root if isinstance(root, Store) else open_store(os.fspath(root))
        try:
            return await find_checkpoints_async(store)
        finally:
            if not isinstance(root, Store):
                await store.close()

    return runtime.run(go())


async def agc(
    root: str | Store,
    *,
    older_than: float = 3600.0,
    dry_run: bool = False,
    live: Sequence[str] = (),
    env: Env | None = None,
) -> GcReport:
    """Async twin of :func:`gc`."""
    store = root if isinstance(root, Store) else open_store(os.fspath(root))
    try:
        return await _gc(store, older_than, dry_run, live, _env(env))
    finally:
        if not isinstance(root, Store):
            await store.close()


@dataclass(frozen=True)
class Generation:
    """A generation no manifest names: its prefix (``P/GEN``), objects, bytes and age (the
    younger of its start and its last write), and whether a node's export lease in it is
    alive (then nothing of it goes)."""

    where: str
    keys: list[str]
    size: int
    age: float
    exporting: bool = False

    @property
    def records(self) -> list[str]:
        """Its part records and export leases: removed before its blobs."""
        return [k for k in self.keys if not BLOB_RE.match(k.rsplit("/", 1)[-1])]


def _env(env: Env | None) -> Env:
    """The protocol env a lease is judged by: the caller's, else this process's
    (``$FMSTORE_EXPORT_LEASE_TTL`` / ``$FMSTORE_CLOCK_SKEW`` or the defaults)."""
    return Env.from_config(None) if env is None else env


async def _live_lease(store: Store, keys: list[str], env: Env) -> bool:
    """Whether any export lease of ``keys`` may be alive (the one lease rule,
    :meth:`ExportLease.alive`, with ``env``); one that cannot be read counts as alive."""
    for key in keys:
        if not LEASE_RE.fullmatch(key.rsplit("/", 1)[-1]):
            continue
        try:
            raw = await read_bounded(store, key, LEASE_LIMIT, what="export lease")
            if ExportLease.loads(raw, where=f"{store.url}/{key}").alive(env):
                return True
        except NotFound:
            continue
        except CorruptData:
            # malformed: alive while the object itself may be younger than a lease lives
            # (its write time taken as a renewal, by the same rule: the tier's clock may
            # be the skew apart from this one), rather than delete under an exporter or
            # keep the generation for ever
            try:
                written = written_at(await store.stat(key))
            except NotFound:
                continue
            if written is None or env.lease_alive(written):
                return True
        except FmstoreError:
            return True  # unreadable (the tier is unavailable): assume alive
    return False


async def remove_generation(store: Store, g: Generation, env: Env) -> bool:
    """Remove orphan generation ``g``: its part records first, then, unless an exporter
    came back meanwhile (a live lease, a part record written since the scan) or a manifest
    now names it, its blobs and leases.  False when it stopped before the blobs."""
    # Its part records go first (no commit counts them any more); its leases stay until the
    # blobs go: one renewed since the scan must be read below, as alive, not deleted unread.
    records = [k for k in g.records if PART_RECORD_RE.match(k.rsplit("/", 1)[-1])]
    if g.records:
        await store.delete_many(records)
        prefix, _, gen = g.where.rpartition("/")
        leases, came_back = [], False
        async for meta in store.list(f"{g.where}/", recursive=False):
            name = meta.key.rsplit("/", 1)[-1]
            if LEASE_RE.fullmatch(name):
                leases.append(meta.key)
            # A part record written since the scan: an exporter is back at work in it.
            came_back = came_back or bool(PART_RECORD_RE.match(name))
        if came_back or await _live_lease(store, leases, env):
            return False
        try:
            key = f"{prefix}/{MANIFEST_KEY}" if prefix else MANIFEST_KEY
            data = await read_bounded_manifest(store, key)
            if _generation_of(data) == gen:
                return False
        except NotFound:
            pass
        except Exception:
            return False  # an unreadable manifest keeps its prefix
    await store.delete_many([k for k in g.keys if k not in records])
    return True


async def orphan_generations(
    store: Store, pending_out: list[str] | None = None, *, env: Env
) -> tuple[list[Generation], list[str], list[str]]:
    """Every generation under ``store`` that no manifest names, and the prefixes of the
    committed checkpoints and of the unreadable manifests (whose generations are kept).
    Pending parts (a rank record, no manifest naming them) are never in the list; their
    ``P/GEN`` are appended to ``pending_out``.  ``env``: the clock ages are measured by and
    the lease settings leases are judged by."""
    manifests, gens, pending = await _scan(store)
    now = env.now()
    out: list[Generation] = []
    for (prefix, gen), objs in sorted(gens.items()):
        current = manifests.get(prefix)
        if current == gen or current == "?":
            continue
        if (prefix, gen) in pending:
            if pending_out is not None:
                pending_out.append(f"{prefix}/{gen}" if prefix else gen)
            continue
        mtimes = [t for _, _, t in objs if t is not None]
        age = (
            min(generation_age(gen, now), now - max(mtimes)) if mtimes else generation_age(gen, now)
        )
        where = f"{prefix}/{gen}" if prefix else gen
        keys = [k for k, _, _ in objs]
        size = sum(n for k, n, _ in objs if BLOB_RE.match(k.rsplit("/", 1)[-1]))
        out.append(Generation(where, keys, size, age, await _live_lease(store, keys, env)))
    committed = sorted(p for p, g in manifests.items() if g not in (None, "?"))
    unreadable = sorted(p for p, g in manifests.items() if g == "?")
    return out, committed, unreadable


def _under(url: str, dests: Sequence[str]) -> bool:
    return any(url == d or url.startswith(d.rstrip("/") + "/") for d in dests)


async def _gc(
    store: Store, older_than: float, dry_run: bool, live: Sequence[str], env: Env
) -> GcReport:
    rep = GcReport(dry_run=dry_run)
    gens, rep.checkpoints, rep.unreadable = await orphan_generations(store, rep.pending, env=env)
    base = store.url.rstrip("/")
    for g in gens:
        if g.exporting or _under(f"{base}/{g.where}", live):
            rep.exporting.append(g.where)
            continue
        if g.age < older_than:
            rep.young.append(g.where)
            continue
        if dry_run or await remove_generation(store, g, env):
            rep.removed += g.keys
            rep.removed_bytes += g.size
        else:
            rep.exporting.append(g.where)
    rep.temp_files = await store.cleanup_temp(older_than, dry_run=dry_run)
    return rep


def gc(
    root: str | Store,
    *,
    older_than: float = 3600.0,
    dry_run: bool = False,
    live: Sequence[str] = (),
    env: Env | None = None,
) -> GcReport:
    """Remove leftovers of crashed or superseded saves under ``root``; see the module doc.

    Returns what was (or, with ``dry_run``, would be) removed and the committed checkpoints
    found.  Committed checkpoints are never touched, nor a generation some node exports
    into (a live lease) or that lies under one of ``live`` (URLs of copies in progress).
    Leases are judged by ``env`` (the protocol's clock and settings; this process's
    environment's without one: pass the config's, ``Env.from_config(config)``).
    """
    return runtime.run(agc(root, older_than=older_than, dry_run=dry_run, live=live, env=env))
