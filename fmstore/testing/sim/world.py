"""One schedule's world: its nodes, their stores, tiers and protocol environments, the
checkpoints they saved, and what each node's catalog says of the shared tier."""

from __future__ import annotations

import functools
import json
import random

from ...checkpoint.layout import checkpoint_key
from ...config import Config, from_dict
from ...format.manifest import MANIFEST_KEY
from ...protocol.env import Env
from ...tiering.policy.rules import ExportRule, Policies, ReleaseRule
from .oracles import STEPS, Oracles
from .scheduler import Scheduler
from .stores import SimStore, checkpoint

__all__ = ["AIMS", "ALL_NODES", "ROOT", "STEPS", "World", "setup"]

#: The run root every schedule's checkpoints are under.
ROOT = "run"
#: The shapes a schedule draws (swarm testing, as FoundationDB's buggify and TigerBeetle's
#: VOPR): which actors run and which of their calls are slow; docs/distributed.md.
AIMS = ("mixed", "commit", "sweep", "restore")
ALL_NODES = ("n0", "n1", "n2")


@functools.cache
def setup() -> tuple[Config, Policies]:
    """The configuration of every node (a shared tier and a node-local one) and the
    policies: export every step, keep_latest (set per schedule) on both tiers, release the
    node-local copy once a verified one is on the shared tier."""

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


class World(Oracles):
    """One schedule's stores, nodes and node catalogs (and the oracles' view of them)."""

    def __init__(self, seed: int, rng: random.Random, sched: Scheduler, aim: str) -> None:
        from ...tiering.inventory import catalog as cat
        from ...tiering.tiers import Tiers

        self.seed = seed
        self.sched = sched
        self.nodes = ALL_NODES[: rng.choice((2, 3))]
        self.keep = 1 if aim == "commit" else rng.choice((1, 2))
        self.flaky = rng.choice(
            (0.03, 0.1, 0.3) if aim == "restore" else (0.0, 0.0, 0.03, 0.1, 0.3)
        )
        self.saves = {st: checkpoint(self.nodes, st) for st in STEPS}
        self.gens = {st: json.loads(m)["generation"] for st, (m, _) in self.saves.items()}
        self.shared = SimStore("lustre", sched, self.on_delete, self.flaky)
        self.nvme: dict[str, SimStore] = {}
        self.tiers: dict[str, Tiers] = {}
        #: Each node's protocol environment (its clock, id and process), held by its
        #: ``Tiers`` and handed to its exporter and sweeps.
        self.env: dict[str, Env] = {}
        #: Each node's catalog of the shared tier's copies: step -> (state, verified).
        self.cat: dict[str, dict[int, tuple[str, bool]]] = {}
        config, _ = setup()
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
