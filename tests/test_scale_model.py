"""The arithmetic of the model of checkpointing at scale (benchmarks/scale_model.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from benchmarks.scale_model import (
    LLAMA_70B,
    LLAMA_405B,
    MANIFEST_WAYS,
    Inputs,
    Job,
    Limit,
    MiB,
    Phase,
    TiB,
    fsx_throughput,
    get_requests,
    local_check,
    manifest_bytes,
    manifest_entries,
    manifest_phase,
    predict,
    prefixes_needed,
    put_requests,
    replica_spread,
    s3_objects,
    s3_save_requests,
    shared_fraction,
    targets,
)

INP = Inputs(
    nvme_write=2e9,
    nvme_read=3e9,
    lustre_export=1e9,
    s3_export=0.5e9,
    lustre_read=1.5e9,
    s3_read=1e9,
    replica_pair=1e9,
)

#: This machine's figures of two runs (docs/scale.md): 2026-11-26 (write slower than read)
#: and the --quick run of 2026-11-27 (the other way round).  The targets of issue 49 must
#: hold on the model's rates as measured, not tuned to meet them.
DOCS = Inputs(
    nvme_write=0.39e9,
    nvme_read=0.64e9,
    lustre_export=72e6,
    s3_export=18e6,
    lustre_read=1.31e9,
    s3_read=0.23e9,
    replica_pair=0.69e9,
)
QUICK = DOCS.but(
    nvme_write=0.98e9,
    nvme_read=0.38e9,
    s3_export=28e6,
    lustre_read=0.62e9,
    s3_read=0.45e9,
    replica_pair=0.88e9,
)


def test_the_jobs_of_the_issue_have_their_size():
    assert LLAMA_70B.params == pytest.approx(70.6e9, rel=0.01)
    assert LLAMA_405B.params == pytest.approx(405.9e9, rel=0.01)
    assert LLAMA_70B.nodes == 128 and LLAMA_405B.nodes == 2048
    # ~14 bytes per parameter: about 7.7 GB per node of the 70B job
    assert LLAMA_70B.node_bytes == pytest.approx(7.7e9, rel=0.01)
    assert sum(LLAMA_70B.rank_items()) == pytest.approx(LLAMA_70B.rank_bytes)


def test_a_phase_takes_its_slowest_limit_after_what_it_waits_for():
    ph = Phase("x", (Limit("a", 10, 5), Limit("b", 30, 10, shared=True)), before=1.0)
    assert ph.binding.name == "b" and ph.binding.shared
    assert ph.seconds == pytest.approx(4.0)
    assert Limit("none", 1, 0).seconds == math.inf


def test_put_requests_one_put_or_a_multipart_upload_of_at_most_10000_parts():
    assert put_requests(1, 8 * MiB) == 1
    assert put_requests(8 * MiB, 8 * MiB) == 1
    assert put_requests(20 * MiB, 8 * MiB) == 3 + 2  # create, 3 parts, complete
    huge = 200_000 * MiB  # parts grow to whole MiB so that 10,000 suffice
    assert put_requests(huge, 8 * MiB) == 10_000 + 2


def test_items_of_at_least_direct_min_are_blobs_of_their_own_the_rest_packed_in_streams():
    job = Job("t", 2, 2, layers=1, hidden=1024, ffn=4096, kv=256, vocab=32000, bytes_per_param=12)
    items = job.rank_items()
    big = [b for b in items if b >= 1 * MiB]
    objs = s3_objects(job, INP.but(direct_min=1 * MiB, streams=3))
    assert sorted(objs[: len(big)]) == sorted(big)
    assert len(objs) == len(big) + 3
    assert sum(objs) == pytest.approx(sum(items))
    per_rank = sum(put_requests(s, INP.part_size) for s in objs) + 1  # + the rank record
    assert s3_save_requests(job, INP.but(direct_min=1 * MiB, streams=3)) == 2 * per_rank + 1


def test_restore_gets_one_per_chunk_of_large_items_and_merged_requests_for_small_ones():
    job = Job("t", 1, 1, layers=1, hidden=1024, ffn=4096, kv=256, vocab=32000, bytes_per_param=3)
    items = job.rank_items()
    large = sum(math.ceil(b / INP.chunk_size) for b in items if b >= INP.read_direct_min)
    small = sum(b for b in items if b < INP.read_direct_min)
    assert get_requests(job, INP) == large + math.ceil(small / INP.read_max_request)


def test_fsx_is_sized_in_steps_of_2_4_tib_for_the_copies_it_holds():
    job = LLAMA_70B
    tib = INP.fsx_copies * job.total_bytes / TiB
    want = math.ceil(tib / 2.4) * 2.4 * INP.fsx_per_tib
    assert fsx_throughput(job, INP) == pytest.approx(want)
    tiny = Job("t", 8, 8, layers=1, hidden=64, ffn=64, kv=64, vocab=64)
    assert fsx_throughput(tiny, INP) == pytest.approx(1.2 * INP.fsx_per_tib)


def test_predict_chains_the_phases_and_names_the_limit_that_binds():
    p = predict(LLAMA_70B, INP)
    ph = p.phases
    stall = LLAMA_70B.rank_bytes / INP.d2h_gpu
    nb = LLAMA_70B.node_bytes
    assert ph["stall"].seconds == pytest.approx(stall)
    assert ph["on NVMe"].seconds == pytest.approx(stall + nb / INP.nvme_write)
    # before replicas from memory: after the commit, each part read back, sent, written
    peer = max(nb / INP.nvme_read, nb / INP.nvme_write, nb / (8 * INP.replica_pair))
    back = ph["on a peer, read back after the commit (before)"]
    assert back.seconds == pytest.approx(ph["on NVMe"].seconds + peer)
    assert back.binding.name == "partner writes the replica"
    lustre = max(nb / INP.lustre_export, LLAMA_70B.total_bytes / fsx_throughput(LLAMA_70B, INP))
    assert ph["on Lustre"].seconds == pytest.approx(ph["on NVMe"].seconds + lustre)
    assert ph["on Lustre"].binding.name == "FSx throughput" and ph["on Lustre"].binding.shared
    s3 = max(nb / INP.s3_export, p.save_requests / INP.s3_put_per_prefix)
    assert ph["on S3"].seconds == pytest.approx(ph["on NVMe"].seconds + s3)


def test_more_prefixes_lift_the_request_limit_until_the_nodes_rate_binds():
    job = LLAMA_405B
    one = predict(job, INP).phases["on S3"]
    assert one.binding.name.startswith("S3 PUTs per prefix")
    need = prefixes_needed(job, INP)["put"]
    assert need > 1
    enough = predict(job, INP.but(prefixes=need)).phases["on S3"]
    assert enough.binding.name == "S3 export"
    short = predict(job, INP.but(prefixes=need - 1)).phases["on S3"]
    assert short.binding.name.startswith("S3 PUTs per prefix")
    # a node faster than this would be held back by one prefix
    above = one.shared_above(job.node_bytes)
    assert above == pytest.approx(
        job.node_bytes * INP.s3_put_per_prefix / s3_save_requests(job, INP)
    )
    assert predict(job, INP).phases["stall"].shared_above(job.node_bytes) is None
    # larger parts need fewer requests
    assert s3_save_requests(job, INP.but(part_size=64 * MiB)) < s3_save_requests(job, INP)


def test_restore_from_a_replica_is_bounded_per_node_without_one_by_the_shared_tier():
    p = predict(LLAMA_405B, INP)
    man = p.phases["the manifest at restore (every rank)"].seconds
    rep = p.phases["restore, one node lost, from the replica"]
    assert not rep.binding.shared
    nb = LLAMA_405B.node_bytes
    # the placement spreads the lost part over 8 holders (2,048 nodes of 8 GPUs): each reads
    # its own part and an eighth of the replica from its NVMe, after the manifest
    assert rep.before == pytest.approx(man)
    assert rep.binding.name == "a holder reads its part and 1/8 of the replica"
    assert rep.seconds == pytest.approx(man + 1.125 * nb / INP.nvme_read)
    today = p.phases["restore, one node lost, from the replica: written back, then read (today)"]
    assert today.seconds == pytest.approx(man + nb / INP.nvme_write + nb / INP.nvme_read)
    lus = p.phases["restore, one node lost, no replica: every rank from Lustre"]
    assert lus.binding.name == "FSx throughput"
    assert lus.seconds > rep.seconds


@pytest.mark.parametrize("inp", [INP, DOCS, QUICK], ids=["test", "2026-11-26", "quick-run"])
@pytest.mark.parametrize("job", [LLAMA_70B, LLAMA_405B], ids=["70B", "405B"])
def test_replicas_from_memory_meet_the_save_targets(job, inp):
    ph = predict(job, inp).phases
    nb, link = job.node_bytes, min(8 * inp.replica_pair, inp.nic)
    stall = job.rank_bytes / inp.d2h_gpu
    mem = ph["on a peer (in memory)"]
    # sending overlaps the local write: the slower of the two, plus the last chunk's trip
    want = stall + max(nb / inp.nvme_write, nb / link) + inp.chunk_size / link
    assert mem.seconds == pytest.approx(want)
    durable = ph["durable on the peer's NVMe"]
    assert durable.seconds == pytest.approx(stall + max(2 * nb / inp.nvme_write, nb / link))
    got = targets(job, inp)
    assert got["peer in memory / NVMe"] <= 1.2
    assert got["durable on peer / NVMe"] <= 2.05
    # the read-back design it replaces did not meet the first one
    back = ph["on a peer, read back after the commit (before)"].seconds
    assert back / ph["on NVMe"].seconds > 1.2


@pytest.mark.parametrize("inp", [INP, DOCS, QUICK], ids=["test", "2026-11-26", "quick-run"])
def test_a_lost_node_restores_within_1_5x_from_the_placements_spread_replica(inp):
    job = LLAMA_70B
    ph = predict(job, inp).phases
    nothing = ph["restore, nothing lost"]
    assert nothing.own == pytest.approx(job.node_bytes / inp.nvme_read)
    # fmstore's placement spreads a node's part over its 8 ranks' holders (128 nodes):
    # each holder reads an eighth more than its own part
    assert replica_spread(job) == 8
    got = targets(job, inp)
    assert got["lost, from the replica / nothing lost"] == pytest.approx(1.125)
    assert got["lost, from the replica / nothing lost"] <= 1.5
    assert got["lost, from memory / nothing lost"] <= 1.5
    # the spread is the placement's: 2 nodes spread over 1 holder (2x), 3 over 2 (1.5x)
    for nodes, want in ((2, 2.0), (3, 1.5)):
        small = replace(job, gpus=8 * nodes)
        assert replica_spread(small) == nodes - 1
        assert targets(small, inp)["lost, from the replica / nothing lost"] == pytest.approx(want)
    # today's restore writes the part back before every node reads: slower than both
    today = ph["restore, one node lost, from the replica: written back, then read (today)"]
    assert today.own + today.before - nothing.before > 1.5 * nothing.own


def test_the_manifest_grows_with_ranks_and_every_rank_reading_it_binds_at_scale():
    job = LLAMA_70B
    per_rank = sum(max(1, math.ceil(b / DOCS.chunk_size)) for b in job.rank_items())
    assert manifest_entries(job, DOCS) == per_rank * job.gpus
    assert manifest_bytes(job, DOCS) == pytest.approx(per_rank * job.gpus * 490)
    # 1,024 ranks parsing a 1 GB manifest take far longer than reading the part; each parses
    # it once (the collective's check hands it to the Reader)
    today = manifest_phase(job, DOCS, "every rank")
    assert today.binding.name == "every rank parses it once"
    assert today.seconds == pytest.approx(manifest_entries(job, DOCS) / DOCS.manifest_parse)
    data = job.node_bytes / DOCS.nvme_read
    assert today.seconds > 10 * data
    # every rank's own slice: a rank's share, under a tenth of the part's read
    cut = manifest_phase(job, DOCS, "slices")
    assert cut.seconds < data / 10
    assert manifest_phase(job, DOCS, "per node").seconds <= today.seconds
    # the restore's rows wait for the way the Inputs name
    p = predict(job, DOCS.but(manifest="slices"))
    assert p.phases["restore, nothing lost"].before == pytest.approx(cut.seconds)
    # 405B on 16,384 GPUs: over the 4 GiB a restore reads of a manifest today
    assert manifest_bytes(LLAMA_405B, DOCS) > 4 * (1 << 30)
    assert set(MANIFEST_WAYS) == {"every rank", "per node", "slices"}
    with pytest.raises(ValueError, match="manifest way"):
        manifest_phase(job, DOCS, "gossip")


def test_on_this_machine_the_shared_disk_binds_once_there_are_two_nodes():
    inp = INP.but(save_fixed_s=0.5, load_fixed_s=0.25)
    one = local_check(inp, 1, 1e9)
    three = local_check(inp, 3, 1e9)
    assert one["save to NVMe"].seconds == pytest.approx(0.5 + 1e9 / inp.nvme_write)
    assert three["save to NVMe"].binding.shared
    assert three["save to NVMe"].seconds == pytest.approx(0.5 + 3e9 / inp.nvme_write)
    assert three["restore from NVMe"].seconds == pytest.approx(0.25 + 3e9 / inp.nvme_read)
    assert three["save to S3"].seconds == pytest.approx(3e9 / inp.s3_export)
    # a disk that serves many writers faster than one: one node's rate binds up to a point
    fast = local_check(inp.but(disk_write_all=2 * inp.nvme_write), 2, 1e9)["save to NVMe"]
    assert not fast.binding.shared
    assert fast.seconds == pytest.approx(0.5 + 1e9 / inp.nvme_write)
    slow = local_check(inp.but(disk_write_all=2 * inp.nvme_write), 3, 1e9)["save to NVMe"]
    assert slow.binding.shared
    # a many-writer figure below one writer's (the load moved between them): one node
    # alone still writes at its own rate
    low = local_check(inp.but(disk_write_all=inp.nvme_write / 4), 1, 1e9)["save to NVMe"]
    assert low.seconds == pytest.approx(0.5 + 1e9 / inp.nvme_write)
    # replicas from memory: every node's part and replica through the one disk
    rep = local_check(inp, 2, 1e9)["save to NVMe with replicas"]
    assert rep.binding.name == "parts and replicas, one disk for all"
    assert rep.seconds == pytest.approx(0.5 + 4e9 / inp.nvme_write)


def test_inputs_round_trip_through_json_and_ignore_unknown_keys():
    data = json.loads(json.dumps({**INP.to_json(), "extra": 1}))
    assert Inputs.from_json(data) == INP


def test_shared_fraction_is_0_when_nodes_keep_their_speed_and_1_when_they_take_turns():
    assert shared_fraction(2.0, 2.0, 3) == 0.0
    assert shared_fraction(2.0, 6.0, 3) == pytest.approx(1.0)
    assert shared_fraction(2.0, 4.0, 3) == pytest.approx(0.5)
    assert shared_fraction(2.0, 9.0, 1) == 0.0
