"""The switches of the deterministic simulation (:mod:`fmstore.testing.sim`): each takes one
of the protocol's protections back, so that a search shows it finds what the protection
prevents; and ``make test-sim`` (``python tests/sim_parts.py``; ``--switches`` searches each
switch from fresh seeds).

The simulation sets no module global for a schedule's clocks, nodes, processes or lease
settings (each node's :class:`~fmstore.protocol.env.Env` carries them).  What it still
sets while a search runs is code: the copy engine's byte-exact fake
(:func:`fmstore.testing.sim.fakes`: the real engine's thread pools, multipart writers and
on-disk journals are outside the simulation) and, for a search with switches, the
functions :func:`patches` names.

A failing schedule raises :class:`Violation` naming the seed; ``run(seed)`` replays it.
"""

from __future__ import annotations

import contextlib
import importlib
import random
from dataclasses import replace
from typing import Any

from fmstore.errors import NotFound
from fmstore.format.manifest import MANIFEST_KEY
from fmstore.protocol.env import Env
from fmstore.stores.base import Store
from fmstore.testing import sim
from fmstore.testing.sim import START, Outcome, Violation

__all__ = ["FOUND_AT", "REVERTS", "START", "Outcome", "Violation", "patches", "run", "search"]


def run(seed: int, revert: frozenset[str] = frozenset(), *, start: float = START) -> Outcome:
    """One schedule, replayable from its seed and switches alone."""
    return search([seed], revert, start=start)[0]


def search(
    seeds: Any,
    revert: frozenset[str] = frozenset(),
    *,
    deadline: float | None = None,
    start: float = START,
) -> list[Outcome]:
    """:func:`fmstore.testing.sim.search` with the switches of ``revert`` set."""
    return sim.search(seeds, patches(revert), key=revert, deadline=deadline, start=start)


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
    """(module, name, value) to set for a batch of schedules: each fix or protection of
    ``revert`` taken back (what the code would do without it)."""
    gc = importlib.import_module("fmstore.checkpoint.gc")
    from fmstore.protocol import decisions as protocol
    from fmstore.tiering import tiers
    from fmstore.tiering.exports import parts
    from fmstore.tiering.inventory import catalog as cat
    from fmstore.tiering.policy import policies, sweep

    out: list[tuple[Any, str, Any]] = []
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
