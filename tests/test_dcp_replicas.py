"""Replicas of every node's part on a peer's NVMe, on real nodes (issue 40, points 1-3).

Three ``torchrun`` agents x 2 ranks on loopback (:class:`fmstore.testing.cluster.Cluster`:
each node its own config, NVMe and state; ``[tiers.nvme] replicas = 1``; Lustre shared; S3
on SeaweedFS behind the fault proxy).  Three launches share the setup (each start of 3
nodes costs more than the work; between the phases of one launch its ranks wait on the
test's signal while the test checks and changes the nodes' directories): a save of step
10 to NVMe (with replicas), Lustre and S3, then in the same launch the faults of later
steps, ending with n1 killed; a relaunch that swaps two nodes' ranks (issue 46: each item
from the node holding it, streamed over the group); and one relaunch that restores three
times after losing nodes (a lost node's NVMe and state directory wiped while its ranks
wait):

1. n1 replaced (its NVMe wiped) and the Lustre copy moved away: the job restores step 10
   from NVMe, n1's part fetched from the replicas n2 (rank 2's) and n0 (rank 3's) hold (the
   placement spreads a node's ranks over its holders), bit-exact, with no GET of a
   manifest or blob key on S3;
2. n1 replaced again and a chunk of n2's replica of it flipped: the arrival check fails and
   every rank falls back to Lustre, bit-exact;
3. n1 and n2 lost at once (rank 2's replica was on n2): every rank falls back to S3, bit-exact.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from cluster_support import wait_on_nodes

from fmstore.testing.cluster import Cluster, S3Tier
from fmstore.testing.faultproxy import FaultProxy

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "replica_worker.py")
NODES = ["n0", "n1", "n2"]
KEY = f"run/step_{10:012d}"
#: the replicas each node holds (replicas = 1, 2 ranks per node: spread over the ring)
SPREAD = (("n1", {0, 5}), ("n2", {1, 2}), ("n0", {3, 4}))
ENV = {"FMSTORE__TIERS__NVME__REPLICAS": "1"}


def start(c: Cluster, name: str, *uris: str, nodes: list[str] = NODES) -> list[Any]:
    return c.start(WORKER, [name, str(c.out), str(c.port), *uris], nodes, name=name, env=ENV)


def reports(c: Cluster, name: str, procs: list[Any]) -> list[dict[str, Any]]:
    """Every rank's report of phase ``name``, once every rank set its key (the event)."""
    keys = [f"replicas/{name}-{r}" for r in range(6)]
    wait_on_nodes(lambda: c.store.check(keys), procs, f"phase {name}")
    return [json.loads((c.out / f"{name}-{r}.json").read_text()) for r in range(6)]


def go(c: Cluster, name: str) -> None:
    c.store.set(f"replicas/go-{name}", "1")


def finished(c: Cluster, name: str, procs: list[Any]) -> None:
    rcs = [p.wait(timeout=300) for p in procs]
    assert rcs == [0, 0, 0], c.logs(name, NODES)


def lose(c: Cluster, node: str) -> None:
    """``node`` replaced while the job's ranks wait: its NVMe and state directory wiped."""
    shutil.rmtree(c.nvme(node), ignore_errors=True)
    shutil.rmtree(c.state(node), ignore_errors=True)


def manifest(c: Cluster, node: str) -> dict[str, Any]:
    return json.loads((c.nvme(node) / KEY / "manifest.json").read_text())


def replica_ranks(c: Cluster, node: str, gen: str) -> set[int]:
    d = c.nvme(node) / ".replicas" / KEY / gen
    return {int(p.stem.split("-")[1]) for p in d.glob("rank-*.json")}


def saved_manifest(tmp_path: Path) -> tuple[Any, Path]:
    """A one-process DCP checkpoint (fmstore's layout) and its manifest."""
    import torch

    import fmstore.checkpoint.dcp as fdcp
    from fmstore import runtime
    from fmstore.stores import open_store

    fdcp.save({"w": torch.arange(4096, dtype=torch.float32), "n": 3}, str(tmp_path / "ck"))
    return runtime.run(fdcp.read_manifest(open_store(str(tmp_path / "ck")))), tmp_path / "ck"


def test_the_ring_places_no_replica_on_its_own_node_and_the_plan_needs_a_holder(tmp_path):
    from dataclasses import replace

    from fmstore.checkpoint.dcp.manifest import DcpPart
    from fmstore.checkpoint.dcp.replicas import holders_of, placement_of, plan, sources_of

    m, _ = saved_manifest(tmp_path)
    three = [DcpPart(f"n{i}", (2 * i, 2 * i + 1)) for i in range(3)]
    ring = placement_of(replace(m, parts=three), 1)
    assert ring == {0: (2,), 1: (5,), 2: (4,), 3: (1,), 4: (0,), 5: (3,)}
    # what the node test expects each node to hold
    assert all(
        ranks == {r for r, hs in ring.items() if f"n{hs[0] // 2}" == n} for n, ranks in SPREAD
    )
    # Known from the ranks' nodes at planning, before any manifest exists: the same.
    assert holders_of(["n0", "n0", "n1", "n1", "n2", "n2"], 1) == ring
    assert sources_of(ring, 0) == (4,) and sources_of(ring, 1) == (3,)
    assert placement_of(replace(m, parts=three[:1]), 1) is None  # one node: nowhere to go
    uneven = [DcpPart("n0", (0, 1)), DcpPart("n1", (2,))]
    assert placement_of(replace(m, parts=uneven), 1) is None
    # n1 (ranks 2, 3) lost; n2 (ranks 4, 5) holds its replicas of manifest "d".
    held: list[Any] = [("d", (4, 5)), ("d", (4, 5)), (None, ()), (None, ())]
    held += [("d", (2, 3)), ("d", (2, 3))]
    assert plan("d", held, [2, 3]) == {2: 4, 3: 4}
    assert plan("other", held, [2, 3]) is None  # a replica of another save
    assert plan("d", held, [2, 3, 4, 5]) is None  # its holder lost too


def test_the_plan_carries_k_and_domains_so_the_stream_places_like_the_commit(tmp_path):
    from dataclasses import replace

    from fmstore.checkpoint.dcp.manifest import DcpPart
    from fmstore.checkpoint.dcp.nodes import LocalInfo
    from fmstore.checkpoint.dcp.replica_stream import agreed
    from fmstore.checkpoint.dcp.replicas import holders_of, placement_of

    m, _ = saved_manifest(tmp_path)
    nodes = ("n0", "n0", "n1", "n1", "n2", "n2", "n3", "n3")
    m4 = replace(m, parts=[DcpPart(f"n{i}", (2 * i, 2 * i + 1)) for i in range(4)])
    racks = {"n0": "a", "n1": "a", "n2": "b", "n3": "b"}

    def infos(k: Any = 2, dom: Any = racks.get) -> list[Any]:
        return [LocalInfo(n, (), k, dom(n)) for n in nodes]

    k, said = agreed(infos(), nodes)
    assert (k, said) == (2, tuple(racks[n] for n in nodes))
    # The plan's placement is the committed manifest's over the same domains: k holders in
    # the other rack first (own rack last), from the nodes and domains alone, before anything is written.
    assert holders_of(nodes, k, said) == placement_of(m4, 2, racks)
    assert holders_of(nodes, k, said)[0] == (4, 6)  # n2, n3: rack b, then b again
    assert holders_of(nodes, 1, None) == placement_of(m4, 1)
    # Hostile or disagreeing local plans stream nothing (the commit's check raises).
    assert agreed(infos(k=3)[:-1] + infos()[-1:], nodes) == (0, ())
    assert agreed(infos(k="2"), nodes) == (0, ())
    assert agreed(infos(k=99), nodes) == (0, ())
    bad = infos()
    bad[1] = LocalInfo("n0", (), 2, "b")  # n0's ranks disagree on its domain
    assert agreed(bad, nodes) == (0, ())
    assert agreed(infos(dom=lambda n: "no such name!" * 20), nodes) == (0, ())
    # Some node names none: the ring, as after the commit.
    k, said = agreed(infos(dom=lambda n: racks[n] if n != "n3" else None), nodes)
    assert holders_of(nodes, k, said) == placement_of(m4, 2)


def test_a_replica_blob_is_checked_chunk_by_chunk(tmp_path):
    from fmstore.checkpoint.dcp.replicas import check_blob
    from fmstore.errors import CorruptData

    m, ck = saved_manifest(tmp_path)
    i = max(range(len(m.blobs)), key=lambda j: m.blobs[j].size)
    data = (ck / m.blob_key(i)).read_bytes()
    check_blob(m, i, data, "replica")
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(CorruptData, match="fails its CRC32C"):
        check_blob(m, i, bytes(bad), "replica")
    with pytest.raises(CorruptData, match="bytes, not"):
        check_blob(m, i, data[:-1], "replica")


def test_a_streamed_replica_counts_only_if_its_blob_table_is_the_manifests(tmp_path):
    """What a holder received while the save wrote is compared, after the commit, with
    the committed manifest: every blob's size and every chunk's offset, length and CRC32C,
    and the sender's record; anything else is named, and the replica is not counted."""
    from fmstore.checkpoint.dcp.nodes import RankRecord
    from fmstore.checkpoint.dcp.replica_stream import Received
    from fmstore.checkpoint.dcp.replicas import mismatch, table

    m, _ = saved_manifest(tmp_path)
    rec = RankRecord(m.generation, "s", 0, "n0", tuple((b.name, b.size) for b in m.blobs))

    def received(**change: Any) -> Received:
        blobs = {k: (n, list(cs)) for k, (n, cs) in table(m, 0).items()}
        return Received(**{"blobs": blobs, "record": rec.dumps(), **change})

    assert table(m, 0) and mismatch(m, 0, received(), "r") == ""
    name, (size, chunks) = next(iter(table(m, 0).items()))
    off, n, crc = chunks[0]
    bad_crc = {**table(m, 0), name: (size, [(off, n, crc ^ 1), *chunks[1:]])}
    short = {**table(m, 0), name: (size - 1, chunks)}
    missing = dict(list(table(m, 0).items())[1:])
    for blobs in (bad_crc, short, missing):
        assert "differs from the manifest" in mismatch(m, 0, received(blobs=blobs), "r")
    other = RankRecord("g000000000000-00000000", "s", 0, "n0", ())
    assert "of another save" in mismatch(m, 0, received(record=other.dumps()), "r")
    assert mismatch(m, 0, received(record=None), "r")  # no record: not counted
    assert mismatch(m, 0, received(error="rank 4: bad"), "r") == "rank 4: bad"


def test_a_pending_replica_is_swept_like_a_pending_part_and_a_committed_one_stays(tmp_path):
    """What a holder streamed for a save that never committed (blobs, no record, no
    manifest under ``.replicas/KEY``) is an orphan generation the sweep removes; a replica
    whose record is written but not yet its manifest is kept like a pending part; the
    committed replica of the previous step stays whole."""
    from fmstore import runtime
    from fmstore.checkpoint.dcp.manifest import MANIFEST_KEY
    from fmstore.checkpoint.dcp.nodes import RankRecord, rank_record_key
    from fmstore.checkpoint.layout import new_generation
    from fmstore.stores import open_store
    from fmstore.tiering.policy.sweep import Sweeper

    m, ck = saved_manifest(tmp_path)
    root = tmp_path / "nvme"
    done = root / ".replicas" / "run" / "step_000000000010"
    shutil.copytree(ck, done)
    never, half = new_generation(), new_generation()
    for step, gen in ((30, never), (40, half)):
        d = root / ".replicas" / "run" / f"step_{step:012d}" / gen
        d.mkdir(parents=True)
        (d / "000000.bin").write_bytes(b"x" * 100)
    rec = RankRecord(half, "s", 0, "n0", (("000000.bin", 100),))
    (root / ".replicas/run/step_000000000040" / rank_record_key(half, 0)).write_bytes(rec.dumps())
    before = {p: p.read_bytes() for p in done.rglob("*") if p.is_file()}
    sw = Sweeper(str(tmp_path / "state"), grace=0)
    runtime.run(sw.tier("nvme", open_store(str(root))))
    assert not sw.report.errors, sw.report.errors
    got = {o.where: o.action for o in sw.report.orphans if o.kind == "generation"}
    assert got == {
        f".replicas/run/step_000000000030/{never}": "removed",
        f".replicas/run/step_000000000040/{half}": "kept: pending part",
    }
    assert not (root / ".replicas/run/step_000000000030" / never / "000000.bin").exists()
    assert {p: p.read_bytes() for p in done.rglob("*") if p.is_file()} == before
    assert (done / MANIFEST_KEY).is_file() and m.generation


@pytest.mark.slow
@pytest.mark.s3
def test_lost_nodes_restore_from_replicas_or_fall_back_together(tmp_path: Path, s3_server):
    bucket = s3_server.create_bucket(f"t-{uuid.uuid4().hex[:20]}")
    try:
        with FaultProxy(s3_server.endpoint_url) as proxy:
            s3 = S3Tier(f"s3://{bucket}/fm", proxy.endpoint_url, s3_server.env(), s3_server.region)
            with Cluster(tmp_path, nproc=2, s3=s3, pg_timeout=20) as c:
                run_sequence(c, proxy)
    finally:
        s3_server.delete_bucket(bucket)


def tree(c: Cluster, key: str) -> dict[str, bytes]:
    return {
        str(p.relative_to(c.base)): p.read_bytes()
        for n in NODES
        for p in (c.nvme(n) / ".replicas" / key).rglob("*")
        if p.is_file()
    }


def faults(c: Cluster, procs: list[Any]) -> None:
    """Step 20 with a chunk of rank 2's replica corrupted in flight: committed, the save
    raises the holder's finding on every rank; step 30 with n1 killed mid-transfer: never
    committed.  Step 10's replicas stay as they were through both."""
    before = tree(c, KEY)
    assert len(before) > 6
    go(c, "faults")
    wait_on_nodes(lambda: any(c.out.glob("stalled-*")), procs, "n1's replica transfer of step 30")
    c.kill("n1")
    for n in ("n0", "n2"):
        c.agents[n].wait(timeout=120)  # they fail once n1 is gone
    reps = [json.loads((c.out / f"faults-{r}.json").read_text()) for r in range(6)]
    for r in reps:
        assert "is committed, but not every node's part has its replica" in r["error"], r
        assert "rank 2's blob" in r["error"] and "fails its CRC32C on arrival" in r["error"], r
    twenty, thirty = KEY.replace("10", "20"), KEY.replace("10", "30")
    # Step 5, saved in DCP's checkpoint process: its replicas read back and sent.
    five = KEY.replace("10", "05")
    g5 = json.loads((c.nvme("n0") / five / "manifest.json").read_text())["generation"]
    for node, ranks in SPREAD:
        assert ranks == {
            int(p.stem.split("-")[1])
            for p in (c.nvme(node) / ".replicas" / five / g5).glob("rank-*")
        }
    assert all((c.nvme(n) / twenty / "manifest.json").is_file() for n in NODES)
    assert not [p for n in NODES for p in (c.nvme(n) / thirty).rglob("manifest.json")]
    g20 = json.loads((c.nvme("n0") / twenty / "manifest.json").read_text())["generation"]
    # n2 holds rank 1's replica of step 20, never rank 2's (its chunk failed on arrival).
    assert {
        int(p.stem.split("-")[1])
        for p in (c.nvme("n2") / ".replicas" / twenty / g20).glob("rank-*.json")
    } == {1}
    assert tree(c, KEY) == before and (c.nvme("n2") / ".replicas" / KEY).is_dir()


def run_sequence(c: Cluster, proxy: FaultProxy) -> None:
    procs = start(c, "save")
    reps = reports(c, "save", procs)
    assert [r["node"] for r in reps] == ["n0", "n0", "n1", "n1", "n2", "n2"]
    m = manifest(c, "n0")
    gen = m["generation"]
    # Spread over the ring: node i's rank at position j on node i + 1 + j (mod 3); each a
    # copy of the sender's blobs and record, beside the manifest, outside the checkpoint's.
    for node, ranks in SPREAD:
        assert replica_ranks(c, node, gen) == ranks
    rep_dir = c.nvme("n2") / ".replicas" / KEY
    assert (rep_dir / "manifest.json").read_bytes() == (
        c.nvme("n1") / KEY / "manifest.json"
    ).read_bytes()
    for b in m["blobs"]:
        if b["rank"] == 2:
            own = (c.nvme("n1") / KEY / gen / b["name"]).read_bytes()
            assert (rep_dir / gen / b["name"]).read_bytes() == own

    faults(c, procs)  # the same launch goes on, to n1's kill
    c.kill("n0")
    c.kill("n2")

    uris = ["nvme:" + KEY, "lustre:" + KEY, "s3:" + KEY]
    lustre, away = c.lustre / "run", c.base / "lustre-away"

    # 0. The relaunch's rendezvous orders n0 and n1 the other way round (ranks 0, 1 on n1,
    # 2, 3 on n0); the Lustre copy gone: every rank reads its items from the node holding
    # them, over the group, with no GET on S3 and nothing written to any NVMe.
    shutil.move(lustre, away)
    before = sorted(p for n in NODES for p in c.nvme(n).rglob("*"))
    seen = len(proxy.seen)
    procs = start(c, "restore", *uris, nodes=["n1", "n0", "n2"])
    reps = reports(c, "restore", procs)
    finished(c, "restore", procs)
    assert [r["node"] for r in reps] == ["n1", "n1", "n0", "n0", "n2", "n2"]
    assert all(r["used"] == uris[0] and r["why"] == "" for r in reps), reps
    reads = [s.key for s in proxy.seen[seen:] if s.method == "GET" and not s.key.endswith("/")]
    assert not [k for k in reads if k.endswith((".bin", "manifest.json"))], reads
    assert sorted(p for n in NODES for p in c.nvme(n).rglob("*")) == before

    # One launch for the three losses: its ranks restore on each signal.
    # 1. n1 replaced; the Lustre copy gone: the restore reads rank 2's part from n2's
    # replica and rank 3's from n0's.
    c.replace("n1")
    seen = len(proxy.seen)
    procs = start(c, "restores", *uris)
    go(c, "restore1")
    reps = reports(c, "restore1", procs)
    assert [r["node"] for r in reps] == ["n0", "n0", "n1", "n1", "n2", "n2"]
    assert all(r["used"] == uris[0] and r["why"] == "" for r in reps), reps
    reads = [s.key for s in proxy.seen[seen:] if s.method == "GET" and not s.key.endswith("/")]
    assert not [k for k in reads if k.endswith((".bin", "manifest.json"))], reads
    # n1 holds its part again, and the manifest.
    assert manifest(c, "n1")["generation"] == gen
    assert all(
        (c.nvme("n1") / KEY / gen / b["name"]).is_file() for b in m["blobs"] if b["rank"] in (2, 3)
    )

    # 2. n1 replaced again, a flipped byte in a chunk of n2's replica of rank 2: the check
    # on arrival fails and every rank falls back to Lustre.
    shutil.move(away, lustre)
    lose(c, "n1")
    blob = rep_dir / gen / next(b["name"] for b in m["blobs"] if b["rank"] == 2)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    go(c, "restore2")
    reps = reports(c, "restore2", procs)
    assert all(r["used"] == uris[1] for r in reps), reps
    assert len({r["why"] for r in reps}) == 1, reps  # the same reason on every rank
    why = reps[0]["why"]
    assert "its replica did not restore it" in why and "CRC32C" in why, why

    # 3. n1 and n2 lost at once (rank 2's replica was on n2), Lustre's copy gone: S3.
    lose(c, "n1")
    lose(c, "n2")
    shutil.move(lustre, away)
    go(c, "restore3")
    reps = reports(c, "restore3", procs)
    finished(c, "restores", procs)
    assert all(r["used"] == uris[2] for r in reps), reps
    why = reps[0]["why"]
    assert "node n1 lacks its part" in why and "replica" not in why, why
