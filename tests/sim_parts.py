"""A deterministic simulation of exports in node parts: the real commit, supersede and
step-counting code of fmstore.tiering against in-memory stores in which every store call is
a scheduling point of one seeded scheduler.

One schedule: two nodes each export their part of one sharded checkpoint to a shared tier
(``parts.export_part``, the copy engine replaced by a byte-exact fake), one node
supersedes its export (``parts.delete_own_part``), and by chance a stranger writes a part
record its node never wrote, or a ``manifest.json`` that is no checkpoint in a newer step;
a rescan (``Tiers.committed_facts``) counts steps.  Nodes' clocks are apart by up to the
allowed skew; virtual time advances between calls, never past a parked call's deadline
(a store call lands within half a lease lifetime of being made: the protocol's stated
assumption).  After every step the oracles check:

* I2: a manifest on the shared tier has every blob it lists, byte-exact;
* I4: no blob of a committed manifest is deleted;
* I1 (the counting half): every step a rescan counts as committed has a manifest that
  parses and every blob it lists, byte-exact.

A failing schedule raises :class:`Violation` naming the seed; ``run(seed)`` replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fmstore.checkpoint.layout import checkpoint_key
from fmstore.checkpoint.partrecords import LEASE_TTL, PartRecord, manifest_sha256, part_record_key
from fmstore.errors import AlreadyExists, NotFound
from fmstore.format.checksum import crc32c
from fmstore.format.manifest import MANIFEST_KEY
from fmstore.stores.base import PutOptions, Store
from fmstore.stores.types import ObjectMeta

ROOT, STEP = "run", 10
NODES = ("n0", "n1")
_actor: contextvars.ContextVar[str] = contextvars.ContextVar("actor", default="")


class Violation(AssertionError):
    pass


@dataclass
class _Call:
    actor: str
    issued: float
    go: asyncio.Future[None]


@dataclass
class Scheduler:
    """Grants one parked store call at a time, chosen by ``rng``; owns virtual time."""

    rng: random.Random
    offsets: dict[str, float]
    now: float = 1_000_000.0
    parked: list[_Call] = field(default_factory=list)
    steps: int = 0
    trace: list[str] = field(default_factory=list)

    def clock(self) -> float:
        return self.now + self.offsets.get(_actor.get().split(":")[0], 0.0)

    async def point(self, what: str) -> None:
        call = _Call(_actor.get(), self.now, asyncio.get_running_loop().create_future())
        self.parked.append(call)
        await call.go
        self.trace.append(f"{call.actor} {what}")

    async def settle(self, tasks: list[asyncio.Task[Any]]) -> None:
        """Run every task until it parks at a store call or ends."""
        for _ in range(10_000):
            await asyncio.sleep(0)
            if all(t.done() for t in tasks) or self._quiet(tasks):
                return
        raise Violation("an actor neither parks at a store call nor ends")

    def _quiet(self, tasks: list[asyncio.Task[Any]]) -> bool:
        live = {t.get_name() for t in tasks if not t.done()}
        return live <= {c.actor for c in self.parked if not c.go.done()}

    def grant(self) -> _Call:
        latest = min(c.issued for c in self.parked) + LEASE_TTL / 2 - 1e-3
        gap = self.rng.choice((0.0, 0.5, LEASE_TTL / 8, LEASE_TTL / 3, LEASE_TTL))
        self.now = max(self.now, min(self.now + gap, latest))
        call = self.parked.pop(self.rng.randrange(len(self.parked)))
        call.go.set_result(None)
        self.steps += 1
        return call


class SimStore(Store):
    """An in-memory store whose every call is a scheduling point (``sched``)."""

    def __init__(self, name: str, sched: Scheduler, on_delete: Callable[[str], None]) -> None:
        self.tier = name
        self.url = f"sim://{name}"
        self.data: dict[str, bytes] = {}
        self.sched = sched
        self.on_delete = on_delete

    async def put(self, key: str, data: Any, options: PutOptions = PutOptions()) -> ObjectMeta:
        await self.sched.point(f"put {key}")
        if options.mode == "create" and key in self.data:
            raise AlreadyExists(key, tier=self.tier, key=key)
        self.data[key] = bytes(data)
        return ObjectMeta(key, len(self.data[key]))

    async def open_writer(self, key: str, options: PutOptions = PutOptions()) -> Any:
        raise NotImplementedError

    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        await self.sched.point(f"get {key}")
        if key not in self.data:
            raise NotFound(key, tier=self.tier, key=key)
        return self.data[key][start:end]

    async def stat(self, key: str) -> ObjectMeta:
        await self.sched.point(f"stat {key}")
        if key not in self.data:
            raise NotFound(key, tier=self.tier, key=key)
        return ObjectMeta(key, len(self.data[key]), mtime=self.sched.now)

    async def list(  # type: ignore[override]
        self, prefix: str = "", *, recursive: bool = True, **_: Any
    ) -> AsyncIterator[ObjectMeta]:
        await self.sched.point(f"list {prefix}")
        out: dict[str, ObjectMeta] = {}
        for k in sorted(self.data):
            if not k.startswith(prefix):
                continue
            rest = k[len(prefix) :]
            if not recursive and "/" in rest:
                d = prefix + rest.split("/", 1)[0] + "/"
                out[d] = ObjectMeta(d, 0, is_dir=True)
            else:
                out[k] = ObjectMeta(k, len(self.data[k]), mtime=self.sched.now)
        if not out:
            raise NotFound(prefix, tier=self.tier, key=prefix)
        for m in out.values():
            yield m

    async def delete(self, key: str) -> None:
        await self.sched.point(f"delete {key}")
        if key in self.data:
            self.on_delete(key)
            del self.data[key]

    async def copy(self, src: str, dst: str, options: PutOptions = PutOptions()) -> ObjectMeta:
        raise NotImplementedError


def checkpoint() -> tuple[bytes, dict[str, bytes]]:
    """A sharded checkpoint of two nodes x one rank: its manifest and its blobs by name."""
    from dataclasses import replace

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from fmstore.checkpoint.dcp.manifest import DcpBlob, DcpItem, DcpManifest, DcpPart
    from fmstore.format.manifest import ChunkEntry

    blobs, items, payloads = [], [], {}
    for r in range(len(NODES)):
        data = bytes([r + 1]) * (100 + r)
        name = f"{r:06d}.bin"
        payloads[name] = data
        blobs.append(DcpBlob(name, len(data), r))
        chunk = ChunkEntry(r, 0, len(data), 0, len(data), "raw", crc32c(data))
        items.append(DcpItem(f"x{r}", None, "bytes", "", (), len(data), (chunk,)))
    md = Metadata(state_dict_metadata={it.fqn: BytesStorageMetadata() for it in items})
    m = DcpManifest.from_metadata(
        md,
        generation="g000000000001-00000001",
        world_size=len(NODES),
        items=items,
        blobs=blobs,
        allow_pickle=False,
        writer="sim",
        parts=[DcpPart(n, (r,)) for r, n in enumerate(NODES)],
    )
    return replace(m, created=1_000_000.0).dumps(), payloads


# ---- the schedule ---------------------------------------------------------------------------


class _Check:
    def __init__(self, ok: bool) -> None:
        self.ok = ok


async def _fake_verify(store: Store, manifest: Any = None, **_: Any) -> _Check:
    """Byte-exact: every blob of ``manifest`` there with the CRC32C its chunks imply."""
    from fmstore.checkpoint.verify import blob_checksums

    crcs = blob_checksums(manifest)
    for i in range(len(manifest.blobs)):
        try:
            data = await store.get(manifest.blob_key(i))
        except NotFound:
            return _Check(False)
        if len(data) != manifest.blobs[i].size or crc32c(data) != crcs[i]:
            return _Check(False)
    return _Check(True)


async def _fake_copy(src: Store, dst: Store, view: Any, *_: Any, **__: Any) -> tuple[Any, int, int]:
    """The copy engine, byte-exact, one put per blob (each a scheduling point)."""
    for i in range(len(view.blobs)):
        await dst.put(view.blob_key(i), await src.get(view.blob_key(i)))
    return await _fake_verify(dst, view), view.stored_bytes, 0


class _Clock:
    """``time`` for the modules under test: each node reads the virtual clock plus its own
    offset."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    def time(self) -> float:
        return self.sched.clock()

    def monotonic(self) -> float:
        return self.sched.now


REVERTS = ("count", "supersede", "record")


def patches(revert: frozenset[str] = frozenset()) -> list[tuple[Any, str, Any]]:
    """(module, name, value) to set for a batch of schedules: the fakes, and each fix of
    ``revert`` taken back to what the code did before it."""
    from fmstore.tiering import parts, protocol, tiers

    out: list[tuple[Any, str, Any]] = [
        (parts, "copy_blobs", _fake_copy),
        (parts, "verify_checkpoint", _fake_verify),
    ]
    if "count" in revert:  # a step counted from its manifest's existence alone

        def any_facts(data: bytes, *, crc32c: int, where: str) -> protocol.ManifestFacts:
            return protocol.ManifestFacts("?", 1, "g", 0.0, (), (), crc32c)

        out += [
            (tiers, "manifest_facts", any_facts),
            (tiers, "step_committed", lambda *a, **k: None),
        ]
    if "supersede" in revert:  # leases ignored by the superseder and the committer
        out += [
            (parts, "may_remove_part", lambda node, leases, *, committed, **k: not committed),
            (parts, "commit_holds", lambda *a, **k: True),
        ]
    if "record" in revert:  # a record trusted for the blobs it names, however few
        out += [
            (
                parts,
                "record_holds",
                lambda rec, part, sizes: all(sizes.get(n) == s for n, s, _ in rec),
            )
        ]
    return out


@dataclass
class Outcome:
    seed: int
    steps: int
    trace: list[str]


async def _schedule(seed: int, manifest: bytes, payloads: dict[str, bytes]) -> Outcome:
    from fmstore.config import from_dict
    from fmstore.errors import FmstoreError
    from fmstore.tiering import parts, tiers
    from fmstore.tiering.mover import CHECKPOINT_COPY
    from fmstore.tiering.parts import delete_own_part, export_part
    from fmstore.tiering.tiers import Tiers

    rng = random.Random(seed)
    from fmstore.checkpoint.partrecords import CLOCK_SKEW

    sched = Scheduler(rng, {n: rng.uniform(-CLOCK_SKEW / 2, CLOCK_SKEW / 2) for n in NODES})
    ck = checkpoint_key(ROOT, STEP)
    gen = json.loads(manifest)["generation"]
    blob_keys = {f"{ck}/{gen}/{n}": d for n, d in payloads.items()}

    def on_delete(key: str) -> None:
        if key in blob_keys and shared.data.get(f"{ck}/{MANIFEST_KEY}") == manifest:
            raise Violation(f"I4: {key} deleted from a committed checkpoint (seed {seed})")

    shared = SimStore("lustre", sched, on_delete)
    srcs = {}
    for r, n in enumerate(NODES):
        st = SimStore(f"nvme-{n}", sched, lambda k: None)
        st.data[f"{MANIFEST_KEY}"] = manifest
        name = f"{r:06d}.bin"
        st.data[f"{gen}/{name}"] = payloads[name]
        srcs[n] = st
    tiers_obj = Tiers(from_dict({"tiers": {"lustre": {"url": "/nonexistent"}}}))
    tiers_obj._stores["lustre"] = shared
    clock = _Clock(sched)
    saved = [(parts, "time", parts.time), (tiers, "time", tiers.time)]
    parts.time, tiers.time = clock, clock  # type: ignore[assignment]
    counted: list[int] = []

    async def exporter(node: str, supersede: bool) -> None:
        dst = shared.sub(ck)
        for _ in range(rng.randint(1, 2)):
            res = await export_part(srcs[node], dst, node, options=CHECKPOINT_COPY)
            if not res.waiting_for:
                return
        if supersede:
            await delete_own_part(dst, node, srcs[node])

    async def stranger() -> None:
        if rng.random() < 0.5:
            n = rng.choice(NODES)
            rec = PartRecord(n, (NODES.index(n),), gen, manifest_sha256(manifest), ())
            await shared.put(f"{ck}/{part_record_key(gen, n)}", rec.dumps())
        if rng.random() < 0.5:
            junk = rng.choice((b"", b"{}", b'{"format": "fmstore-dcp", "version": 2}'))
            await shared.put(f"{checkpoint_key(ROOT, STEP + 10)}/{MANIFEST_KEY}", junk)

    async def rescan() -> None:
        for _ in range(rng.randint(1, 3)):
            counted.extend(await tiers_obj.committed_facts("lustre", ROOT))

    async def as_actor(name: str, coro: Any) -> None:
        _actor.set(name)
        # A refusal the real code reports (CorruptData, ...): the protocol's to survive.
        with contextlib.suppress(FmstoreError):
            await coro

    super_node = rng.choice(NODES)
    plan = {
        **{n: exporter(n, n == super_node) for n in NODES},
        "stranger": stranger(),
        "rescan": rescan(),
    }
    tasks = [asyncio.create_task(as_actor(k, c), name=k) for k, c in plan.items()]
    kill = rng.choice([None, *NODES]) if rng.random() < 0.3 else None
    kill_at = rng.randint(1, 30)
    try:
        while True:
            await sched.settle(tasks)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if not sched.parked:
                break
            sched.grant()
            if kill is not None and sched.steps == kill_at:
                for t in tasks:
                    if t.get_name() == kill:
                        t.cancel()  # killed between two store calls
                sched.parked = [c for c in sched.parked if c.actor != kill]
            _oracles(seed, shared, ck, manifest, blob_keys, counted)
        _oracles(seed, shared, ck, manifest, blob_keys, counted)
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)
        for t in tasks:
            t.cancel()
    return Outcome(seed, sched.steps, sched.trace)


def _oracles(
    seed: int,
    shared: SimStore,
    ck: str,
    manifest: bytes,
    blob_keys: dict[str, bytes],
    counted: list[int],
) -> None:
    got = shared.data.get(f"{ck}/{MANIFEST_KEY}")
    if got is not None:
        bad = [k for k, d in blob_keys.items() if shared.data.get(k) != d]
        if bad:
            raise Violation(f"I2: the manifest at {ck} lists {bad} not there (seed {seed})")
    if set(counted) - {STEP}:
        raise Violation(f"I1: steps {sorted(set(counted))} counted as committed (seed {seed})")


def run(seed: int, revert: frozenset[str] = frozenset()) -> Outcome:
    """One schedule, replayable from its seed alone."""
    return search([seed], revert)[0]


def search(
    seeds: Any, revert: frozenset[str] = frozenset(), *, deadline: float | None = None
) -> list[Outcome]:
    """Run the schedules of ``seeds`` (stopping at ``deadline``, ``time.monotonic()``),
    raising :class:`Violation` at the first that breaks an invariant."""
    import time

    manifest, payloads = checkpoint()
    done: list[Outcome] = []
    undo = []
    for mod, name, value in patches(revert):
        undo.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)
    from fmstore.tiering import parts

    undo.append((parts._Lease, "_renew", parts._Lease._renew))
    parts._Lease._renew = _no_renew  # type: ignore[method-assign]
    try:
        for seed in seeds:
            if deadline is not None and time.monotonic() > deadline:
                break
            done.append(asyncio.run(_schedule(seed, manifest, payloads)))
    finally:
        for mod, name, value in reversed(undo):
            setattr(mod, name, value)
    return done


async def _no_renew(self: Any) -> None:
    """Renewals come from the attempts' own lease writes only (fewer renewals: harder)."""
    await asyncio.Event().wait()


def main() -> int:
    """``make test-sim``: fresh seeds for ``$SIM_SECONDS`` (600), then one line
    ``schedules: N, violations: V``; a violation prints its seed (``run(seed)`` replays it)."""
    import os
    import time

    seconds = float(os.environ.get("SIM_SECONDS", "600"))
    start = int(os.environ.get("SIM_SEED") or random.SystemRandom().randrange(1 << 40))
    print(f"seeds from {start}", flush=True)
    deadline = time.monotonic() + seconds
    n, violations, seed = 0, 0, start
    while time.monotonic() < deadline:
        try:
            n += len(search(range(seed, seed + 500), deadline=deadline))
        except Violation as e:
            violations += 1
            print(e, flush=True)
            break
        seed += 500
    print(f"schedules: {n}, violations: {violations}")
    return 1 if violations else 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
