"""S3Store against both real S3 servers (SeaweedFS, moto_server), checked through a plain
boto3 client; where the servers differ from AWS, ``tests/s3_servers.py`` has the row."""

from __future__ import annotations

import json
import os

import crc32c
import pytest
from s3_servers import as_aws, both_s3_servers, seaweed_only, unlike_aws

from fmstore import runtime
from fmstore.errors import (
    ConfigError,
    CorruptData,
    FmstoreError,
    NotFound,
    PermissionDenied,
    PreconditionFailed,
    StoreUnavailable,
)
from fmstore.stores import PutOptions, open_store
from fmstore.stores.s3 import META_CRC, put_part_size, writer_part_size
from fmstore.stores.s3.util import b64
from fmstore.testing.store_tests import Backdoor, StoreConformance

pytestmark = pytest.mark.s3

s3_server = both_s3_servers()


class BotoBackdoor(Backdoor):
    """Reads the bucket with boto3 directly, never through fmstore."""

    def __init__(self, client, bucket: str, root: str = "") -> None:
        self.client, self.bucket, self.root = client, bucket, root

    def read(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.root + key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def keys(self) -> list[str]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.root
        ):
            out += [o["Key"][len(self.root) :] for o in page.get("Contents", [])]
        uploads = self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
        out += [f"<upload {u['Key']}>" for u in uploads]
        return sorted(out)

    def write(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.root + key, Body=data)


class TestS3Conformance(StoreConformance):
    """Default options: the hot calls on the lean transport."""

    @pytest.fixture
    def store(self, s3_server, s3_bucket):
        s = open_store(f"s3://{s3_bucket}", **s3_server.store_options())
        yield s
        runtime.run(s.close())

    @pytest.fixture
    def backdoor(self, s3_server, s3_bucket):
        return BotoBackdoor(s3_server.boto3_client(), s3_bucket)

    def test_big_object_roundtrip(self, store, backdoor, s3_server):
        unlike_aws(s3_server, "big_object_roundtrip")
        super().test_big_object_roundtrip(store, backdoor)


class TestS3BotocoreConformance(StoreConformance):
    s3_server = seaweed_only("TestS3BotocoreConformance")
    """The same suite with every call on botocore's transport (``lean_requests=False``)."""

    @pytest.fixture
    def store(self, s3_server, s3_bucket):
        opts = {**s3_server.store_options(), "lean_requests": False}
        s = open_store(f"s3://{s3_bucket}", metered=False, **opts)
        yield s
        assert s._http is None, "every call should have gone to botocore"
        runtime.run(s.close())

    @pytest.fixture
    def backdoor(self, s3_server, s3_bucket):
        return BotoBackdoor(s3_server.boto3_client(), s3_bucket)


class TestReadThroughOverS3Conformance(StoreConformance):
    s3_server = seaweed_only("TestReadThroughOverS3Conformance")
    """ReadThroughStore, a POSIX cache in front of S3 (the lazy restore), as a read-only
    store; the backdoor reads the bucket."""

    read_only = True

    def source(self, store):
        return store.slow

    @pytest.fixture
    def store(self, s3_server, s3_bucket, tmp_path):
        from fmstore.stores import PosixStore
        from fmstore.tiering.managers.cache import ReadThroughStore

        (tmp_path / "fast").mkdir()
        fast = PosixStore(str(tmp_path / "fast"), tier="nvme")
        slow = open_store(f"s3://{s3_bucket}", **s3_server.store_options())
        yield ReadThroughStore(fast, slow)
        runtime.run(slow.close())

    @pytest.fixture
    def backdoor(self, s3_server, s3_bucket):
        return BotoBackdoor(s3_server.boto3_client(), s3_bucket)


class TestS3PrefixConformance(StoreConformance):
    s3_server = seaweed_only("TestS3PrefixConformance")
    """The same suite with the store rooted at a prefix inside the bucket."""

    @pytest.fixture
    def store(self, s3_store):
        return s3_store

    @pytest.fixture
    def backdoor(self, s3_server, s3_bucket):
        return BotoBackdoor(s3_server.boto3_client(), s3_bucket, "prefix/")

    def test_big_object_roundtrip(self, store, backdoor):
        pytest.skip("covered once by TestS3Conformance; 256 MiB twice is slow on small machines")


# ---- S3-specific behaviour ------------------------------------------------------------------


def test_if_match_conditional_put(s3_store):
    m1 = runtime.run(s3_store.put("k", b"one"))
    m2 = runtime.run(s3_store.put("k", b"two", PutOptions(mode="if_match", if_match=m1.etag)))
    assert m2.etag != m1.etag
    with pytest.raises(PreconditionFailed):
        runtime.run(s3_store.put("k", b"three", PutOptions(mode="if_match", if_match=m1.etag)))
    assert runtime.run(s3_store.get("k")) == b"two"


def test_if_match_holds_for_a_multipart_write_too(s3_server, s3_bucket, s3_store):
    """AWS checks If-Match at CompleteMultipartUpload: a stale ETag fails the write (412)
    and leaves neither the new bytes nor an upload behind; the current one commits."""
    unlike_aws(s3_server, "if_match_on_complete")
    m1 = runtime.run(s3_store.put("k", b"one"))
    m2 = runtime.run(s3_store.put("k", b"two"))
    big = os.urandom(9 << 20)

    async def write(etag: str) -> None:
        opts = PutOptions(mode="if_match", if_match=etag)
        async with await s3_store.open_writer("k", opts) as w:
            await w.write(big)

    with pytest.raises(PreconditionFailed):
        runtime.run(write(m1.etag))
    assert runtime.run(s3_store.get("k")) == b"two"
    uploads = s3_server.boto3_client().list_multipart_uploads(Bucket=s3_bucket)
    assert uploads.get("Uploads", []) == []
    runtime.run(write(m2.etag))
    assert runtime.run(s3_store.get("k")) == big


def test_create_mode_multipart_on_existing_key_leaves_no_upload(s3_server, s3_bucket, s3_store):
    runtime.run(s3_store.put("exists", b"first"))

    async def write():
        async with await s3_store.open_writer("exists", PutOptions(mode="create")) as w:
            await w.write(os.urandom(9 << 20))

    from fmstore.errors import AlreadyExists

    with pytest.raises(AlreadyExists):
        runtime.run(write())
    with pytest.raises(AlreadyExists):
        runtime.run(s3_store.put("exists", os.urandom(9 << 20), PutOptions(mode="create")))
    assert runtime.run(s3_store.get("exists")) == b"first"
    assert (
        s3_server.boto3_client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    )


def test_put_records_crc32c_and_sends_it(s3_server, s3_bucket, s3_store):
    data = os.urandom(50_000)
    runtime.run(s3_store.put("c", data))
    head = s3_server.boto3_client().head_object(
        Bucket=s3_bucket, Key="prefix/c", ChecksumMode="ENABLED"
    )
    assert head["Metadata"][META_CRC] == f"{crc32c.crc32c(data):08x}"
    kept = head.get("ChecksumCRC32C")  # the server verified and kept our checksum
    assert kept == as_aws(s3_server, "put_checksum_kept", b64(crc32c.crc32c(data)), None)


def test_tampered_object_is_corrupt_data(s3_server, s3_bucket, s3_store):
    """An object whose recorded CRC32C does not match its bytes is refused on full reads."""
    s3_server.boto3_client().put_object(
        Bucket=s3_bucket, Key="prefix/t", Body=b"payload", Metadata={META_CRC: "00000000"}
    )
    with pytest.raises(CorruptData) as ei:
        runtime.run(s3_store.get("t"))
    assert ei.value.key == "t"
    assert runtime.run(s3_store.get_range("t", 0, 3)) == b"pay"  # ranges are not checkable


def test_writer_sends_parts_from_pieces_in_the_layout_readers_recompute(s3_server, s3_bucket):
    """A big write of pieces goes out as whole parts straight from them; the parts are the
    same as a copying writer's (the composite checksum a reader recomputes from the
    recorded part size matches the server's), whatever the pieces' boundaries."""
    from fmstore.stores.s3.reads import _composite_crc32c

    mib = 1 << 20
    opts = {**s3_server.store_options(), "part_size": 5 * mib, "writer_parts_in_flight": 1}
    store = open_store(f"s3://{s3_bucket}/pieces", **opts)
    sizes = [3, 7 * mib, 1, 2 * mib + 5, 13 * mib, 64, 6 * mib - 1, 4 * mib]
    pieces = [os.urandom(n) for n in sizes]
    data = b"".join(pieces)

    async def write() -> None:
        async with await store.open_writer("obj") as w:
            await w.write([pieces[0]])  # the part being filled is not empty when pieces come
            await w.write(pieces[1:])

    try:
        runtime.run(write())
        head = s3_server.boto3_client().head_object(
            Bucket=s3_bucket, Key="pieces/obj", ChecksumMode="ENABLED"
        )
        parts = -(-len(data) // (5 * mib))
        assert head["ETag"].strip('"').endswith(f"-{parts}")
        want = _composite_crc32c(data, 5 * mib)
        bare = want.partition("-")[0]
        assert head["ChecksumCRC32C"] == as_aws(s3_server, "head_composite_suffix", want, bare)
        assert runtime.run(store.get("obj")) == data  # the full read checks that checksum
    finally:
        runtime.run(store.close())


def test_large_copy_uses_part_copies(s3_server, s3_bucket):
    store = open_store(
        f"s3://{s3_bucket}", copy_threshold=5 << 20, part_size=5 << 20, **s3_server.store_options()
    )
    try:
        data = os.urandom((11 << 20) + 5)
        runtime.run(store.put("src", data, PutOptions(metadata={"color": "red"})))
        meta = runtime.run(store.copy("src", "dst"))
        assert meta.etag and meta.etag.endswith("-3")  # three UploadPartCopy parts
        assert runtime.run(store.get("dst")) == data
        assert runtime.run(store.stat("dst")).metadata["color"] == "red"
    finally:
        runtime.run(store.close())


def test_delete_many_batches_past_1000(s3_server, s3_bucket, s3_store):
    import concurrent.futures as cf

    client = s3_server.boto3_client()
    keys = [f"many/{i:05d}" for i in range(1003)]
    with cf.ThreadPoolExecutor(16) as ex:
        list(
            ex.map(lambda k: client.put_object(Bucket=s3_bucket, Key="prefix/" + k, Body=b""), keys)
        )
    runtime.run(s3_store.delete_many(keys[:1002]))
    assert runtime.run(s3_store.list_keys("many")) == keys[1002:]


def test_part_sizes_keep_under_10000_parts():
    assert put_part_size(8 << 20, 1 << 20) == 8 << 20
    size = 5 << 40  # S3's largest object
    assert -(-size // put_part_size(8 << 20, size)) <= 10_000
    total = sum(writer_part_size(8 << 20, i) for i in range(10_000))
    assert total >= 5 << 40


# ---- bad input: clear fmstore errors, fast ---------------------------------------------------


def test_missing_bucket_is_not_found_naming_the_bucket(s3_server):
    store = open_store("s3://no-such-bucket-here/p", **s3_server.store_options())
    try:
        for op in (
            lambda: store.put("k", b"x"),
            lambda: store.get("k"),
            lambda: store.stat("k"),
            lambda: store.list_keys(""),
        ):
            with pytest.raises(NotFound, match="bucket 'no-such-bucket-here' does not exist") as ei:
                runtime.run(op(), timeout=30)
            assert ei.value.tier == "s3"
    finally:
        runtime.run(store.close())


def test_wrong_credentials_are_permission_denied(s3_server, s3_bucket):
    unlike_aws(s3_server, "wrong_credentials")
    opts = {**s3_server.store_options(), "secret_key": "not-the-secret"}
    store = open_store(f"s3://{s3_bucket}", tier="cold", **opts)
    try:
        with pytest.raises(PermissionDenied) as ei:
            runtime.run(store.put("k", b"x"), timeout=30)
        assert ei.value.tier == "cold" and ei.value.key == "k"
        with pytest.raises(PermissionDenied):
            runtime.run(store.stat("k"), timeout=30)
    finally:
        runtime.run(store.close())


def test_read_only_identity_cannot_write(s3_server, s3_bucket):
    unlike_aws(s3_server, "read_only_identity")
    opts = {
        **s3_server.store_options(),
        "access_key": s3_server.readonly_access_key,
        "secret_key": s3_server.readonly_secret_key,
    }
    store = open_store(f"s3://{s3_bucket}", **opts)
    try:
        with pytest.raises(PermissionDenied, match="AccessDenied"):
            runtime.run(store.put("k", b"x"), timeout=30)
        assert runtime.run(store.list_keys(""), timeout=30) == []
    finally:
        runtime.run(store.close())


def test_unreachable_endpoint_is_store_unavailable(s3_server):
    from fmstore.testing.seaweed import free_ports

    (port,) = free_ports(1)  # nothing listens there
    opts = {
        **s3_server.store_options(),
        "endpoint_url": f"http://127.0.0.1:{port}",
        "max_attempts": 3,
        "connect_timeout": 1.0,
    }
    store = open_store("s3://bucket/p", **opts)
    try:
        with pytest.raises(StoreUnavailable) as ei:
            runtime.run(store.get("k"), timeout=30)
        assert ei.value.tier == "s3" and ei.value.key == "k"
        assert "3 attempts" in str(ei.value)
    finally:
        runtime.run(store.close())


def test_unknown_scheme_and_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="unknown URL scheme"):
        open_store("nosuchscheme://x/y")
    with pytest.raises(ConfigError, match="unknown option"):
        open_store("s3://bucket/p", endpoint="http://x")
    with pytest.raises(ConfigError, match="part_size"):
        open_store("s3://bucket/p", part_size=1024)
    with pytest.raises(ConfigError, match="bucket"):
        open_store("s3://bad_bucket!/p")


def test_store_works_in_a_forked_child(s3_server, s3_bucket):
    """A DataLoader-style fork: the child makes its own client, and the parent's keeps
    working without a single retry (a child closing inherited sockets would stall it)."""
    import multiprocessing as mp

    tier = f"fork-{os.getpid()}"
    store = open_store(f"s3://{s3_bucket}", tier=tier, **s3_server.store_options())
    runtime.run(store.put("f", b"from parent"))
    runtime.run(store.put("gone", b"x"))
    runtime.run(store.delete("never-there"))  # a botocore call: the parent has its client
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            # First call in the child a botocore one: it must make the child's own client.
            runtime.run(store.delete("gone"), timeout=30)
            runtime.run(store.put("child", b"from child"), timeout=30)
            q.put(runtime.run(store.get("f"), timeout=30))
        except BaseException as e:  # report, don't hang the parent
            q.put(repr(e))

    p = ctx.Process(target=child)
    p.start()
    got = q.get(timeout=60)
    p.join(30)
    assert got == b"from parent" and p.exitcode == 0
    try:
        assert runtime.run(store.get("child"), timeout=60) == b"from child"
        assert not runtime.run(store.exists("gone"), timeout=60)
        assert retries_total(tier) == 0
    finally:
        runtime.run(store.close())


def test_a_forked_child_dropping_its_copy_of_a_store_leaves_the_parent_working(
    s3_server, s3_bucket
):
    """A DataLoader worker that discards the store objects it inherited (garbage collected
    there) must not close the parent's pooled connections: their sockets share the parent's
    epoll, and the parent's next read on one would wait for its read timeout, then retry."""
    import gc
    import multiprocessing as mp

    tier = f"forkdrop-{os.getpid()}"
    opts = {**s3_server.store_options(), "read_timeout": 5}
    # Only this dict holds the store, so the child can drop its last reference.
    held = {"store": open_store(f"s3://{s3_bucket}", tier=tier, **opts)}
    runtime.run(held["store"].put("f", b"pooled"))
    assert runtime.run(held["store"].get("f")) == b"pooled"  # a connection is now pooled

    def child():
        held.clear()
        gc.collect()

    p = mp.get_context("fork").Process(target=child)
    p.start()
    p.join(60)
    assert p.exitcode == 0
    try:
        assert runtime.run(held["store"].get("f"), timeout=60) == b"pooled"
        assert retries_total(tier) == 0
    finally:
        runtime.run(held["store"].close())


# ---- resumable part writer ------------------------------------------------------------------


def test_part_writer_resumes_in_a_new_store_and_commits_with_late_metadata(s3_server, s3_bucket):
    """Parts written by one store (process) are found by the token in another; commit adds
    metadata known only at the end and makes the object appear at once."""
    opts = s3_server.store_options()
    size, part = (12 << 20) + 3, 5 << 20
    data = os.urandom(size)
    first = open_store(f"s3://{s3_bucket}/pw", **opts)
    try:
        w = runtime.run(first.open_part_writer("obj", size, part))
        assert not w.resumed
        runtime.run(w.write_part(2, data[10 << 20 :]))
        runtime.run(w.write_part(0, data[: 5 << 20]))
        token = w.token
        assert runtime.run(first.list_keys("")) == []  # nothing visible, temp object hidden
    finally:
        runtime.run(first.close())
    second = open_store(f"s3://{s3_bucket}/pw", **opts)
    try:
        w2 = runtime.run(second.open_part_writer("obj", size, part, token=token))
        assert w2.resumed and w2.token == token
        runtime.run(w2.write_part(1, data[5 << 20 : 10 << 20]))
        # Completing names every part's CRC32C; those of the first store's parts come from
        # the caller (the copy engine journals them), since ListParts may not return them.
        with pytest.raises(FmstoreError, match="CRC32C of part 0"):
            runtime.run(w2.commit({META_CRC: f"{crc32c.crc32c(data):08x}"}))
        earlier = {0: crc32c.crc32c(data[: 5 << 20]), 2: crc32c.crc32c(data[10 << 20 :])}
        meta = runtime.run(w2.commit({META_CRC: f"{crc32c.crc32c(data):08x}"}, part_crc32c=earlier))
        assert meta.size == size
        assert runtime.run(second.get("obj")) == data  # checked against the late CRC32C
        assert runtime.run(second.list_keys("")) == ["obj"]
        client = s3_server.boto3_client()
        assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
        assert keys == ["pw/obj"]
    finally:
        runtime.run(second.close())


def test_part_writer_missing_part_and_abort(s3_server, s3_bucket, s3_store):
    size, part = 11 << 20, 5 << 20
    w = runtime.run(s3_store.open_part_writer("obj", size, part))
    runtime.run(w.write_part(0, os.urandom(part)))
    with pytest.raises(NotFound, match="part 1"):
        runtime.run(w.commit())
    from fmstore.errors import InvalidRange

    with pytest.raises(InvalidRange):
        runtime.run(w.write_part(1, b"short"))
    runtime.run(w.abort())
    runtime.run(w.abort())  # twice is fine
    assert (
        s3_server.boto3_client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    )
    stale = runtime.run(s3_store.open_part_writer("obj", size, part, token=w.token))
    assert not stale.resumed
    runtime.run(stale.abort())


def test_get_with_meta_is_one_consistent_read(s3_store):
    data = os.urandom(11 << 20)
    runtime.run(s3_store.put("m", data, PutOptions(metadata={"k": "v"})))
    meta, got = runtime.run(s3_store.get_with_meta("m"))
    assert got == data and meta.size == len(data) and meta.metadata["k"] == "v" and meta.etag


def test_stores_with_equal_options_share_one_client_until_the_last_closes(s3_server, s3_bucket):
    so = s3_server.store_options()
    a = open_store(f"s3://{s3_bucket}/share-a", **so)
    b = open_store(f"s3://{s3_bucket}/share-b", **so)
    other = open_store(f"s3://{s3_bucket}/share-c", **{**so, "max_concurrency": 3})
    runtime.run(a.put("k", b"a"))
    runtime.run(b.put("k", b"b"))
    runtime.run(other.put("k", b"c"))
    ca, cb, cc = (runtime.run(s.inner._cli()) for s in (a, b, other))
    assert ca is cb and cc is not ca
    shared = a.inner._shared
    runtime.run(a.close())
    assert runtime.run(b.get("k")) == b"b"  # still open for b
    runtime.run(b.close())
    assert shared.closed  # the last user closed the client and its pool
    # A store opened afterwards gets a fresh client.
    d = open_store(f"s3://{s3_bucket}/share-a", **so)
    assert runtime.run(d.get("k")) == b"a"
    assert runtime.run(d.inner._cli()) is not ca
    for s in (d, other):
        runtime.run(s.close())


def test_a_store_dropped_without_close_leaves_no_unclosed_pool_warning(s3_server, s3_bucket):
    """Its pools stay open until exit, where the runtime closes them: no aiohttp warning
    at garbage collection, none at exit."""
    import subprocess
    import sys

    code = f"""
import gc, json
from fmstore import runtime
from fmstore.stores import open_store
opts = json.loads({json.dumps(json.dumps(s3_server.store_options()))})
store = open_store("s3://{s3_bucket}/drop", **opts)
runtime.run(store.put("k", b"v"))
assert runtime.run(store.get("k")) == b"v"
del store
gc.collect()
print("dropped")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "dropped" in r.stdout
    assert "Unclosed" not in r.stderr, r.stderr


def retries_total(tier: str) -> float:
    """Requests of ``tier`` retried so far in this process, for any reason."""
    from prometheus_client import REGISTRY

    return sum(
        s.value
        for m in REGISTRY.collect()
        if m.name == "fmstore_store_retries"
        for s in m.samples
        if s.labels.get("tier") == tier and s.name.endswith("_total")
    )
