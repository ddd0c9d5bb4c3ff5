"""``fmstore ckpt list`` renders every state a copy can be in, and a node-local copy of a
sharded checkpoint with the size of this node's own part."""

from __future__ import annotations

import json

from stage_data import fm_here

from fmstore import config as fm_config
from fmstore.checkpoint.dcp.manifest import DcpBlob, DcpManifest, DcpPart
from fmstore.checkpoint.dcp.nodes import NODE_ENV
from fmstore.checkpoint.layout import new_generation
from fmstore.tiering.inventory import catalog as cat
from fmstore.tiering.inventory.catalog import Catalog


def test_ckpt_list_renders_every_state_and_a_parts_own_size(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.metadata import Metadata

    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\nscope = "node"\n'
        f'[tiers.lustre]\nurl = "{tmp_path / "lustre"}"\n'
    )
    monkeypatch.setenv("FMSTORE_CONFIG", str(cfg))
    monkeypatch.setenv(NODE_ENV, "n1")
    monkeypatch.setenv("COLUMNS", "200")  # no cell cropped
    fm_config.set_config(None)
    sizes = [100, 200, 1000, 3000]  # ranks 0-1 on n0, 2-3 on n1
    m = DcpManifest.from_metadata(
        Metadata(state_dict_metadata={}),
        generation=new_generation(),
        world_size=4,
        items=[],
        blobs=[DcpBlob(f"{r:06d}.bin", n, r) for r, n in enumerate(sizes)],
        allow_pickle=False,
        writer="test",
        parts=[DcpPart("n0", (0, 1)), DcpPart("n1", (2, 3))],
    )
    ck = tmp_path / "nvme" / "run" / f"step_{100:012d}"
    (ck / m.generation).mkdir(parents=True)
    for b in m.blobs[2:]:
        (ck / m.generation / b.name).write_bytes(b"x" * b.size)
    (ck / "manifest.json").write_bytes(m.dumps())
    with Catalog.for_state_dir(str(tmp_path / "state")) as c:
        c.record_checkpoint("run", 100, bytes=sum(sizes))
        c.set_copy("run", 100, "nvme", cat.PRESENT, bytes=sum(sizes))
        for step, state in enumerate(cat.STATES, start=1):
            c.record_checkpoint("run", step, bytes=10 * step)
            c.set_copy("run", step, "lustre", state, bytes=10 * step)
    try:
        r = fm_here("ckpt", "list", "run")
        assert r.returncode == 0, r.stdout + r.stderr
        rows = [ln.split(maxsplit=2) for ln in r.stdout.splitlines()]
        lines = {w[1]: w[2] for w in rows if len(w) == 3 and w[0] == "run"}
        for step, state in enumerate(cat.STATES, start=1):
            assert lines[str(step)].startswith(state), (state, r.stdout)
        # 4000 B of n1's blobs, not the 4300 B of the whole checkpoint
        assert "part 2/2 (this node, n1) 3.9 KiB" in lines["100"], r.stdout
        doc = json.loads(fm_here("ckpt", "list", "run", "--json").stdout)
        (row,) = [d for d in doc if d["step"] == 100]
        assert row["tiers"]["nvme"]["part"]["bytes"] == 4000
    finally:
        fm_config.set_config(None)


def test_rm_r_of_a_run_says_it_keeps_the_runs_replicas(tmp_path, monkeypatch):
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\nscope = "node"\n'
    )
    monkeypatch.setenv("FMSTORE_CONFIG", str(cfg))
    fm_config.set_config(None)
    own = tmp_path / "nvme" / "run" / "step_000000000010" / "x.bin"
    replica = tmp_path / "nvme" / ".replicas" / "run" / "step_000000000010" / "manifest.json"
    for p in (own, replica):
        p.parent.mkdir(parents=True)
        p.write_bytes(b"x")
    try:
        r = fm_here("rm", "-r", "nvme:run", "--yes")
        assert r.returncode == 0, r.stderr
        assert "stay in nvme:.replicas/run" in r.stderr, r.stderr
        assert not own.exists() and replica.exists()
        # a run with no replicas here: nothing said, no replica directory made
        other = tmp_path / "nvme" / "other" / "x.bin"
        other.parent.mkdir()
        other.write_bytes(b"x")
        r = fm_here("rm", "-r", "nvme:other", "--yes")
        assert r.returncode == 0 and "replicas" not in r.stderr, r.stderr
        assert not (tmp_path / "nvme" / ".replicas" / "other").exists()
    finally:
        fm_config.set_config(None)
