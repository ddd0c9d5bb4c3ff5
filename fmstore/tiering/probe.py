"""Prove each tier usable as configured, before anything is trusted to it.

``fmstore daemon --check``, the daemon at start and a training process's policy helper at
start run :func:`probe_tiers` over every tier of the ladder:

* **read** (every tier: restores and exports read them): list the tier's root, which needs
  the server to answer, the bucket to exist and the credentials to be accepted;
* **write** (the tiers the policies write to: the write tier, its fallbacks, export
  destinations, the restore cache, tiers with retention or release): put a tiny object
  under :data:`PROBE_PREFIX` at the tier's root, read it back and delete it.  The prefix is
  one of fmstore's reserved names (``.fmstore…``) that discovery, ``ls`` and ``stage`` skip;
  one left by a process killed half-way is removed by a later probe after an hour.

Each failure is a :class:`TierProblem` naming the tier, what failed and the setting to fix.
A missing root directory of a local tier is not a failure where nothing writes (reads find
nothing, as on an empty prefix); where the policies write, the probe creates it, as the
first save would.

**Once per node**: at scale every rank starts a helper, and thousands of probe writes on one
prefix would be a load of their own, so :func:`probe_once_per_node` takes a file lock in the
state directory (one per node), and a process finding a fresh result there
(``probe.json``, younger than :data:`PROBE_TTL` and for the same tiers and policies) reuses
it instead of probing again.  The result is keyed by the tiers, the policies and a SHA-256
of the credentials each S3 tier resolves to (never the secret itself): a probe with a wrong
secret does not stand for processes with the right keys, nor a good one for bad keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field

import filelock

from .. import runtime
from ..config import Config
from ..errors import (
    ConfigError,
    FmstoreError,
    NotFound,
    PermissionDenied,
    StoreUnavailable,
    TierFull,
)
from ..protocol.skew import clock_offset
from ..stores.base import Store
from .credentials import credentials_digest
from .policy.rules import Policies
from .tiers import Tiers

#: Where probe objects go, at each tier's root (skipped by discovery, ``ls`` and ``stage``).
PROBE_PREFIX = ".fmstore-probe"
#: How long one process's probe result stands for every other process of the node.
PROBE_TTL = 600.0
#: Probe objects older than this are leftovers of killed processes (removed by the next probe).
STALE_AFTER = 3600.0
MARKER_NAME = "probe.json"
LOCK_NAME = "probe.lock"


@dataclass(frozen=True)
class TierProblem:
    """One way a tier is not usable: ``check`` is ``read`` or ``write``."""

    tier: str
    check: str
    error: str
    fix: str

    def describe(self) -> str:
        return f"tier {self.tier}: {self.check} failed: {self.error}; fix: {self.fix}"


@dataclass
class ProbeReport:
    """The problems found (none: every tier usable), which checks ran on each tier,
    when, and whether this result was probed by another process of the node."""

    problems: list[TierProblem] = field(default_factory=list)
    checked: dict[str, list[str]] = field(default_factory=dict)
    #: shared tier -> its clock minus this node's, in seconds, from the modification time
    #: the probe write got (:func:`.skew.clock_offset`; 0: within the write's duration)
    clock: dict[str, float] = field(default_factory=dict)
    at: float = 0.0
    cached: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


def tier_uses(policies: Policies) -> dict[str, set[str]]:
    """Tier -> the checks it needs (``read``; ``write`` where the policies write)."""
    uses = {t: {"read"} for t in policies.ladder}
    written = {policies.write_tier, *(e.to for e in policies.exports)}
    written |= set(policies.retention) | set(policies.release)
    if policies.restore.cache_tier:
        written.add(policies.restore.cache_tier)
    if policies.on_full == "fallback":
        written |= set(policies.ladder[policies.rank(policies.write_tier) :])
    for t in written:
        uses.setdefault(t, {"read"}).add("write")
    return uses


def _fix(config: Config, tier: str, e: FmstoreError, check: str) -> str:
    t = config.tier(tier)
    url = f"[tiers.{tier}] url = {t.url!r}"
    s3 = t.url.startswith("s3://")
    if isinstance(e, NotFound):
        if s3:
            return f"{url}: its bucket does not exist (check the spelling, or create it)"
        return f"{url}: the directory does not exist (is the file system mounted?)"
    if isinstance(e, PermissionDenied):
        if s3:
            ops = "writes and deletes" if check == "write" else "listing and reads"
            return (
                f"the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE, [tiers.{tier}] profile) "
                f"or the bucket's policy: they must allow {ops} under {t.url}"
            )
        return f"{url}: the directory must be {check}able by this user"
    if isinstance(e, StoreUnavailable):
        if s3:
            ep = t.options.get("endpoint_url")
            where = f"endpoint_url = {ep!r}" if ep else "region / endpoint_url"
            return f"[tiers.{tier}] (or [s3]) {where}: the server must be reachable"
        return f"{url}: the file system must be mounted and answering"
    if isinstance(e, TierFull):
        return f"free space on tier {tier}"
    return f"{url} and its options"


async def _probe_tier(
    config: Config, tier: str, store: Store, checks: set[str], clock: dict[str, float]
) -> list[TierProblem]:
    local = store.local_root is not None
    try:
        async for _ in store.list("", recursive=False):
            break
    except FmstoreError as e:
        if not (local and isinstance(e, NotFound)):
            return [TierProblem(tier, "read", str(e), _fix(config, tier, e, "read"))]
    if "write" not in checks:
        return []
    key = f"{PROBE_PREFIX}/{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    data = b"fmstore tier probe\n"
    try:
        before = time.time()
        await store.put(key, data)
        after = time.time()
    except FmstoreError as e:
        return [TierProblem(tier, "write", str(e), _fix(config, tier, e, "write"))]
    problems = []
    if config.tier(tier).scope != "node":  # a shared tier's times: the other nodes' view
        with contextlib.suppress(FmstoreError):
            mtime = (await store.stat(key)).mtime
            clock[tier] = clock_offset(before, after, mtime, resolution=1.0)
    try:
        if await store.get(key) != data:
            problems.append(
                TierProblem(tier, "read", f"probe object {key!r} read back changed", "the tier")
            )
    except FmstoreError as e:
        problems.append(TierProblem(tier, "read", str(e), _fix(config, tier, e, "read")))
    try:
        await store.delete(key)
    except FmstoreError as e:
        problems.append(TierProblem(tier, "write", str(e), _fix(config, tier, e, "write")))
    with contextlib.suppress(FmstoreError):  # housekeeping: never a problem of the tier
        await _remove_stale(store)
    return problems


async def _remove_stale(store: Store) -> None:
    """Probe objects of processes killed between the write and the delete: removed once
    they are :data:`STALE_AFTER` old (a live probe lasts milliseconds)."""
    now = time.time()
    stale = [
        m.key
        async for m in store.list(PROBE_PREFIX + "/")
        if not m.is_dir and m.mtime is not None and now - m.mtime > STALE_AFTER
    ]
    if stale:
        await store.delete_many(stale)


async def aprobe_tiers(config: Config, policies: Policies, tiers: Tiers) -> ProbeReport:
    rep = ProbeReport(at=time.time())
    for tier, checks in tier_uses(policies).items():
        rep.checked[tier] = sorted(checks)
        try:
            store = tiers.store(tier)
        except FmstoreError as e:
            rep.problems.append(TierProblem(tier, "read", str(e), _fix(config, tier, e, "read")))
            continue
        rep.problems.extend(await _probe_tier(config, tier, store, checks, rep.clock))
    return rep


def probe_tiers(config: Config, policies: Policies, tiers: Tiers | None = None) -> ProbeReport:
    """Probe every tier the policies use (sync facade); ``tiers``: stores to reuse (else
    opened and closed here)."""
    if tiers is not None:
        return runtime.run(aprobe_tiers(config, policies, tiers))
    own = Tiers(config)

    async def run() -> ProbeReport:
        try:
            return await aprobe_tiers(config, policies, own)
        finally:
            await own.close()

    return runtime.run(run())


def _fingerprint(config: Config, policies: Policies) -> str:
    """What a probe's result depends on: the tiers, the checks, each tier's options (a
    secret among them only as part of this digest) and the S3 credentials the process
    resolves (:func:`.credentials.credentials_digest`): a process with other keys probes
    again, whatever another process found with its own."""
    uses = {t: sorted(c) for t, c in tier_uses(policies).items()}
    tiers = {
        t: [
            config.tier(t).url,
            sorted(map(str, config.tier(t).options.items())),
            credentials_digest(config, t),
        ]
        for t in uses
    }
    return hashlib.sha256(json.dumps([uses, tiers], sort_keys=True).encode()).hexdigest()


def probe_once_per_node(
    config: Config,
    policies: Policies,
    tiers: Tiers | None = None,
    *,
    max_age: float = PROBE_TTL,
    force: bool = False,
) -> ProbeReport:
    """:func:`probe_tiers`, run by one process of the node at a time: a result another
    process wrote less than ``max_age`` seconds ago for the same tiers and policies is
    returned (``cached``) instead of probing again, unless ``force``."""
    try:
        os.makedirs(config.state_dir, exist_ok=True)
        lock = filelock.FileLock(os.path.join(config.state_dir, LOCK_NAME))
        lock.acquire()
    except OSError as e:
        raise ConfigError(
            f"cannot use the state directory {config.state_dir!r}: {e.strerror or e}"
        ) from None
    marker = os.path.join(config.state_dir, MARKER_NAME)
    fp = _fingerprint(config, policies)
    try:
        if not force:
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                with open(marker) as f:
                    doc = json.load(f)
                if doc["fingerprint"] == fp and 0 <= time.time() - doc["at"] < max_age:
                    return ProbeReport(
                        problems=[TierProblem(**p) for p in doc["problems"]],
                        checked=doc["checked"],
                        clock=doc.get("clock", {}),
                        at=doc["at"],
                        cached=True,
                    )
        rep = probe_tiers(config, policies, tiers)
        doc = {
            "fingerprint": fp,
            "at": rep.at,
            "checked": rep.checked,
            "clock": rep.clock,
            "problems": [asdict(p) for p in rep.problems],
        }
        tmp = f"{marker}.{os.getpid()}.tmp"
        with contextlib.suppress(OSError):  # without a marker, the next process probes too
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, marker)
        return rep
    finally:
        lock.release()
