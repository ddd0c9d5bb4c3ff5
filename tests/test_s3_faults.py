"""S3Store through a fault-injecting proxy: every operation returns the right bytes or a
clear fmstore error, within a bounded time, and leaves no multipart upload behind."""

from __future__ import annotations

import asyncio
import gc
import os
import uuid

import pytest
from prometheus_client import REGISTRY
from s3_servers import both_s3_servers, like_aws, unlike_aws

from fmstore import runtime
from fmstore.errors import CorruptData, FmstoreError, StoreUnavailable
from fmstore.stores import PutOptions, open_store
from fmstore.stores.s3 import S3Store
from fmstore.testing.faultproxy import Rule

pytestmark = pytest.mark.s3

s3_server = both_s3_servers()

#: Upper bound for any single operation in these tests; a hang fails the test.
BOUND = 60


def run(coro):
    return runtime.run(coro, timeout=BOUND)


def retries(tier: str, reason: str) -> float:
    return (
        REGISTRY.get_sample_value("fmstore_store_retries_total", {"tier": tier, "reason": reason})
        or 0.0
    )


@pytest.fixture
def tier():
    return f"s3f-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def store(s3_server, s3_bucket, fault_proxy, tier):
    opts = {
        **s3_server.store_options(),
        "endpoint_url": fault_proxy.endpoint_url,
        "read_timeout": 1.0,
        "connect_timeout": 1.0,
        "max_attempts": 8,
        "retry_deadline": 30.0,
        "retry_base_delay": 0.01,
        "part_size": 5 << 20,
        "max_concurrency": 8,
    }
    s = open_store(f"s3://{s3_bucket}/data", tier=tier, metered=False, **opts)
    assert isinstance(s, S3Store)
    yield s
    fault_proxy.clear()
    run(s.close())


@pytest.fixture
def boto(s3_server):
    return s3_server.boto3_client()


def pending(boto, bucket):
    return boto.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def test_slowdown_burst_is_retried_and_concurrency_drops(store, fault_proxy, tier, boto, s3_bucket):
    fault_proxy.set_plan([Rule("slowdown", method="PUT", times=24)])
    blobs = {f"b/{i}": os.urandom(1000 + i) for i in range(24)}

    async def go():
        await asyncio.gather(*(store.put(k, v) for k, v in blobs.items()))

    run(go())
    assert fault_proxy.injected["slowdown"] == 24
    assert retries(tier, "throttled") == 24
    assert store.limiter.min_seen < store.limiter.max_limit
    for k, v in blobs.items():
        assert boto.get_object(Bucket=s3_bucket, Key="data/" + k)["Body"].read() == v


def test_limiter_grows_back_after_throttling(store, fault_proxy):
    fault_proxy.set_plan([Rule("slowdown", times=6)])
    for i in range(6):
        run(store.put(f"g/{i}", b"x"))
    low = store.limiter.limit
    assert low < store.limiter.max_limit
    for i in range(40):
        run(store.put(f"g/{i}", b"y"))
    assert store.limiter.limit > low


@pytest.mark.parametrize("fault", ["reset", "truncate", "stall", "error"])
def test_reads_survive_faults_mid_body(store, fault_proxy, fault, boto, s3_bucket):
    data = os.urandom(12 << 20)  # three ranges of 5 MiB (last one short)
    run(store.put("big", data))
    fault_proxy.set_plan([Rule(fault, method="GET", times=2, delay=30)])
    assert run(store.get("big")) == data
    assert fault_proxy.injected[fault] == 2
    fault_proxy.set_plan([Rule(fault, method="GET", times=1, delay=30)])
    assert run(store.get_range("big", 1000, 7 << 20)) == data[1000 : 7 << 20]
    out = bytearray(6 << 20)
    fault_proxy.set_plan([Rule(fault, method="GET", times=1, delay=30)])
    run(store.get_into("big", 3, memoryview(out)))
    assert bytes(out) == data[3 : 3 + (6 << 20)]


@pytest.mark.parametrize("fault", ["reset", "truncate", "stall", "error"])
def test_streamed_read_resumes_where_a_fault_cut_it(store, fault_proxy, fault):
    """``read_to`` hands over each byte once, in order: a GET cut short is resumed from the
    first byte not yet consumed, not sent again from the start."""
    data = os.urandom(9 << 20)
    run(store.put("streamed", data))
    fault_proxy.set_plan([Rule(fault, method="GET", times=2, after_bytes=3 << 20, delay=30)])
    got = bytearray()
    run(store.read_to("streamed", 1000, len(data) - 7, got.extend))
    assert got == data[1000:-7]
    assert fault_proxy.injected[fault] == 2


def test_corrupted_full_read_is_caught_and_read_again(store, fault_proxy, tier):
    """Bytes flipped on the wire fail the recorded CRC32C: read once more, then CorruptData.

    (Partial ranges carry no checksum S3 could give us; they rely on TCP's.)"""
    for key, data in (("small", os.urandom(100_000)), ("big", os.urandom(12 << 20))):
        run(store.put(key, data))
        fault_proxy.set_plan([Rule("corrupt_response", method="GET", times=1)])
        before = retries(tier, "checksum")
        assert run(store.get(key)) == data
        assert retries(tier, "checksum") == before + 1
    fault_proxy.set_plan([Rule("corrupt_response", method="GET")])
    with pytest.raises(CorruptData) as ei:
        run(store.get("small"))
    assert ei.value.key == "small" and "CRC32C" in str(ei.value)


def test_streamed_object_is_checked_against_the_composite_checksum(store, fault_proxy):
    parts = [os.urandom(5 << 20), os.urandom(5 << 20), os.urandom(1000)]

    async def write():
        async with await store.open_writer("streamed") as w:
            for p in parts:
                await w.write(p)

    run(write())
    assert "fmstore-part-size" in run(store.stat("streamed")).metadata
    assert run(store.get("streamed")) == b"".join(parts)
    fault_proxy.set_plan([Rule("corrupt_response", method="GET", path="streamed")])
    with pytest.raises(CorruptData, match="composite"):
        run(store.get("streamed"))


@pytest.mark.parametrize(
    "fault", ["reset_request", "corrupt_request", "slowdown", "reset", "stall"]
)
def test_multipart_upload_survives_faults(
    store, fault_proxy, fault, boto, s3_bucket, tier, s3_server
):
    if fault == "corrupt_request":
        unlike_aws(s3_server, "checksum_verified")
    parts = [os.urandom(4 << 20) for _ in range(4)]
    fault_proxy.set_plan([Rule(fault, method="PUT", path=r"partNumber=", times=2, delay=30)])

    async def write():
        async with await store.open_writer("mp") as w:
            for p in parts:
                await w.write(p)

    run(write())
    assert fault_proxy.injected[fault] == 2
    got = boto.get_object(Bucket=s3_bucket, Key="data/mp")["Body"].read()
    assert got == b"".join(parts)
    assert pending(boto, s3_bucket) == []
    if fault == "corrupt_request":
        # The server refused the flipped bytes (or, on a loaded machine, answered after the
        # client's 1 s read timeout): either way both corrupted parts were sent again.
        assert retries(tier, "checksum") + retries(tier, "timeout") >= 2


def test_put_commit_fault_is_retried(store, fault_proxy, boto, s3_bucket, s3_server):
    unlike_aws(s3_server, "checksum_verified")
    data = os.urandom(11 << 20)
    fault_proxy.set_plan(
        [
            Rule("reset", method="POST", path=r"uploadId=", times=1),
            Rule("corrupt_request", method="PUT", times=1),
        ]
    )
    run(store.put("big", data, PutOptions(mode="create")))
    assert boto.get_object(Bucket=s3_bucket, Key="data/big")["Body"].read() == data
    assert pending(boto, s3_bucket) == []


@pytest.mark.parametrize("lean", [True, False])
def test_an_error_in_a_200_answer_is_retried(s3_server, s3_bucket, fault_proxy, boto, tier, lean):
    """S3 may answer a CompleteMultipartUpload 200 and report its failure in the body: on
    either transport that is a server error, retried, never a success."""
    opts = {
        **s3_server.store_options(),
        "endpoint_url": fault_proxy.endpoint_url,
        "retry_base_delay": 0.01,
        "part_size": 5 << 20,
        "lean_requests": lean,
    }
    store = open_store(f"s3://{s3_bucket}/e200-{lean}", tier=tier, metered=False, **opts)
    data = os.urandom(11 << 20)
    fault_proxy.set_plan(
        [
            Rule("error_200", method="POST", path=r"uploadId=", times=1),
            Rule("error_200", method="POST", path=r"\?uploads", times=1),
        ]
    )
    try:
        run(store.put("big", data, PutOptions(mode="create")))
        assert fault_proxy.injected["error_200"] == 2
        assert (store._http is not None) == lean
        got = boto.get_object(Bucket=s3_bucket, Key=f"e200-{lean}/big")["Body"].read()
        assert got == data
        assert pending(boto, s3_bucket) == []
    finally:
        run(store.close())


def test_random_faults_every_operation_is_right_or_a_clear_error(
    store, fault_proxy, boto, s3_bucket, s3_server
):
    """Faults at random on every kind of request: nothing is ever returned wrong or short."""
    fault_proxy.set_plan(
        [
            Rule(f, rate=0.04, delay=30)
            for f in ("slowdown", "error", "reset", "truncate", "reset_request")
        ]
        + [Rule("stall", rate=0.01, delay=30)]
    )
    blobs = {
        f"r/{i:02d}": os.urandom((i * 397) % 70000 + (6 << 20 if i % 7 == 0 else 0))
        for i in range(21)
    }
    outcomes = {"ok": 0, "error": 0}

    async def one(k: str, v: bytes) -> None:
        try:
            await store.put(k, v)
            assert await store.get(k) == v
            assert await store.get_range(k, 10, len(v) // 2) == v[10 : len(v) // 2]
            outcomes["ok"] += 1
        except FmstoreError as e:  # allowed: a clear error naming tier and key
            assert e.tier == store.tier and e.key == k, e
            outcomes["error"] += 1

    async def go():
        await asyncio.gather(*(one(k, v) for k, v in blobs.items()))

    run(go())
    assert outcomes["ok"] + outcomes["error"] == len(blobs)
    try:
        listed = run(store.list_keys("r"))
        assert listed == sorted(listed)
        assert set(listed) <= set(blobs)
        run(store.delete_many(listed))
    except FmstoreError as e:
        assert e.tier == store.tier
    assert sum(fault_proxy.injected.values()) > 0
    fault_proxy.clear()
    if like_aws(s3_server, "upload_initiated"):  # strays of lost attempts are found
        assert pending(boto, s3_bucket) == []
    for k in run(store.list_keys("r")):  # whatever is there is intact
        assert run(store.get(k)) == blobs[k]


def test_list_and_delete_survive_faults(store, fault_proxy, boto, s3_bucket):
    keys = [f"l/{i:03d}" for i in range(30)]
    for k in keys:
        boto.put_object(Bucket=s3_bucket, Key="data/" + k, Body=b"1")
    fault_proxy.set_plan(
        [Rule("truncate", method="GET", times=2), Rule("slowdown", method="GET", times=2)]
    )

    async def listed():
        return [m.key async for m in store.list("l", page_size=7)]

    assert run(listed()) == keys
    fault_proxy.set_plan(
        [
            Rule("reset", method="POST", path=r"\?delete", times=1),
            Rule("error", method="DELETE", times=1),
        ]
    )
    run(store.delete_many(keys[:20]))
    run(store.delete(keys[20]))
    fault_proxy.clear()
    assert run(store.list_keys("l")) == keys[21:]


def test_s3_down_is_store_unavailable_then_recovers(store, fault_proxy, s3_server, s3_bucket, tier):
    run(store.put("k", b"v"))
    fault_proxy.down()
    try:
        with pytest.raises(StoreUnavailable) as ei:
            run(store.get("k"))
        assert ei.value.tier == tier and ei.value.key == "k"
        assert "attempts" in str(ei.value)
    finally:
        fault_proxy.up()
    assert run(store.get("k")) == b"v"


def test_outage_during_multipart_leaves_no_upload(store, fault_proxy, boto, s3_bucket):
    async def write():
        w = await store.open_writer("mp")
        await w.write(os.urandom(5 << 20))  # starts the upload, first part in flight
        fault_proxy.set_plan([Rule("error", method="PUT")])  # every part now fails
        try:
            await w.write(os.urandom(5 << 20))
            await w.commit()
        except StoreUnavailable:
            await w.abort()
        else:
            raise AssertionError("commit succeeded through a permanent 500")

    run(write())
    fault_proxy.clear()
    assert pending(boto, s3_bucket) == []
    assert not run(store.exists("mp"))


def test_cancelled_writer_task_aborts_its_upload(store, fault_proxy, boto, s3_bucket):
    started = asyncio.Event()

    async def write():
        async with await store.open_writer("cancel-me") as w:
            await w.write(os.urandom(5 << 20))
            started.set()
            while True:
                await w.write(os.urandom(1 << 20))

    async def go():
        t = asyncio.ensure_future(write())
        await started.wait()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    fault_proxy.set_plan([Rule("stall", method="PUT", path=r"partNumber=", delay=5)])
    run(go())
    fault_proxy.clear()
    assert pending(boto, s3_bucket) == []


def test_dropped_writer_is_aborted_when_collected(store, boto, s3_bucket):
    async def start():
        w = await store.open_writer("dropped")
        await w.write(os.urandom(6 << 20))
        await asyncio.sleep(0)
        return None  # w goes out of scope uncommitted

    run(start())
    gc.collect()

    async def wait_for_abort():
        for _ in range(200):
            if not pending(boto, s3_bucket):
                return True
            await asyncio.sleep(0.05)
        return False

    assert run(wait_for_abort())


@pytest.mark.parametrize("fault", ["reset", "truncate", "stall"])
def test_lost_create_upload_answer_leaves_no_stray_upload(
    store, fault_proxy, fault, boto, s3_bucket, s3_server
):
    """The server creates an upload but its answer is lost: the retry makes a second one,
    and the first (whose id we never learnt) must not be orphaned."""
    unlike_aws(s3_server, "upload_initiated")
    fault_proxy.set_plan([Rule(fault, method="POST", path=r"\?uploads", times=1, delay=30)])
    data = os.urandom(11 << 20)
    run(store.put("mp", data))
    assert fault_proxy.injected[fault] == 1
    assert boto.get_object(Bucket=s3_bucket, Key="data/mp")["Body"].read() == data
    assert pending(boto, s3_bucket) == []


def test_cancelled_big_write_stops_its_direct_parts_and_aborts(
    store, fault_proxy, boto, s3_bucket, s3_server
):
    unlike_aws(s3_server, "cancelled_big_write")
    # 8 parts of 5 MiB in one write: the leading ones go out straight from the caller's
    # buffer, and all stall on the way.
    data = os.urandom(40 << 20)
    fault_proxy.set_plan([Rule("stall", method="PUT", path=r"partNumber=", delay=5)])

    async def write():
        async with await store.open_writer("cancel-big") as w:
            await w.write(data)

    async def go():
        t = asyncio.ensure_future(write())
        while not fault_proxy.injected["stall"] and not t.done():
            await asyncio.sleep(0.01)  # until a part is on its way
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    run(go())
    fault_proxy.clear()
    assert pending(boto, s3_bucket) == []
    assert run(store.list_keys("")) == []


def test_failing_direct_part_fails_the_write_and_aborts(store, fault_proxy, boto, s3_bucket):
    data = os.urandom(40 << 20)
    fault_proxy.set_plan([Rule("reset", method="PUT", path=r"partNumber=2&")])

    async def write():
        async with await store.open_writer("fails") as w:
            await w.write(data)

    with pytest.raises(StoreUnavailable):
        run(write())
    fault_proxy.clear()
    assert pending(boto, s3_bucket) == []
    assert run(store.list_keys("")) == []
