"""The arithmetic of the model of checkpointing at scale (benchmarks/scale_model.py)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.scale_model import (
    LLAMA_70B,
    LLAMA_405B,
    Inputs,
    Job,
    Limit,
    MiB,
    Phase,
    TiB,
    fsx_throughput,
    get_requests,
    local_check,
    predict,
    prefixes_needed,
    put_requests,
    s3_objects,
    s3_save_requests,
    shared_fraction,
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
    # after the commit: each part read back, sent, written by the partner; the slowest binds
    peer = max(nb / INP.nvme_read, nb / INP.nvme_write, nb / (8 * INP.replica_pair))
    assert ph["on a peer"].seconds == pytest.approx(ph["on NVMe"].seconds + peer)
    assert ph["on a peer"].binding.name == "partner writes the replica"
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
    rep = p.phases["restore, one node lost, from the replica"]
    assert not rep.binding.shared
    nb = LLAMA_405B.node_bytes
    # the part comes back (bound by the new node's write), then every node reads its own
    assert rep.seconds == pytest.approx(nb / INP.nvme_write + nb / INP.nvme_read)
    lus = p.phases["restore, one node lost, no replica: every rank from Lustre"]
    assert lus.binding.name == "FSx throughput"
    assert lus.seconds > rep.seconds


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


def test_inputs_round_trip_through_json_and_ignore_unknown_keys():
    data = json.loads(json.dumps({**INP.to_json(), "extra": 1}))
    assert Inputs.from_json(data) == INP


def test_shared_fraction_is_0_when_nodes_keep_their_speed_and_1_when_they_take_turns():
    assert shared_fraction(2.0, 2.0, 3) == 0.0
    assert shared_fraction(2.0, 6.0, 3) == pytest.approx(1.0)
    assert shared_fraction(2.0, 4.0, 3) == pytest.approx(0.5)
    assert shared_fraction(2.0, 9.0, 1) == 0.0
