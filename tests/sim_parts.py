"""A deterministic simulation of exports in node parts, retention, release and the orphan
sweep: the real code of fmstore.tiering and fmstore.checkpoint.gc against in-memory stores
in which every store call is a scheduling point of one seeded scheduler.

One schedule (``docs/distributed.md``, "The simulation"): 2 or 3 nodes each hold their part
of two saved steps on their own node-local store; each node's exporter exports its parts to
the shared store (``parts.export_part``, the copy engine replaced by a byte-exact fake), one
may supersede its first export (``parts.delete_own_part``); each node's daemon rescans
(``Tiers.committed_facts``), plans retention and release (``policies.plan_retention``,
``policies.plan_release``), removes what they choose (``mover.delete_checkpoint``) and
sweeps orphans (``sweep.Sweeper``); a stranger may write a part record or a junk manifest.
Faults: a node killed between two store calls, clocks apart within the allowed skew, typed
transient store errors (a write or delete may land and still fail).  Virtual time advances
between calls, never past a parked call's deadline (a store call lands within half a lease
lifetime of being made: the protocol's stated assumption).  Each schedule draws a shape
(:data:`AIMS`): all of the actors, or a few aimed at one race (a superseder against the
others' commits, sweeps against exports mid-commit, restores on a flaky tier after the
exports) by which actors run and which of their calls are slow.  After every call the oracles
check I1 in full (the shared tier's ``keep_latest`` newest steps restorable from some tier)
and its counting half, I2 (a manifest's blobs all there, byte-exact) and I4 (no blob of a
committed manifest deleted).

A failing schedule raises :class:`Violation` naming the seed; ``run(seed)`` replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib
import json
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fmstore.checkpoint.layout import checkpoint_key
from fmstore.errors import AlreadyExists, NotFound, StoreUnavailable
from fmstore.format.checksum import crc32c
from fmstore.format.manifest import MANIFEST_KEY
from fmstore.protocol.env import Env
from fmstore.protocol.records import PartRecord, manifest_sha256, part_record_key
from fmstore.stores.base import PutOptions, Store
from fmstore.stores.types import ObjectMeta

ROOT = "run"
#: The protocol's lease lifetime and clock skew in every schedule (their defaults), whatever
#: ``$FMSTORE_EXPORT_LEASE_TTL`` / ``$FMSTORE_CLOCK_SKEW`` the process was started with:
#: each node's :class:`Env` is made here, never read from the process.
LEASE_TTL = 120.0
CLOCK_SKEW = 10.0
#: The process id every simulated exporter writes in its leases (all nodes run in this
#: process; a real id would make the bytes written depend on it).
SIM_PID = 4242
#: Where virtual time starts, by default (``run(seed, start=...)`` picks another).
START = 1_000_000.0
_actor: contextvars.ContextVar[str] = contextvars.ContextVar("actor", default="")


class Violation(AssertionError):
    pass


@dataclass
class _Call:
    actor: str
    issued: float
    go: asyncio.Future[None]
    slow: bool = False


@dataclass
class Scheduler:
    """Grants one parked store call at a time, chosen by ``rng``; owns virtual time.

    Two ways to choose, drawn per schedule: uniformly among the parked calls, or by
    priority (PCT: each actor a random priority, the highest parked one granted; at a few
    random steps the actor just granted drops below every other).  Priorities run one
    actor through many calls while another waits between two of its own: the narrow
    windows of the races (a committer paused before its manifest write while a superseder
    or a sweep runs) that uniform choice reaches rarely."""

    rng: random.Random
    offsets: dict[str, float]
    now: float = START
    #: Where virtual time started (the trace shows time since).
    start: float = START
    parked: list[_Call] = field(default_factory=list)
    steps: int = 0
    #: By priority: each actor's, and the steps after which the granted actor drops.
    prio: dict[str, float] | None = None
    drops: frozenset[int] = frozenset()
    #: The share of calls that are slow: granted only when every parked call is slow
    #: (at the latest half a lease lifetime after they were made, as any call).
    slow: float = 0.0
    #: The calls a schedule's shape aims at, each slow: (actors, verb, end of the key) each.
    aimed: tuple[tuple[frozenset[str], str, str], ...] = ()
    #: Puts and deletes that landed: the oracles look again only after one.
    writes: int = 0
    trace: list[str] = field(default_factory=list)

    def clock_of(self, node: str) -> Callable[[], float]:
        """Node ``node``'s clock: virtual time plus its own offset."""
        offset = self.offsets.get(node, 0.0)
        return lambda: self.now + offset

    def env(self, node: str) -> Env:
        """Node ``node``'s protocol environment: its clock, its id, :data:`SIM_PID`, the
        schedule's lease settings.  No renewal in the background (``lease_renew`` beyond
        any schedule): renewals come from the attempts' own lease writes only (fewer
        renewals: harder)."""
        return Env(
            lease_ttl=LEASE_TTL,
            lease_renew=1e9,
            clock_skew=CLOCK_SKEW,
            clock=self.clock_of(node),
            node=node,
            pid=SIM_PID,
        )

    async def point(self, what: str) -> None:
        call = _Call(_actor.get(), self.now, asyncio.get_running_loop().create_future())
        call.slow = bool(self.slow) and self.rng.random() < self.slow
        call.slow = call.slow or any(
            call.actor in actors and what.startswith(verb) and what.endswith(end)
            for actors, verb, end in self.aimed
        )
        self.parked.append(call)
        await call.go
        slow = " (slow)" if call.slow else ""
        self.trace.append(f"{self.now - self.start:9.3f} {call.actor} {what}{slow}")

    def note(self, outcome: str) -> None:
        """What the call just granted found or left (the trace is the whole schedule)."""
        self.trace.append(f"  = {outcome}")

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
        ready = [i for i, c in enumerate(self.parked) if not c.slow] or range(len(self.parked))
        if self.prio is None:
            call = self.parked.pop(ready[self.rng.randrange(len(ready))])
        else:
            for c in self.parked:
                if c.actor not in self.prio:
                    self.prio[c.actor] = self.rng.random()
            prio = self.prio
            call = self.parked.pop(max(ready, key=lambda i: prio[self.parked[i].actor]))
            if self.steps in self.drops:
                self.prio[call.actor] = min(self.prio.values()) - 1.0
        call.go.set_result(None)
        self.steps += 1
        return call


class SimStore(Store):
    """An in-memory store whose every call is a scheduling point (``sched``); with
    ``flaky`` > 0 a call fails with a typed transient error (:class:`StoreUnavailable`) at
    that rate, a write or delete half the time after it landed (its outcome unknown to the
    caller)."""

    def __init__(
        self, name: str, sched: Scheduler, on_delete: Callable[[str], None], flaky: float = 0.0
    ) -> None:
        self.tier = name
        self.url = f"sim://{name}"
        self.data: dict[str, bytes] = {}
        self.sched = sched
        self.on_delete = on_delete
        self.flaky = flaky

    def _fail(self, key: str) -> bool:
        """Whether this call fails; raises at once when it fails before landing."""
        if not self.flaky or self.sched.rng.random() >= self.flaky:
            return False
        self.sched.trace.append(f"  (transient error on {key})")
        if self.sched.rng.random() < 0.5:
            raise StoreUnavailable("transient error", tier=self.tier, key=key)
        return True

    async def put(self, key: str, data: Any, options: PutOptions = PutOptions()) -> ObjectMeta:
        await self.sched.point(f"put {key}")
        landed_then_fail = self._fail(key)
        if options.mode == "create" and key in self.data:
            self.sched.note("exists")
            raise AlreadyExists(key, tier=self.tier, key=key)
        self.data[key] = bytes(data)
        self.sched.writes += 1
        self.sched.note(f"{len(self.data[key])} bytes, crc32c {crc32c(self.data[key]):08x}")
        if landed_then_fail:
            raise StoreUnavailable("transient error after the write", tier=self.tier, key=key)
        return ObjectMeta(key, len(self.data[key]))

    async def open_writer(self, key: str, options: PutOptions = PutOptions()) -> Any:
        raise NotImplementedError

    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        await self.sched.point(f"get {key}")
        self._read_fault(key)
        if key not in self.data:
            self.sched.note("missing")
            raise NotFound(key, tier=self.tier, key=key)
        self.sched.note(f"crc32c {crc32c(self.data[key]):08x}")
        return self.data[key][start:end]

    async def stat(self, key: str) -> ObjectMeta:
        await self.sched.point(f"stat {key}")
        self._read_fault(key)
        if key not in self.data:
            self.sched.note("missing")
            raise NotFound(key, tier=self.tier, key=key)
        self.sched.note(f"{len(self.data[key])} bytes")
        return ObjectMeta(key, len(self.data[key]), mtime=self.sched.now)

    async def list(  # type: ignore[override]
        self, prefix: str = "", *, recursive: bool = True, **_: Any
    ) -> AsyncIterator[ObjectMeta]:
        await self.sched.point(f"list {prefix}")
        self._read_fault(prefix)
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
        self.sched.note(" ".join(k[len(prefix) :] for k in out) or "none")
        if not out:
            raise NotFound(prefix, tier=self.tier, key=prefix)
        for m in out.values():
            yield m

    async def delete(self, key: str) -> None:
        await self.sched.point(f"delete {key}")
        landed_then_fail = self._fail(key)
        self.sched.note("deleted" if key in self.data else "absent")
        if key in self.data:
            self.on_delete(key)
            del self.data[key]
            self.sched.writes += 1
        if landed_then_fail:
            raise StoreUnavailable("transient error after the delete", tier=self.tier, key=key)

    def _read_fault(self, key: str) -> None:
        if self._fail(key):
            raise StoreUnavailable("transient error", tier=self.tier, key=key)

    async def copy(self, src: str, dst: str, options: PutOptions = PutOptions()) -> ObjectMeta:
        raise NotImplementedError


@functools.cache
def checkpoint(nodes: tuple[str, ...], step: int) -> tuple[bytes, dict[str, bytes]]:
    """A sharded checkpoint of ``nodes`` x one rank saved at ``step``: its manifest and its
    blobs by name."""
    from dataclasses import replace

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from fmstore.checkpoint.dcp.manifest import DcpBlob, DcpItem, DcpManifest, DcpPart
    from fmstore.format.manifest import ChunkEntry

    blobs, items, payloads = [], [], {}
    for r in range(len(nodes)):
        data = bytes([r + 1, step]) * (50 + r)
        name = f"{r:06d}.bin"
        payloads[name] = data
        blobs.append(DcpBlob(name, len(data), r))
        chunk = ChunkEntry(r, 0, len(data), 0, len(data), "raw", crc32c(data))
        items.append(DcpItem(f"x{r}", None, "bytes", "", (), len(data), (chunk,)))
    md = Metadata(state_dict_metadata={it.fqn: BytesStorageMetadata() for it in items})
    m = DcpManifest.from_metadata(
        md,
        generation=f"g{step:012d}-00000001",
        world_size=len(nodes),
        items=items,
        blobs=blobs,
        allow_pickle=False,
        writer="sim",
        parts=[DcpPart(n, (r,)) for r, n in enumerate(nodes)],
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


REVERTS = (  # every protection a test-only switch can take back
    "count",
    "supersede",
    "record",
    "retention",
    "release",
    "sweep",
    "unknown",
    "sweep-leases",
    "restore-unknown",
)


#: For the races: a seed at which each switch breaks an invariant, and which (``make test``
#: replays these; ``python tests/sim_parts.py --switches`` finds every switch from fresh
#: seeds).  The first from 0, but for ``sweep-leases`` (tens of thousands of schedules):
#: the seed a run of ``--switches`` found it at; ``-1`` while none is known (the seed it was
#: found at before the commit's looks for a retired record changed the schedules no longer
#: breaks it; ``--switches`` finds it again from fresh seeds).
FOUND_AT: dict[str, tuple[int, str]] = {
    "restore-unknown": (490, "I3"),
    "supersede": (119, "I2"),
    "sweep": (76, "I2"),
    "sweep-leases": (-1, "I2"),
}


def patches(revert: frozenset[str] = frozenset()) -> list[tuple[Any, str, Any]]:
    """(module, name, value) to set for a batch of schedules: the fakes, and each fix or
    protection of ``revert`` taken back (what the code would do without it)."""
    from dataclasses import replace

    gc = importlib.import_module("fmstore.checkpoint.gc")
    from fmstore.protocol import decisions as protocol
    from fmstore.tiering import tiers
    from fmstore.tiering.exports import parts
    from fmstore.tiering.inventory import catalog as cat
    from fmstore.tiering.policy import policies, sweep

    out: list[tuple[Any, str, Any]] = [
        # The copy engine (thread pools, multipart writers, journals on disk) is outside
        # the simulation: a byte-exact fake copies and verifies, one store call a blob.
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
    if "retention" in revert:  # retention blind to exports pending or in progress
        out += [(policies._Sources, "may_drop", lambda self, key, tier: True)]
    if "release" in revert:  # a release taking a copy being exported for a verified one
        real = policies.plan_release

        def loose_release(p: Any, s: Any, *, after_deletes: Any = ()) -> Any:
            seen = [
                replace(c, state=cat.PRESENT, verified=s.now) if c.state == cat.EXPORTING else c
                for c in s.copies
            ]
            return real(p, replace(s, copies=seen), after_deletes=after_deletes)

        out += [(policies, "plan_release", loose_release)]
    if "sweep" in revert:  # the sweep blind to export leases
        out += [(gc, "_live_lease", _no_lease)]
    if "unknown" in revert:  # a lease the sweep cannot read taken for no lease
        out += [(gc, "_live_lease", _readable_leases)]
    if "sweep-leases" in revert:  # the sweep deleting leases with the records, unread
        out += [(sweep, "remove_generation", _remove_leases_first)]
    if "restore-unknown" in revert:  # a restore's read error taken for "no checkpoint"
        from fmstore.protocol import problems

        out += [(problems, "code_of", _any_not_found_is_absent)]
    return out


def _any_not_found_is_absent(e: BaseException) -> Any:
    """How a load without a process group coded its failures before the fix: any
    NotFound as no manifest, anything else (a read error included) as unusable."""
    from fmstore.protocol.problems import Code, fmstore_error

    return Code.NO_MANIFEST if isinstance(fmstore_error(e), NotFound) else Code.UNUSABLE


async def _remove_leases_first(store: Store, g: Any, env: Env) -> bool:
    """The orphan sweep's removal before the simulation's seed 2666: the records and
    leases of the scan deleted first (a lease renewed since included), then the leases
    left looked at."""
    from fmstore.checkpoint.gc import _generation_of, _live_lease
    from fmstore.protocol.records import LEASE_RE

    if g.records:
        await store.delete_many(g.records)
        prefix, _, gen = g.where.rpartition("/")
        leases = [
            m.key
            async for m in store.list(f"{g.where}/", recursive=False)
            if LEASE_RE.match(m.key.rsplit("/", 1)[-1])
        ]
        if await _live_lease(store, leases, env):
            return False
        try:
            if _generation_of(await store.get(f"{prefix}/{MANIFEST_KEY}")) == gen:
                return False
        except NotFound:
            pass
        except Exception:
            return False
    await store.delete_many([k for k in g.keys if k not in g.records])
    return True


async def _no_lease(store: Store, keys: list[str], env: Env) -> bool:
    return False


async def _readable_leases(store: Store, keys: list[str], env: Env) -> bool:
    from fmstore.errors import FmstoreError
    from fmstore.protocol.records import LEASE_RE, ExportLease

    for key in keys:
        if LEASE_RE.match(key.rsplit("/", 1)[-1]):
            with contextlib.suppress(FmstoreError):
                if ExportLease.loads(await store.get(key), where=key).alive(env):
                    return True
    return False


@dataclass
class Outcome:
    seed: int
    steps: int
    trace: list[str]


STEPS = (10, 20)
#: The shapes a schedule draws (swarm testing, as FoundationDB's buggify and TigerBeetle's
#: VOPR): which actors run and which of their calls are slow; docs/distributed.md.
AIMS = ("mixed", "commit", "sweep", "restore")
ALL_NODES = ("n0", "n1", "n2")


@functools.cache
def _setup() -> tuple[Any, Any]:
    """The configuration of every node (a shared tier and a node-local one) and the
    policies: export every step, keep_latest (set per schedule) on both tiers, release the
    node-local copy once a verified one is on the shared tier."""
    from fmstore.config import from_dict
    from fmstore.tiering.policy.rules import ExportRule, Policies, ReleaseRule

    config = from_dict(
        {
            "tiers": {
                "lustre": {"url": "/nonexistent/lustre"},
                "nvme": {"url": "/nonexistent/nvme", "scope": "node"},
            }
        }
    )
    pol = Policies(
        ladder=("nvme", "lustre"),
        write_tier="nvme",
        exports=(ExportRule(to="lustre", every_steps=10),),
        release={"nvme": ReleaseRule(after=0.0, durable=("lustre",))},
        node_tiers=("nvme",),
    )
    return config, pol


class World:
    """One schedule's stores, nodes and node catalogs."""

    def __init__(self, seed: int, rng: random.Random, sched: Scheduler, aim: str) -> None:
        from fmstore.tiering.inventory import catalog as cat
        from fmstore.tiering.tiers import Tiers

        self.seed = seed
        self.sched = sched
        self.nodes = ALL_NODES[: rng.choice((2, 3))]
        self.keep = 1 if aim == "commit" else rng.choice((1, 2))
        self.flaky = rng.choice(
            (0.03, 0.1, 0.3) if aim == "restore" else (0.0, 0.0, 0.03, 0.1, 0.3)
        )
        self.saves = {st: checkpoint(self.nodes, st) for st in STEPS}
        self.gens = {st: json.loads(m)["generation"] for st, (m, _) in self.saves.items()}
        self.shared = SimStore("lustre", sched, self._on_delete, self.flaky)
        self.nvme: dict[str, SimStore] = {}
        self.tiers: dict[str, Tiers] = {}
        #: Each node's protocol environment (its clock, id and process), held by its
        #: ``Tiers`` and handed to its exporter and sweeps.
        self.env: dict[str, Env] = {}
        #: Each node's catalog of the shared tier's copies: step -> (state, verified).
        self.cat: dict[str, dict[int, tuple[str, bool]]] = {}
        config, _ = _setup()
        for r, n in enumerate(self.nodes):
            st = SimStore(f"nvme-{n}", sched, lambda k: None, self.flaky)
            for step, (m, payloads) in self.saves.items():
                ck = checkpoint_key(ROOT, step)
                st.data[f"{ck}/{MANIFEST_KEY}"] = m
                name = f"{r:06d}.bin"
                st.data[f"{ck}/{self.gens[step]}/{name}"] = payloads[name]
            self.nvme[n] = st
            self.env[n] = sched.env(n)
            t = Tiers(config, env=self.env[n])
            t._stores["lustre"] = self.shared
            t._stores["nvme"] = st
            self.tiers[n] = t
            self.cat[n] = {step: (cat.EXPORTING, False) for step in STEPS}
        self.counted: list[int] = []

        # The keys the oracles look at, made once (they run after every store call).
        self.mkey = {st: f"{checkpoint_key(ROOT, st)}/{MANIFEST_KEY}" for st in STEPS}
        self.blobs = {st: self.blob_keys(st) for st in STEPS}
        self.parts = {
            st: [
                (
                    self.nvme[n].data,
                    f"{checkpoint_key(ROOT, st)}/{self.gens[st]}/{r:06d}.bin",
                    self.saves[st][1][f"{r:06d}.bin"],
                )
                for r, n in enumerate(self.nodes)
            ]
            for st in STEPS
        }
        self.checked = -1

    def blob_keys(self, step: int) -> dict[str, bytes]:
        ck, gen = checkpoint_key(ROOT, step), self.gens[step]
        return {f"{ck}/{gen}/{n}": d for n, d in self.saves[step][1].items()}

    def _on_delete(self, key: str) -> None:
        for step in STEPS:
            m = self.shared.data.get(self.mkey[step])
            if m == self.saves[step][0] and key in self.blobs[step]:
                raise Violation(f"I4: {key} deleted from a committed checkpoint (seed {self.seed})")

    def shared_holds(self, step: int) -> bool:
        data = self.shared.data
        if data.get(self.mkey[step]) != self.saves[step][0]:
            return False
        return all(data.get(k) == d for k, d in self.blobs[step].items())

    def nodes_hold(self, step: int) -> bool:
        m, key = self.saves[step][0], self.mkey[step]
        return all(
            data.get(key) == m and data.get(blob) == payload
            for data, blob, payload in self.parts[step]
        )

    def oracles(self) -> None:
        if set(self.counted) - set(STEPS):
            raise Violation(
                f"I1: steps {sorted(set(self.counted))} counted as committed (seed {self.seed})"
            )
        writes = self.sched.writes
        if writes == self.checked:
            return  # nothing written or deleted since the last look
        self.checked = writes
        for step in STEPS:
            m = self.shared.data.get(self.mkey[step])
            if m == self.saves[step][0] and not self.shared_holds(step):
                raise Violation(
                    f"I2: the manifest of step {step} on lustre lists blobs not there "
                    f"(seed {self.seed})"
                )
        for step in sorted(STEPS)[-self.keep :]:
            if not (self.shared_holds(step) or self.nodes_hold(step)):
                raise Violation(
                    f"I1: step {step}, among the {self.keep} newest verified, is restorable "
                    f"from no tier (seed {self.seed})"
                )


async def _schedule(seed: int, start: float = START) -> Outcome:
    from fmstore.errors import FmstoreError
    from fmstore.tiering.exports.mover import CHECKPOINT_COPY

    rng = random.Random(seed)
    aim = rng.choice(AIMS)
    offsets = {n: rng.uniform(-CLOCK_SKEW / 2, CLOCK_SKEW / 2) for n in ALL_NODES}
    sched = Scheduler(rng, offsets, now=start, start=start)
    w = World(seed, rng, sched, aim)
    if rng.random() < 0.5:
        sched.prio = {}
        sched.drops = frozenset(rng.randrange(150) for _ in range(rng.randint(1, 3)))
        sched.trace.append(f"  (by priority, drops after steps {sorted(sched.drops)})")
    # Swarm: a schedule leaves out some of what the daemons do and sweeps at its own rate
    # (fewer kinds of work in one schedule: more of each interleaving of the rest).
    plans = rng.random() < 0.7  # retention and release passes
    sweeps = rng.choice((0.0, 0.4, 0.9))
    sched.slow = rng.choice((0.0, 0.1, 0.3))
    super_node = rng.choice(w.nodes)
    actors = {"exporters", "daemons", "stranger", "job"}
    manifest = f"/{MANIFEST_KEY}"
    if aim == "commit":
        # A superseder and the others' commits of one generation together: slow, the
        # others' part records (written after the superseder's export looked) and
        # manifests, and the superseder's removal of its record (``delete_own_part``).
        plans, sweeps, actors = False, 0.0, {"exporters"}
        others = [n for n in w.nodes if n != super_node]
        sched.aimed = (
            (frozenset(others), "put ", manifest),
            (frozenset([super_node]), "delete ", f"/part-{super_node}.json"),
            *[(frozenset([n]), "put ", f"/part-{n}.json") for n in others],
        )
    elif aim == "sweep":  # sweeps while exports are between their records and manifest
        plans, sweeps, actors = False, 0.9, {"exporters", "daemons", "stranger"}
        sched.aimed = ((frozenset(w.nodes), "put ", manifest),)
    elif aim == "restore":  # the job looking after the exports, on a flaky shared tier
        sweeps, actors = 0.0, {"exporters", "daemons", "job"}
        sched.aimed = ((frozenset(["job"]), "", ""),)
    sched.trace.append(
        f"  (aim: {aim}, retention passes: {plans}, sweeps at {sweeps}, slow: {sched.slow})"
    )

    async def exporter(node: str) -> None:
        from fmstore.tiering.exports.parts import delete_own_part, export_part
        from fmstore.tiering.inventory import catalog as cat

        for step in STEPS:
            ck = checkpoint_key(ROOT, step)
            src, dst = w.nvme[node].sub(ck), w.shared.sub(ck)
            for _ in range(rng.randint(1, 2)):
                try:
                    res = await export_part(
                        src, dst, node, options=CHECKPOINT_COPY, env=w.env[node]
                    )
                except FmstoreError:
                    continue  # the policy runner retries at its next step
                if not res.waiting_for:
                    w.cat[node][step] = (cat.PRESENT, bool(res.check and res.check.ok))
                    break
            else:
                if node == super_node and step == STEPS[0] and w.keep == 1:
                    # Superseded: a newer step is wanted and retention would not keep this.
                    w.cat[node][step] = (cat.SUPERSEDED, False)
                    with contextlib.suppress(FmstoreError):
                        await delete_own_part(dst, node, src, env=w.env[node])

    async def daemon(node: str) -> None:
        from fmstore.tiering.policy.sweep import Sweeper

        for _ in range(rng.randint(1, 4)):
            if plans:
                with contextlib.suppress(FmstoreError):  # the daemon backs off, tries later
                    await _retention_and_release(w, node, rng.random() < 0.3)
            if rng.random() < sweeps:
                sweeper = Sweeper("/nonexistent/state", grace=0.0, env=w.env[node])
                await sweeper.tier("lustre", w.shared)

    async def stranger() -> None:
        gen, m = w.gens[STEPS[0]], w.saves[STEPS[0]][0]
        ck = checkpoint_key(ROOT, STEPS[0])
        if rng.random() < 0.5:
            n = rng.choice(w.nodes)
            rec = PartRecord(n, (w.nodes.index(n),), gen, manifest_sha256(m), (), sched.now)
            await w.shared.put(f"{ck}/{part_record_key(gen, n)}", rec.dumps())
        if rng.random() < 0.5:
            junk = rng.choice((b"", b"{}", b'{"format": "fmstore-dcp", "version": 2}'))
            await w.shared.put(f"{checkpoint_key(ROOT, STEPS[-1] + 10)}/{MANIFEST_KEY}", junk)

    async def restorer() -> None:
        """The job restarting, once or more while the rest goes on: every node looks at
        each candidate on the shared tier, newest first (the manifest, with the real
        reader); the real decision (``problems.code_of``, ``first``, ``next_move``)
        loads it, passes it over, looks again or raises.  I3: a candidate passed over
        was not committed when it was looked at."""
        from fmstore.checkpoint.dcp.collective import UNKNOWN_TRIES
        from fmstore.checkpoint.dcp.reader import read_manifest
        from fmstore.protocol import problems

        for _ in range(rng.randint(1, 3)):
            for step in sorted(STEPS, reverse=True):
                src, looks = w.shared.sub(checkpoint_key(ROOT, step)), 0
                while True:
                    looks += 1
                    held = w.shared_holds(step)
                    seen: list[problems.Problem | None] = []
                    for _node in w.nodes:
                        try:
                            await read_manifest(src)
                            seen.append(None)
                        except FmstoreError as e:
                            seen.append(problems.Problem(problems.code_of(e), problems.reason(e)))
                    held = held and w.shared_holds(step)
                    move = problems.next_move(problems.first(seen), looks, UNKNOWN_TRIES)
                    if move is not problems.Move.LOOK_AGAIN:
                        break
                if move is problems.Move.NEXT and held:
                    raise Violation(
                        f"I3: step {step}, committed on lustre, passed over for an older "
                        f"one or none ({problems.first(seen)}) (seed {seed})"
                    )
                if move is not problems.Move.NEXT:
                    break  # loaded, or raised: the job tries again later

    async def as_actor(name: str, coro: Any) -> None:
        _actor.set(name)
        # A refusal the real code reports (CorruptData, ...): the protocol's to survive.
        with contextlib.suppress(FmstoreError):
            await coro

    plan: dict[str, Any] = {}
    for n in w.nodes:
        plan[n] = exporter(n)
        if "daemons" in actors:
            plan[f"{n}:daemon"] = daemon(n)
    if "stranger" in actors:
        plan["stranger"] = stranger()
    if "job" in actors:
        plan["job"] = restorer()
    tasks = [asyncio.create_task(as_actor(k, c), name=k) for k, c in plan.items()]
    kill = rng.choice([None, *w.nodes]) if rng.random() < 0.3 else None
    kill_at = rng.randint(1, 60)
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
                sched.trace.append(f"  (node {kill} killed)")
                for t in tasks:
                    if t.get_name().split(":")[0] == kill:
                        t.cancel()  # killed between two store calls
                sched.parked = [c for c in sched.parked if c.actor.split(":")[0] != kill]
            w.oracles()
        w.oracles()
    except Violation as e:
        e.trace = sched.trace  # type: ignore[attr-defined]  # the schedule, to read
        raise
    finally:
        for t in tasks:
            t.cancel()
    return Outcome(seed, sched.steps, sched.trace)


async def _retention_and_release(w: World, node: str, rescan_local: bool) -> None:
    """One pass of ``node``'s daemon: rescan the shared tier (and this node's), plan
    retention and release from what its catalog and the rescans say (the real planners),
    and remove each chosen copy with the real removal (:func:`delete_checkpoint`)."""
    from dataclasses import replace

    from fmstore.tiering.exports.mover import delete_checkpoint
    from fmstore.tiering.inventory import catalog as cat
    from fmstore.tiering.policy import policies
    from fmstore.tiering.policy.rules import RetentionRule

    t = w.tiers[node]
    shared = await t.committed_facts("lustre", ROOT)
    w.counted.extend(shared)
    local = await t.committed_facts("nvme", ROOT)
    now = w.env[node].now()
    steps = sorted(set(STEPS) | set(shared))
    ckpts = [cat.Checkpoint(ROOT, st, i + 1, 1_000_000.0, 0, None) for i, st in enumerate(steps)]
    copies = [
        cat.Copy(ROOT, st, "nvme", cat.PRESENT, 0, 1_000_000.0, now, None, now) for st in local
    ]
    for st in steps:
        state, verified = w.cat[node].get(st, (cat.PRESENT, False))
        if st in shared:
            state = cat.PRESENT
        elif state == cat.PRESENT:
            continue  # gone from the tier since
        v = now if verified and state == cat.PRESENT else None
        copies.append(cat.Copy(ROOT, st, "lustre", state, 0, 1_000_000.0, now, None, v))
    _, pol = _setup()
    # Each node keeps its newest part; the shared tier keeps w.keep (1 or 2) steps.
    keep = {"nvme": RetentionRule(keep_latest=1), "lustre": RetentionRule(keep_latest=w.keep)}
    pol = replace(pol, retention=keep)
    s = policies.State(ckpts, copies, now=now)
    deletes = policies.plan_retention(pol, s)
    actions = [*deletes, *policies.plan_release(pol, s, after_deletes=deletes)]
    for a in actions:
        store = w.nvme[node] if a.tier == "nvme" else w.shared
        await delete_checkpoint(store.sub(checkpoint_key(ROOT, a.step)))
        if a.tier == "lustre":
            w.cat[node][a.step] = (cat.DELETED, False)


def run(seed: int, revert: frozenset[str] = frozenset(), *, start: float = START) -> Outcome:
    """One schedule, replayable from its seed alone (its virtual clock from ``start``)."""
    return search([seed], revert, start=start)[0]


def search(
    seeds: Any,
    revert: frozenset[str] = frozenset(),
    *,
    deadline: float | None = None,
    start: float = START,
) -> list[Outcome]:
    """Run the schedules of ``seeds`` (stopping at ``deadline``, ``time.monotonic()``),
    raising :class:`Violation` at the first that breaks an invariant.  Searches may run in
    several threads at once (each schedule's clocks and nodes are its own, through its
    :class:`Env`); those with different switches take turns (:func:`_patched`)."""
    import logging
    import time

    logging.getLogger("fmstore.sweep").setLevel(logging.CRITICAL)  # its report says it all
    done: list[Outcome] = []
    with _patched(revert):
        for seed in seeds:
            if deadline is not None and time.monotonic() > deadline:
                break
            done.append(asyncio.run(_schedule(seed, start)))
    return done


#: What :func:`patches` set, while any search runs: the switches in force and how many
#: searches use them (searches with the same switches share them; others wait).
_patch_turn = threading.Condition()
_patch_state: dict[str, Any] = {"revert": None, "users": 0, "undo": []}


@contextlib.contextmanager
def _patched(revert: frozenset[str]) -> Iterator[None]:
    """The module attributes :func:`patches` names set for the searches with switches
    ``revert``.  The only globals the simulation sets: the copy engine's fake, and the
    test-only switches that take a protection back (code, not environment: every
    schedule of a search runs the same code)."""
    st = _patch_state
    with _patch_turn:
        while st["users"] and st["revert"] != revert:
            _patch_turn.wait()
        if not st["users"]:
            undo = []
            for mod, name, value in patches(revert):
                undo.append((mod, name, getattr(mod, name)))
                setattr(mod, name, value)
            st["revert"], st["undo"] = revert, undo
        st["users"] += 1
    try:
        yield
    finally:
        with _patch_turn:
            st["users"] -= 1
            if not st["users"]:
                for mod, name, value in reversed(st["undo"]):
                    setattr(mod, name, value)
                st["revert"], st["undo"] = None, []
                _patch_turn.notify_all()


def find_switches(limit: int = 50_000) -> int:
    """Each switch searched from fresh seeds until the search finds what it prevents;
    prints after how many schedules.  1 when one is not found within ``limit``."""
    import re

    missed = 0
    for revert in REVERTS:
        if revert == "unknown":
            continue  # its fix made it harmless: nothing to find (docs/distributed.md)
        start = random.SystemRandom().randrange(1 << 40)
        n = 0
        try:
            while n < limit:
                batch = range(start + n, start + min(n + 500, limit))
                n += len(search(batch, frozenset([revert])))
            print(f"{revert}: not found in {limit} schedules (seeds from {start})", flush=True)
            missed += 1
        except Violation as e:
            got = re.search(r"seed (\d+)", str(e))
            at = int(got.group(1)) - start + 1 if got else -1
            print(f"{revert}: found after {at} schedules: {e}", flush=True)
    return 1 if missed else 0


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

    sys.exit(find_switches() if "--switches" in sys.argv[1:] else main())
