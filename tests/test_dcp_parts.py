"""Node-local tiers and checkpoints in parts, what one process can check: the ``scope`` key,
node identity, the version-2 manifest and what an older reader says of it, and the sweep's
rule for pending parts.  The real nodes are in tests/test_dcp_nodes.py."""

from __future__ import annotations

import json

import pytest

from fmstore import config as fm_config
from fmstore import runtime
from fmstore.checkpoint.dcp.manifest import DcpBlob, DcpManifest, DcpPart
from fmstore.checkpoint.dcp.nodes import NODE_ENV, RankRecord, node_id, rank_record_key, tier_scope
from fmstore.checkpoint.gc import gc
from fmstore.checkpoint.layout import new_generation
from fmstore.config import from_dict
from fmstore.errors import ConfigError, VersionError
from fmstore.format.manifest import DCP_FORMAT_NAME, parse_header
from fmstore.stores import open_store
from fmstore.tiering.policy.sweep import Sweeper


def test_scope_key_is_read_checked_and_defaults_to_shared(tmp_path):
    cfg = from_dict(
        {"tiers": {"nvme": {"url": str(tmp_path), "scope": "node"}, "l": {"url": str(tmp_path)}}}
    )
    assert cfg.tiers["nvme"].scope == "node" and "scope" not in cfg.tiers["nvme"].options
    assert cfg.tiers["l"].scope == "shared"
    with pytest.raises(ConfigError, match="scope"):
        from_dict({"tiers": {"nvme": {"url": str(tmp_path), "scope": "local"}}})


def test_tier_scope_of_a_uri_and_node_identity(posix_cfg, monkeypatch):
    posix_cfg.write_text(
        posix_cfg.read_text().replace("[tiers.lustre]", 'scope = "node"\n[tiers.lustre]')
    )
    fm_config.set_config(None)
    assert tier_scope("nvme:run/step_000000000001") == "node"
    assert tier_scope("lustre:run/step_000000000001") == "shared"
    assert tier_scope("/some/dir") == "shared"
    monkeypatch.setenv(NODE_ENV, "rack3-node17")
    assert node_id() == "rack3-node17"
    monkeypatch.setenv(NODE_ENV, "bad node/id")
    with pytest.raises(ConfigError, match=NODE_ENV):
        node_id()
    monkeypatch.delenv(NODE_ENV)
    assert node_id()  # the host name


def _manifest(parts: list[DcpPart]) -> DcpManifest:
    return DcpManifest.from_metadata(
        _md(),
        generation=new_generation(),
        world_size=4,
        items=[],
        blobs=[DcpBlob(f"{r:06d}.bin", 0, r) for r in range(4)],
        allow_pickle=False,
        writer="test",
        parts=parts,
    )


def _md():
    from torch.distributed.checkpoint.metadata import Metadata

    return Metadata(state_dict_metadata={})


def test_a_manifest_in_parts_is_version_2_and_an_older_reader_calls_it_newer_not_corrupt():
    one = _manifest([DcpPart("n0", (0, 1, 2, 3))])
    assert one.version == 1 and "parts" not in one.to_json()  # every fmstore reads it
    two = _manifest([DcpPart("n0", (0, 1)), DcpPart("n1", (2, 3))])
    data = two.dumps()
    assert json.loads(data)["version"] == 2
    back = DcpManifest.loads(data)
    assert back.parts == two.parts and back.node_of_rank(3) == "n1"
    assert [b.rank for b in back.part_view("n1").blobs] == [2, 3]
    # What an fmstore that reads version 1 only does with it: a VersionError naming it.
    with pytest.raises(VersionError, match="version 2, newer than the 1"):
        parse_header(data, where="x", format_name=DCP_FORMAT_NAME, max_version=1, kind="k")


def test_parts_that_do_not_cover_the_ranks_are_refused():
    from fmstore.errors import CorruptData

    m = _manifest([DcpPart("n0", (0, 1)), DcpPart("n1", (2, 3))])
    d = json.loads(m.dumps())
    d["parts"][1]["ranks"] = [2]
    with pytest.raises(CorruptData, match="parts hold ranks"):
        DcpManifest.loads(json.dumps(d).encode())


def test_a_pending_part_is_kept_by_gc_and_the_sweep_with_no_grace(tmp_path):
    store = open_store(str(tmp_path / "nvme"))
    gen = new_generation()
    blob = f"run/step_000000000020/{gen}/000000.bin"
    orphan = f"run/step_000000000030/{new_generation()}/000000.bin"

    async def write() -> None:
        await store.put(blob, b"x" * 100)
        rec = RankRecord(gen, "s", 0, "n0", (("000000.bin", 100),))
        await store.put(f"run/step_000000000020/{rank_record_key(gen, 0)}", rec.dumps())
        await store.put(orphan, b"y" * 10)  # blobs with no record: never reported

    runtime.run(write())
    rep = gc(str(tmp_path / "nvme"), older_than=0)
    assert rep.pending == [f"run/step_000000000020/{gen}"]
    assert [k for k in rep.removed] == [orphan]
    assert (tmp_path / "nvme" / blob).exists()
    sw = Sweeper(str(tmp_path / "state"), grace=0)
    runtime.run(sw.tier("nvme", store))
    assert not sw.report.removed
    kept = [o.where for o in sw.report.orphans if o.action == "kept: pending part"]
    assert kept == [f"run/step_000000000020/{gen}"]
    assert (tmp_path / "nvme" / blob).exists()
    runtime.run(store.close())


def test_the_mover_reports_a_checkpoint_in_node_parts_as_unreadable_not_missing(tmp_path):
    from fmstore.tiering.exports.mover import copy_checkpoint

    m = _manifest([DcpPart("n0", (0, 1)), DcpPart("n1", (2, 3))])
    src = open_store(str(tmp_path / "nvme" / "run" / "step_000000000010"))
    dst = open_store(str(tmp_path / "lustre" / "run" / "step_000000000010"))

    async def go() -> None:
        for b in m.blobs[:2]:  # this node's part only
            await src.put(m.blob_key(m.blobs.index(b)), b"")
        await src.put("manifest.json", m.dumps())
        await copy_checkpoint(src, dst)

    with pytest.raises(VersionError, match="node parts"):
        runtime.run(go())
    assert not (tmp_path / "lustre" / "run" / "step_000000000010" / "manifest.json").exists()
