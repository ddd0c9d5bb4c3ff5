"""Retiring, on a shared tier, the generation of a step that a restore abandoned.

When a restore falls back from step N (:mod:`.aside`), the job redoes N under a new
generation.  An export of the abandoned generation ``G`` may still be under way on some node
(a slow daemon), and, since the parts of the other nodes may already be on the shared tier,
it could complete the set and commit ``G`` there after the restore passed it over.  No lock
and no wait keeps that from happening: a fence on the destination does, two writes each
followed by a read of the other's key, so that on a linearizable store (POSIX, S3) at least
one side sees the other's write (``docs/distributed.md``, "Steps moved aside after a
fallback", has the argument):

* the restorer (:func:`fence`) writes ``GEN/retired.json`` (a *retired record*,
  :class:`~fmstore.protocol.records.RetiredRecord`), then reads ``manifest.json``:
  when it names ``G``, it deletes it (the copy stops being a checkpoint; its objects are
  an uncommitted generation, which the sweep removes);
* the committer (:func:`fmstore.tiering.exports.parts.commit_if_complete`) looks for the retired
  record before it writes the manifest (:func:`retired`) and again after
  (:func:`retire_own_commit`): found after, it deletes the manifest it wrote.

A commit of another generation of the step (the redo) waits while a retired generation of
the step holds an export lease that may be alive (:func:`retired_exporters`): a late write
of that exporter (its manifest, or its own retirement of it) lands before the redo's
commit, never after.  A manifest of a retired generation that the redo's export meets is
deleted (manifest first) once no exporter of it may be alive (:func:`clear_retired`),
never overwritten.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol

from ...checkpoint.commit import read_bounded_manifest
from ...checkpoint.layout import GENERATION_RE
from ...errors import CorruptData, FmstoreError, NotFound
from ...format.manifest import MANIFEST_KEY
from ...protocol.env import Env
from ...protocol.records import RetiredRecord, retired_key
from ...stores.base import Store
from ...stores.bounded import RECORD_LIMIT, decode_json, read_bounded

__all__ = [
    "Retired",
    "clear_retired",
    "fence",
    "generation_of",
    "retire_own_commit",
    "retired",
    "retired_exporters",
]


class Retired(FmstoreError):
    """The generation being committed was retired by a restore: not committed."""

    def __init__(self, gen: str) -> None:
        super().__init__(f"generation {gen} was retired by a restore that fell back")


class _Lease(Protocol):
    renewed: float

    async def put(self) -> None: ...


def generation_of(data: bytes) -> str | None:
    """The generation a manifest's bytes name; None when they name none."""
    with contextlib.suppress(ValueError, TypeError):
        d = decode_json(data)
        g = d.get("generation") if isinstance(d, dict) else None
        if isinstance(g, str) and GENERATION_RE.match(g):
            return g
    return None


async def retired(dst: Store, gen: str) -> bool:
    """Whether generation ``gen`` at ``dst`` (a step's prefix) holds a retired record.  Its
    name is what retires: a record that does not parse retires too (nothing written there
    un-retires a generation)."""
    key = retired_key(gen)
    try:
        raw = await read_bounded(dst, key, RECORD_LIMIT, what="retired record")
    except NotFound:
        return False
    except CorruptData:
        return True
    with contextlib.suppress(CorruptData):
        RetiredRecord.loads(raw, where=f"{dst.url}/{key}")
    return True


async def _manifest(dst: Store) -> bytes | None:
    try:
        return await read_bounded_manifest(dst)
    except NotFound:
        return None


async def fence(dst: Store, gen: str, env: Env) -> bool:
    """The restorer's side: retire generation ``gen`` of the step at ``dst`` (a shared
    tier), then delete the manifest there if it names ``gen`` (a commit made before the
    record landed).  True when a commit was retired.  Three bounded store calls; no wait.
    The record names this node and its clock (``env``'s)."""
    record = RetiredRecord(gen, env.node_id(), env.now())
    await dst.put(retired_key(gen), record.dumps())
    data = await _manifest(dst)
    if data is None or generation_of(data) != gen:
        return False
    await dst.delete(MANIFEST_KEY)
    return True


async def retire_own_commit(dst: Store, data: bytes, lease: _Lease, env: Env) -> None:
    """The committer's side, after its manifest (``data``) is there and the retired record
    of its generation was found: renew its lease (a commit of the redo waits while it may
    be alive), then delete the manifest if it is still this one.  Past its lease's window
    it deletes nothing: the redo's export retires the manifest (:func:`clear_retired`)."""
    await lease.put()
    if not env.commit_holds(lease.renewed):
        return
    if await _manifest(dst) == data:
        await dst.delete(MANIFEST_KEY)


def _alive(renewals: dict[str, float], now: float, env: Env) -> list[str]:
    return sorted(n for n, r in renewals.items() if env.lease_alive(r, now))


async def retired_exporters(
    dst: Store,
    gen: str,
    renewals: Callable[[Store, str], Awaitable[dict[str, float]]],
    env: Env,
) -> list[str]:
    """The nodes holding an export lease that may be alive in a retired generation of the
    step at ``dst`` other than ``gen`` (``renewals``: node -> last renewal of a
    generation's leases, :func:`fmstore.tiering.exports.parts.lease_renewals`)."""
    try:
        gens = [
            m.key.rstrip("/")
            async for m in dst.list("", recursive=False)
            if m.is_dir and GENERATION_RE.match(m.key.rstrip("/"))
        ]
    except NotFound:
        return []
    out: list[str] = []
    for g in gens:
        if g == gen or not await retired(dst, g):
            continue
        leases = await renewals(dst, g)
        out += [f"{n} ({g})" for n in _alive(leases, env.now(), env)]
    return out


async def clear_retired(
    dst: Store,
    existing: bytes,
    renewals: Callable[[Store, str], Awaitable[dict[str, float]]],
    env: Env,
) -> list[str] | None:
    """The redo's export meeting a manifest (``existing``) of another generation at
    ``dst``: None when that generation is not retired (a different checkpoint: the caller
    refuses); else the nodes whose export lease there may still be alive (the manifest
    stays, the export waits), or ``[]`` once the manifest was deleted (manifest first: its
    objects are left to the sweep as an uncommitted generation)."""
    gen = generation_of(existing)
    if gen is None or not await retired(dst, gen):
        return None
    leases = await renewals(dst, gen)
    now = env.now()  # before the manifest is read again: a lease dead at ``now`` had
    # its exporter's last write land before this moment
    if alive := _alive(leases, now, env):
        return [f"{n} ({gen})" for n in alive]
    if await _manifest(dst) == existing:
        await dst.delete(MANIFEST_KEY)
    return []
