"""The protocol's decisions (fmstore.protocol.decisions), as pure functions of facts: no
store, no torch, no clock but the one passed in."""

from __future__ import annotations

import json

import pytest

from fmstore.errors import CorruptData, VersionError
from fmstore.protocol import decisions as pr

GEN = "g000000000001-00000001"
TTL, SKEW = 120.0, 10.0


def _manifest(**over) -> bytes:
    d = {
        "format": "fmstore-dcp",
        "version": 2,
        "generation": GEN,
        "created": 1000.0,
        "blobs": [
            {"name": "000000.bin", "size": 5, "rank": 0},
            {"name": "000001.bin", "size": 7, "rank": 1},
        ],
        "parts": [{"node": "n0", "ranks": [0]}, {"node": "n1", "ranks": [1]}],
    }
    d.update(over)
    return json.dumps(d).encode()


def _facts(**over) -> pr.ManifestFacts:
    return pr.manifest_facts(_manifest(**over), crc32c=1, where="t")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{}",
        b"[]",
        b'{"format": "fmstore-checkpoint"}',
        b'{"format": "something-else", "version": 1}',
        _manifest(generation=""),
        _manifest(generation="../x"),
        _manifest(blobs=[{"name": "a", "size": -1}]),
        _manifest(blobs=[{"name": "a/b", "size": 1}]),
        _manifest(blobs=[{"name": "a", "size": "1"}]),
        _manifest(blobs="x"),
        _manifest(created="soon"),
        _manifest(created=True),
        _manifest(parts=[{"node": 3, "ranks": [0]}]),
    ],
)
def test_what_is_not_a_manifest_is_refused_by_name(data):
    with pytest.raises(CorruptData, match="at t"):
        pr.manifest_facts(data, crc32c=0, where="t")


def test_a_newer_format_version_is_not_counted():
    with pytest.raises(VersionError):
        pr.manifest_facts(_manifest(version=99), crc32c=0, where="t")


def test_a_manifest_created_past_now_plus_the_skew_is_not_committed():
    f = _facts(created=2000.0)
    sizes = {"000000.bin": 5, "000001.bin": 7}
    assert pr.step_committed(f, sizes=sizes, node=None, now=1990.0, skew=SKEW) is None
    got = pr.step_committed(f, sizes=sizes, node=None, now=1989.0, skew=SKEW)
    assert got is pr.Problem.CREATED_IN_FUTURE


def test_blobs_must_be_there_with_their_sizes_and_a_node_checks_its_part_only():
    f = _facts()
    now = 1000.0
    assert pr.step_committed(f, sizes={"000000.bin": 5}, node=None, now=now, skew=SKEW) is (
        pr.Problem.BLOB_MISSING
    )
    bad = {"000000.bin": 5, "000001.bin": 6}
    assert pr.step_committed(f, sizes=bad, node=None, now=now, skew=SKEW) is pr.Problem.BLOB_SIZE
    assert pr.step_committed(f, sizes={"000000.bin": 5}, node="n0", now=now, skew=SKEW) is None
    assert pr.step_committed(f, sizes={}, node="n0", now=now, skew=SKEW) is pr.Problem.BLOB_MISSING
    assert pr.step_committed(f, sizes={}, node="n9", now=now, skew=SKEW) is pr.Problem.NO_PART_HERE
    # Retired by a restore that passed it over: never counted, whatever else is there.
    retired = {"000000.bin": 5, "000001.bin": 7, "retired.json": 90}
    assert pr.step_committed(f, sizes=retired, node=None, now=now, skew=SKEW) is (
        pr.Problem.RETIRED
    )
    # Validated before (the catalog knows this checksum): no listing, the clock still counts.
    assert pr.step_committed(f, sizes=None, node=None, now=now, skew=SKEW) is None


def test_a_record_holds_by_its_content_only():
    part = [("000000.bin", 5, 11)]
    there = {"000000.bin": 5}
    assert pr.record_holds(part, part, there)
    assert not pr.record_holds([], part, there)  # lists nothing: vouches for nothing
    assert not pr.record_holds([], [], there)  # a part of no blobs is no part
    assert not pr.record_holds([("000001.bin", 7, 12)], part, {**there, "000001.bin": 7})
    assert not pr.record_holds([("000000.bin", 5, 99)], part, there)  # another checksum
    assert not pr.record_holds(part, part, {"000000.bin": 4})  # not there with its size
    assert not pr.record_holds(part, part, {})


def test_a_lease_is_alive_for_its_lifetime_plus_the_skew_on_the_readers_clock():
    assert pr.lease_alive(100.0, now=100.0 + TTL + SKEW - 0.001, ttl=TTL, skew=SKEW)
    assert not pr.lease_alive(100.0, now=100.0 + TTL + SKEW, ttl=TTL, skew=SKEW)


def test_a_part_is_removed_only_with_no_commit_and_no_other_live_lease():
    kw = {"now": 1000.0, "ttl": TTL, "skew": SKEW}
    assert pr.may_remove_part("n0", {}, committed=False, **kw)
    assert pr.may_remove_part("n0", {"n0": 999.0}, committed=False, **kw)  # its own lease
    assert not pr.may_remove_part("n0", {}, committed=True, **kw)
    assert not pr.may_remove_part("n0", {"n1": 999.0}, committed=False, **kw)
    assert pr.may_remove_part("n0", {"n1": 1000.0 - TTL - SKEW}, committed=False, **kw)


def test_a_commit_holds_only_while_its_lease_looks_alive_to_every_node_through_the_write():
    assert pr.commit_holds(0.0, now=0.0, ttl=TTL, skew=SKEW)
    limit = TTL / 2 - SKEW  # half the lifetime is left for the write itself
    assert pr.commit_holds(0.0, now=limit - 0.001, ttl=TTL, skew=SKEW)
    assert not pr.commit_holds(0.0, now=limit, ttl=TTL, skew=SKEW)


@pytest.mark.parametrize("clock_b", [-SKEW, 0.0, SKEW])
def test_no_interleaving_of_supersede_and_commit_leaves_a_commit_missing_a_part(clock_b):
    """Every interleaving of the store calls of one committer B (renew lease, list records,
    write manifest) and one superseder A (remove record, read leases, read manifest, delete
    blobs), B's clock ``clock_b`` apart from A's, time advancing by up to the lease
    lifetime between any two calls: whenever B's manifest is written with A's record
    listed, A's blobs are there (I2)."""
    import itertools

    b_ops, a_ops = ["renew", "list", "commit"], ["unrecord", "leases", "manifest", "delete"]
    for order in set(itertools.permutations([0] * 3 + [1] * 4)):
        for gaps in itertools.product((0.0, TTL / 4, TTL), repeat=len(order)):
            t = 0.0  # real time; A's clock reads t, B's clock t + clock_b
            renewed = None
            record, listed_a, manifest, blobs = True, False, False, True
            lease_seen: float | None = None
            now_a = 0.0
            manifest_seen = False
            a_stopped = False
            bi = ai = 0
            for who, gap in zip(order, gaps, strict=True):
                t += gap
                if who == 0:
                    op = b_ops[bi]
                    bi += 1
                    if op == "renew":
                        renewed = t + clock_b
                    elif op == "list":
                        listed_a = record
                    elif (
                        listed_a
                        and renewed is not None
                        and pr.commit_holds(renewed, now=t + clock_b, ttl=TTL, skew=SKEW)
                    ):
                        manifest = True  # the write lands (within TTL / 2: no gap here)
                        assert blobs, (order, gaps)
                else:
                    if a_stopped:
                        continue
                    op = a_ops[ai]
                    ai += 1
                    if op == "unrecord":
                        record = False
                    elif op == "leases":
                        lease_seen, now_a = renewed, t  # A's clock, before the manifest
                    elif op == "manifest":
                        manifest_seen = manifest
                    else:
                        leases = {} if lease_seen is None else {"b": lease_seen}
                        if pr.may_remove_part(
                            "a", leases, committed=manifest_seen, now=now_a, ttl=TTL, skew=SKEW
                        ):
                            blobs = False
                        else:
                            record, a_stopped = True, True
            assert not (manifest and listed_a and not blobs)
