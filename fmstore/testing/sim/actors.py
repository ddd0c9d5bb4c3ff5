"""The simulation's actors: each node's exporter and daemon (rescans, retention and
release, the orphan sweep), a stranger writing what no node should, and the job
restarting; each runs the real code with its node's :class:`~fmstore.protocol.env.Env`."""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace

from ...checkpoint.layout import checkpoint_key
from ...errors import FmstoreError
from ...format.manifest import MANIFEST_KEY
from ...protocol.records import PartRecord, manifest_sha256, part_record_key
from ...tiering.exports.mover import CHECKPOINT_COPY, delete_checkpoint
from ...tiering.exports.parts import delete_own_part, export_part
from ...tiering.inventory import catalog as cat
from ...tiering.policy import policies
from ...tiering.policy.rules import RetentionRule
from ...tiering.policy.sweep import Sweeper
from .scheduler import Violation
from .world import ROOT, STEPS, World, setup

__all__ = ["Actors", "retention_and_release"]


class Actors:
    """One schedule's actors over world ``w``, drawing from ``rng``: ``super_node`` may
    supersede its first export; daemons plan retention and release when ``plans`` and
    sweep at the rate ``sweeps``."""

    def __init__(
        self, w: World, rng: random.Random, super_node: str, plans: bool, sweeps: float
    ) -> None:
        self.w, self.rng, self.super_node = w, rng, super_node
        self.plans, self.sweeps = plans, sweeps

    async def exporter(self, node: str) -> None:
        w, rng, super_node = self.w, self.rng, self.super_node
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

    async def daemon(self, node: str) -> None:
        w, rng, plans, sweeps = self.w, self.rng, self.plans, self.sweeps
        for _ in range(rng.randint(1, 4)):
            if plans:
                with contextlib.suppress(FmstoreError):  # the daemon backs off, tries later
                    await retention_and_release(w, node, rng.random() < 0.3)
            if rng.random() < sweeps:
                sweeper = Sweeper("/nonexistent/state", grace=0.0, env=w.env[node])
                await sweeper.tier("lustre", w.shared)

    async def stranger(self) -> None:
        w, rng, sched = self.w, self.rng, self.w.sched
        gen, m = w.gens[STEPS[0]], w.saves[STEPS[0]][0]
        ck = checkpoint_key(ROOT, STEPS[0])
        if rng.random() < 0.5:
            n = rng.choice(w.nodes)
            rec = PartRecord(n, (w.nodes.index(n),), gen, manifest_sha256(m), (), sched.now)
            await w.shared.put(f"{ck}/{part_record_key(gen, n)}", rec.dumps())
        if rng.random() < 0.5:
            junk = rng.choice((b"", b"{}", b'{"format": "fmstore-dcp", "version": 2}'))
            await w.shared.put(f"{checkpoint_key(ROOT, STEPS[-1] + 10)}/{MANIFEST_KEY}", junk)

    async def restorer(self) -> None:
        """The job restarting, once or more while the rest goes on: every node looks at
        each candidate on the shared tier, newest first (the manifest, with the real
        reader); the real decision (``problems.code_of``, ``first``, ``next_move``)
        loads it, passes it over, looks again or raises.  I3: a candidate passed over
        was not committed when it was looked at."""
        w, rng, seed = self.w, self.rng, self.w.seed
        from ...checkpoint.dcp.collective import UNKNOWN_TRIES
        from ...checkpoint.dcp.reader import read_manifest
        from ...protocol import problems

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


async def retention_and_release(w: World, node: str, rescan_local: bool) -> None:
    """One pass of ``node``'s daemon: rescan the shared tier (and this node's), plan
    retention and release from what its catalog and the rescans say (the real planners),
    and remove each chosen copy with the real removal (:func:`delete_checkpoint`)."""

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
    pol = setup()[1]
    # Each node keeps its newest part; the shared tier keeps w.keep (1 or 2) steps.
    keep = {"nvme": RetentionRule(keep_latest=1), "lustre": RetentionRule(keep_latest=w.keep)}
    pol = replace(pol, retention=keep)
    s = policies.State(ckpts, copies, now=now)
    deletes = policies.plan_retention(pol, s)
    actions: list[policies.Delete | policies.Release] = [
        *deletes,
        *policies.plan_release(pol, s, after_deletes=deletes),
    ]
    for a in actions:
        store = w.nvme[node] if a.tier == "nvme" else w.shared
        await delete_checkpoint(store.sub(checkpoint_key(ROOT, a.step)))
        if a.tier == "lustre":
            w.cat[node][a.step] = (cat.DELETED, False)
