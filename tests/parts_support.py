"""Checkpoints in node parts as ``fdcp.save`` leaves them on each node's NVMe, and one
process's stand-in for each node's runner (its own state directory and catalog), beside one
shared ``lustre`` directory: the helpers of the tests of node-part exports."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from fmstore.checkpoint.dcp.manifest import DcpBlob, DcpItem, DcpManifest, DcpPart
from fmstore.checkpoint.dcp.nodes import NODE_ENV, RankRecord, rank_record_key
from fmstore.checkpoint.layout import checkpoint_key, new_generation
from fmstore.config import Config, from_dict
from fmstore.format.checksum import crc32c
from fmstore.format.manifest import ChunkEntry
from fmstore.stores.base import PrefixStore, PutOptions
from fmstore.tiering.inventory import catalog as cat
from fmstore.tiering.inventory.catalog import Catalog
from fmstore.tiering.policy.rules import from_config
from fmstore.tiering.policy.runner import PolicyRunner

ROOT = "run"
NODES = ("n0", "n1")


def node_config(base: Path, node: str, policies: dict[str, Any], s3: str | None = None) -> Config:
    tiers: dict[str, Any] = {
        "nvme": {"url": str(base / node / "nvme"), "scope": "node"},
        "lustre": {"url": str(base / "lustre")},
    }
    if s3 is not None:
        tiers["s3"] = {"url": s3}
    return from_dict(
        {"tiers": tiers, "state_dir": str(base / node / "state"), "policies": policies}
    )


def save_parts(
    base: Path,
    step: int,
    nodes: tuple[str, ...] = NODES,
    size: int = 3000,
    age: float = 0.0,
    blobs_per_rank: int = 1,
) -> bytes:
    """A committed checkpoint of ``len(nodes)`` nodes x 1 rank on the nodes' NVMe, as
    ``fdcp.save`` leaves it: each node its rank's blob and record, every node the same
    manifest; saved ``age`` seconds ago (its generation's name and its files' times).
    Returns the manifest's bytes."""
    gen = new_generation()
    if age:
        gen = f"g{int((time.time() - age) * 1000):012x}-{gen[-8:]}"
    blobs, items, payloads = [], [], []
    for r in range(len(nodes)):
        for k in range(blobs_per_rank):
            i = len(blobs)
            data = os.urandom(size) + bytes([step % 256, r])
            payloads.append(data)
            blobs.append(DcpBlob(f"{i:06d}.bin", len(data), r))
            chunk = ChunkEntry(i, 0, len(data), 0, len(data), "raw", crc32c(data))
            items.append(DcpItem(f"x{r}.{k}", None, "bytes", "", (), len(data), (chunk,)))
    md = Metadata(state_dict_metadata={it.fqn: BytesStorageMetadata() for it in items})
    m = DcpManifest.from_metadata(
        md,
        generation=gen,
        world_size=len(nodes),
        items=items,
        blobs=blobs,
        allow_pickle=False,
        writer="test",
        parts=[DcpPart(n, (r,)) for r, n in enumerate(nodes)],
    )
    raw = m.dumps()
    for r, node in enumerate(nodes):
        d = base / node / "nvme" / checkpoint_key(ROOT, step)
        (d / gen).mkdir(parents=True, exist_ok=True)
        mine = [i for i, b in enumerate(blobs) if b.rank == r]
        for i in mine:
            (d / gen / blobs[i].name).write_bytes(payloads[i])
        rec = RankRecord(gen, "s", r, node, tuple((blobs[i].name, blobs[i].size) for i in mine))
        (d / rank_record_key(gen, r)).write_bytes(rec.dumps())
        (d / "manifest.json").write_bytes(raw)
        if age:
            for f in [*(d / gen).iterdir(), d / "manifest.json"]:
                os.utime(f, (time.time() - age, time.time() - age))
    return raw


class Node:
    """One node's runner: its own catalog and state directory, FMSTORE_NODE_ID set while it
    steps."""

    def __init__(
        self, base: Path, name: str, policies: dict[str, Any], clock: Any = None, **kw: Any
    ) -> None:
        self.name = name
        self.cfg = node_config(base, name, policies, **kw)
        self.catalog = Catalog.for_state_dir(self.cfg.state_dir, clock=clock)
        self.runner = PolicyRunner(self.cfg, from_config(self.cfg), self.catalog)

    def record(self, step: int, created: float | None = None) -> None:
        """What the sharded manager does after a save commits on this node."""
        self.catalog.record_checkpoint(ROOT, step, created=created)
        self.catalog.set_copy(ROOT, step, "nvme", cat.PRESENT)

    def step(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        monkeypatch.setenv(NODE_ENV, self.name)
        rep = self.runner.step(blocking_lock=True)
        assert not rep.errors, rep.errors
        return rep

    def state(self, step: int, tier: str) -> str | None:
        cp = self.catalog.copy(ROOT, step, tier)
        return None if cp is None else cp.state


EXPORT = {"ladder": ["nvme", "lustre"], "export": [{"to": "lustre", "every_steps": 10}]}


def lustre(base: Path, step: int) -> Path:
    return base / "lustre" / checkpoint_key(ROOT, step)


class PauseAt(PrefixStore):
    """``inner`` under ``prefix``, pausing before a put of ``key``: ``reached`` is set and
    the put waits for ``go`` (the real store call runs after)."""

    def __init__(self, inner, prefix: str, key: str) -> None:
        super().__init__(inner, prefix)
        self.key = key
        self.reached = asyncio.Event()
        self.go = asyncio.Event()

    async def put(self, key, data, options=PutOptions()):
        if key == self.key:
            self.reached.set()
            await self.go.wait()
        return await super().put(key, data, options)


def ckpt_list(base: Path, node: str, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """``fmstore ckpt list run`` as on ``node`` (its config written as a file)."""
    from fmstore.cli.main import main

    cfg = base / f"{node}.toml"
    cfg.write_text(
        f'state_dir = "{base / node / "state"}"\n'
        f'[tiers.nvme]\nurl = "{base / node / "nvme"}"\nscope = "node"\n'
        f'[tiers.lustre]\nurl = "{base / "lustre"}"\n'
        '[policies]\nladder = ["nvme", "lustre"]\n'
        '[[policies.export]]\nto = "lustre"\nevery_steps = 10\n'
    )
    monkeypatch.setenv(NODE_ENV, node)
    monkeypatch.setenv("COLUMNS", "300")
    capsys.readouterr()
    try:
        main(["ckpt", "list", "run", "--config", str(cfg)])
    except SystemExit as e:
        assert not e.code
    return capsys.readouterr().out
