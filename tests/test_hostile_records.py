"""Hostile input, fourth round: zip archives with two central directories, unbounded
records, leases that never expire, replica manifests, node names, and peers' sizes.

Each test builds the hostile input from a real one (written by torch or fmstore itself)
and checks that fmstore refuses it with one fmstore error naming it.
"""

from __future__ import annotations

import io
import json
import os
import time
import zipfile

import pytest
import torch
from hostile_helpers import run_limited
from zip_support import rezipped, torch_bytes

import fmstore
from fmstore import runtime
from fmstore.checkpoint.zipguard import check_torch_zip
from fmstore.errors import ConfigError, CorruptData, NotFound

# ---- 1. zip archives: the directory zipfile finds and the one torch reads ------------------


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("before", "two different directories"),
        ("before zip64", "no zip64 end record"),
        ("after", "64 bytes after its end record"),
    ],
)
def test_zip_with_bytes_around_its_directory_is_refused(tmp_path, where, why):
    good = torch_bytes({"w": torch.arange(100)})
    extra = b"PK\x03\x04" + bytes(60)
    if where == "before":
        data = extra + rezipped(good)
    else:
        data = extra + good if where == "before zip64" else good + extra
    # zipfile (the check's parser) reads either file, with the directory it finds at the end
    # record's position less its size; torch reads at the offset the end record declares
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.testzip() is None
    with pytest.raises(CorruptData, match=f"x.pt .*{why}"):
        check_torch_zip(data, name="x.pt")
    (tmp_path / "x.pt").write_bytes(data)
    with pytest.raises(CorruptData, match=why):
        fmstore.load(str(tmp_path / "x.pt"))


def test_torch_file_is_opened_once_without_following_a_link(tmp_path):
    (tmp_path / "real.pt").write_bytes(torch_bytes({"w": torch.arange(7)}))
    os.symlink(tmp_path / "real.pt", tmp_path / "link.pt")
    with pytest.raises(CorruptData, match="link.pt is a symbolic link"):
        fmstore.load(str(tmp_path / "link.pt"))
    out = fmstore.load(str(tmp_path / "real.pt"))
    assert torch.equal(out["w"], torch.arange(7))


# ---- 2. records and manifests are read bounded -------------------------------------------


def test_read_bounded_refuses_before_reading(tmp_path, monkeypatch):
    from fmstore.stores import open_store
    from fmstore.stores.bounded import RECORD_LIMIT, manifest_limit, read_bounded

    store = open_store(str(tmp_path))
    (tmp_path / "small.json").write_bytes(b'{"a":1}')
    with open(tmp_path / "big.json", "wb") as f:
        f.truncate(RECORD_LIMIT + 1)  # sparse: no disk used
    assert runtime.run(read_bounded(store, "small.json", 7)) == b'{"a":1}'
    with pytest.raises(CorruptData, match=r"part record .*big.json is 4194305 bytes, more than"):
        runtime.run(read_bounded(store, "big.json", RECORD_LIMIT, what="part record"))
    with pytest.raises(NotFound):
        runtime.run(read_bounded(store, "absent.json", RECORD_LIMIT))
    assert manifest_limit() > 600_000_000  # a 70B model's manifest on 1,024 ranks
    monkeypatch.setenv("FMSTORE_MAX_MANIFEST_BYTES", "1000")
    assert manifest_limit() == 1000
    monkeypatch.setenv("FMSTORE_MAX_MANIFEST_BYTES", "lots")
    with pytest.raises(ConfigError, match="FMSTORE_MAX_MANIFEST_BYTES"):
        manifest_limit()


def test_gc_meets_sparse_gigabyte_lease_and_manifest_in_bounded_memory(tmp_path):
    gen = tmp_path / "step_00000001" / "g000000000001-deadbeef"
    gen.mkdir(parents=True)
    (gen / "000000.bin").write_bytes(b"x" * 10)
    with open(gen / "export-n1.json", "wb") as f:
        f.truncate(3 << 29)  # 1.5 GiB, no disk used
    (tmp_path / "other").mkdir()
    with open(tmp_path / "other" / "manifest.json", "wb") as f:
        f.truncate(3 << 29)
    res = run_limited(
        f"""
        os.environ["FMSTORE_MAX_MANIFEST_BYTES"] = str(64 << 20)
        from fmstore.checkpoint.gc import gc
        def go():
            rep = gc({str(tmp_path)!r}, dry_run=True, older_than=0)
            # the unreadable lease counts as alive, the unreadable manifest keeps its prefix
            assert rep.exporting == ["step_00000001/g000000000001-deadbeef"], rep
            assert rep.unreadable == ["other"], rep
        report(go)
        """
    )
    assert res == [{"error": None}], res


# ---- 3. leases that would never expire ---------------------------------------------------


def _lease_doc(node: str, pid: object, renewed: str) -> bytes:
    return (
        f'{{"format":"fmstore-export-lease","version":1,"node":"{node}","pid":{pid},'
        f'"renewed":{renewed}}}'
    ).encode()


@pytest.mark.parametrize("renewed", ["Infinity", "NaN", "1e300", "1e400", "-Infinity", "FUTURE"])
def test_lease_renewed_at_no_real_time_is_dead(renewed):
    from fmstore.checkpoint.partrecords import LEASE_TTL, ExportLease

    now = time.time()
    doc = _lease_doc("elsewhere", 1, str(now + 100 * LEASE_TTL) if renewed == "FUTURE" else renewed)
    assert not ExportLease.loads(doc, where="x").alive(now)
    # another node's clock a little ahead is still a renewal
    assert ExportLease.loads(_lease_doc("elsewhere", 1, str(now + 5)), where="x").alive(now)


def test_gc_removes_an_immortal_lease_generation_and_survives_a_huge_pid(tmp_path, monkeypatch):
    from fmstore.checkpoint.gc import gc

    monkeypatch.setenv("FMSTORE_NODE_ID", "n-here")
    for name, doc in {
        "g000000000001-00000001": _lease_doc("elsewhere", 1, "Infinity"),
        "g000000000002-00000002": _lease_doc("n-here", 10**23, str(time.time())),
    }.items():
        gen = tmp_path / "step_00000001" / name
        gen.mkdir(parents=True)
        (gen / "000000.bin").write_bytes(b"x" * 10)
        (gen / "export-n1.json").write_bytes(doc)
    rep = gc(str(tmp_path), dry_run=True, older_than=0)
    # the pid no process has: malformed, alive only while its file is younger than a lease
    assert rep.exporting == ["step_00000001/g000000000002-00000002"], rep
    assert "step_00000001/g000000000001-00000001/000000.bin" in rep.removed, rep


# ---- 4. replica manifests ------------------------------------------------------------------


def _dcp_manifest(world_size: int = 2) -> dict:
    from torch.distributed.checkpoint.metadata import Metadata

    from fmstore.checkpoint.dcp.manifest import DcpBlob, DcpManifest
    from fmstore.checkpoint.layout import new_generation

    m = DcpManifest.from_metadata(
        Metadata(state_dict_metadata={}),
        generation=new_generation(),
        world_size=world_size,
        items=[],
        blobs=[DcpBlob(f"{r:06d}.bin", 0, r) for r in range(world_size)],
        allow_pickle=False,
        writer="test",
    )
    return json.loads(m.dumps())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("world_size", 10**12),
        ("world_size", 1e300),
        ("world_size", True),
        ("world_size", "2"),
        ("world_size", 0),
        ("generation", {"a": 1}),
        ("generation", "../../x"),
        ("created", float("inf")),
        ("created", "yesterday"),
    ],
)
def test_dcp_manifest_fields_of_a_wrong_type_or_range_are_refused(field, value):
    from fmstore.checkpoint.dcp.manifest import DcpManifest

    doc = _dcp_manifest()
    doc[field] = value
    data = json.dumps(doc).encode()
    with pytest.raises(CorruptData, match="manifest.json"):
        DcpManifest.loads(data, where="x/manifest.json")


def test_a_replica_manifest_with_a_bool_world_size_holds_nothing(posix_cfg, tmp_path):
    from fmstore.checkpoint.dcp.nodes import rank_record_key
    from fmstore.checkpoint.dcp.replicas import held

    doc = _dcp_manifest(world_size=1)
    rep = tmp_path / "nvme" / ".replicas" / "run" / "step_00000001"
    (rep / doc["generation"]).mkdir(parents=True)
    (rep / rank_record_key(doc["generation"], 0)).write_text("{}")
    (rep / "manifest.json").write_text(json.dumps(doc))
    assert runtime.run(held("nvme:run/step_00000001", {}))[1] == (0,)
    doc["world_size"] = True  # 1 to int(): a manifest of no valid type
    (rep / "manifest.json").write_text(json.dumps(doc))
    assert runtime.run(held("nvme:run/step_00000001", {})) == (None, ())


# ---- 5, 7. one node-id grammar; step names ---------------------------------------------------


@pytest.mark.parametrize("bad", ["n0\n", "..", ".", "-x", "n 0", "[/]", "ｎ0", "x" * 201, ""])
def test_node_id_has_one_grammar(monkeypatch, bad):
    from fmstore.checkpoint.dcp.nodes import NODE_ENV, node_id
    from fmstore.checkpoint.partrecords import PartRecord, is_node_id

    assert not is_node_id(bad)
    if bad:
        monkeypatch.setenv(NODE_ENV, bad)
        with pytest.raises(ConfigError, match="node id"):
            node_id()
    rec = PartRecord("n0", (0,), "g000000000001-00000001", "0" * 64, ())
    with pytest.raises(CorruptData, match="not a node id"):
        PartRecord.loads(
            rec.dumps().replace(b'"node":"n0"', b'"node":' + json.dumps(bad).encode()), where="x"
        )


def test_node_id_accepts_host_names(monkeypatch):
    from fmstore.checkpoint.dcp.nodes import NODE_ENV, node_id

    for good in ("n0", "ip-10-0-0-1.ec2.internal", "node_7:gpu@rack+2"):
        monkeypatch.setenv(NODE_ENV, good)
        assert node_id() == good


@pytest.mark.parametrize(
    "name", ["step_000000000001\n", "step_00000000000١", "step_1", "xstep_000000000001"]
)
def test_parse_step_takes_whole_ascii_names_only(name):
    from fmstore.checkpoint.layout import parse_step

    assert parse_step(name) is None
    assert parse_step("step_000000000012/") == 12


# ---- 6. peers' sizes --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Rank 0's results of ``tests/two_rank_worker.py`` (a two-node save, then a hostile
    rank 1), run once for the module."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    here, base = Path(__file__).parent, tmp_path_factory.mktemp("two_ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=f"{here.parent}{os.pathsep}{here}", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(here / "two_rank_worker.py"), str(r), str(port), str(base)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    line = next((ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")), None)
    assert line, outs[0][1][-3000:]
    return json.loads(line[7:])


def test_sizes_peers_announce_are_bounded_before_anything_is_allocated(two_ranks):
    res = two_ranks
    assert "announces a rank record of 1099511627776 bytes" in res["recv"], res
    assert res["gather"].startswith("FmstoreError: rank 1 sent a message of 1099511627776"), res
    assert "announced a broadcast of 1099511627776 bytes" in res["broadcast"], res
    assert "sent rank 0: a chunk of 1099511627776 bytes at offset 0" in res["stream"], res


# ---- 11. messages that name what was missed ----------------------------------------------------


def test_a_node_local_tier_without_its_scope_gets_the_hint_on_a_missed_blob(two_ranks):
    error = two_ranks["save"]
    assert "rank 1's blob is missing; not committing" in error, error
    assert "rank 1 ran on node n1, the coordinator on n0" in error, error
    assert 'set scope = "node" in [tiers.nvme]' in error, error


def test_a_sparse_gigabyte_dataset_index_is_refused_in_bounded_memory(tmp_path):
    """A dataset's ``index.json`` is read bounded like a manifest: 1.5 GiB of sparse file
    (no disk) is refused by its size, before a byte is read, by the loader and the writer."""
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "index.json", "wb") as f:
        f.truncate(3 << 29)
    res = run_limited(
        f"""
        os.environ["FMSTORE_MAX_INDEX_BYTES"] = str(64 << 20)
        from fmstore.loaders import StreamingDataset
        from fmstore.loaders.writer import write_samples
        report(lambda: StreamingDataset({str(data)!r}, {str(tmp_path / "cache")!r}))
        report(lambda: write_samples([b"x"], {str(data)!r}))
        """
    )
    assert [r["error"] for r in res] == ["CorruptData", "AlreadyExists"], res
    assert "dataset index" in res[0]["msg"] and "67108864" in res[0]["msg"], res
    assert (data / "index.json").stat().st_size == 3 << 29  # nothing replaced or removed
    # overwrite replaces it: the unread index names no shard to remove
    res = run_limited(
        f"""
        os.environ["FMSTORE_MAX_INDEX_BYTES"] = str(64 << 20)
        from fmstore.loaders.writer import write_samples
        report(lambda: write_samples([b"x"], {str(data)!r}, overwrite=True))
        """
    )
    assert res == [{"error": None}], res
    assert (data / "index.json").stat().st_size < 4096
