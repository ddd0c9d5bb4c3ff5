"""The lean request path for PutObject / GetObject / HeadObject (fmstore.stores.s3_http).

Its signatures must be exactly botocore's (checked against botocore's own signer, and by
SeaweedFS, which verifies every request); its answers and errors must be botocore's shapes;
where it cannot serve a store it falls back to botocore for good.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from urllib.parse import quote

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials as BotoCredentials
from s3_servers import both_s3_servers, unlike_aws

from fmstore import runtime
from fmstore.errors import (
    AlreadyExists,
    InvalidRange,
    NotFound,
    PermissionDenied,
    PreconditionFailed,
    StoreUnavailable,
)
from fmstore.stores import PutOptions, open_store
from fmstore.stores.s3 import STREAM_RING
from fmstore.stores.s3.lean import EMPTY_SHA256, Credentials, Signer
from fmstore.testing.faultproxy import Rule

pytestmark = pytest.mark.s3

s3_server = both_s3_servers()

STAMP = 1795305600.0  # 2026-11-22T00:00:00Z


def run(coro):
    return runtime.run(coro, timeout=60)


def bare_store(url: str, **options):
    """The S3Store itself, unwrapped: these tests look at which request path served."""
    return open_store(url, metered=False, **options)


def botocore_signature(method, url, headers, body, creds, region):
    """The Authorization header botocore computes for the same request at the same time."""
    req = AWSRequest(method=method, url=url, headers=dict(headers), data=body)
    auth = S3SigV4Auth(BotoCredentials(*creds), "s3", region)
    req.context["timestamp"] = "20261122T000000Z"
    auth._modify_request_before_signing(req)  # over http: the payload's SHA-256
    assert req.headers["X-Amz-Content-SHA256"] == hashlib.sha256(body).hexdigest()
    canonical = auth.canonical_request(req)
    signature = auth.signature(auth.string_to_sign(req, canonical), req)
    return signature, auth.signed_headers(auth.headers_to_sign(req))


@pytest.mark.parametrize(
    "key,token,extra",
    [
        ("plain/key.bin", None, {}),
        ("sp ace/ü nicode/a+b=c~d%e&f.bin", None, {"x-amz-meta-note": "two  spaces  here"}),
        ("k", "session-token/with+chars==", {"if-none-match": "*", "range": "bytes=0-9"}),
    ],
)
def test_signature_matches_botocore(key, token, extra):
    creds = ("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    signer = Signer("127.0.0.1:8333", "eu-west-2")
    body = b"hello world"
    path = "/my-bucket/" + quote(key, safe="/~")
    headers = dict(extra)
    signer.sign("PUT", path, headers, hashlib.sha256(body).hexdigest(), Credentials(*creds), STAMP)
    ours = dict(part.split("=", 1) for part in headers["authorization"].split(", ")[1:])
    sig, signed = botocore_signature(
        "PUT", "http://127.0.0.1:8333" + path, extra, body, creds, "eu-west-2"
    )
    assert ours["Signature"] == sig
    assert ours["SignedHeaders"] == signed


def test_query_signature_matches_botocore():
    from fmstore.stores.s3.lean import canonical_query

    creds = ("AKIDEXAMPLE", "secret", None)
    query = {"list-type": "2", "prefix": "a b/ü+&=", "continuation-token": "x/y+z=="}
    qs = canonical_query(query)
    headers: dict[str, str] = {}
    Signer("s3.amazonaws.com", "us-east-1").sign(
        "GET", "/bkt/", headers, EMPTY_SHA256, Credentials(*creds), STAMP, query=qs
    )
    ours = dict(part.split("=", 1) for part in headers["authorization"].split(", ")[1:])
    sig, _ = botocore_signature(
        "GET", f"https://s3.amazonaws.com/bkt/?{qs}", {}, b"", creds, "us-east-1"
    )
    assert ours["Signature"] == sig


def test_empty_payload_hash_is_sha256_of_nothing():
    assert hashlib.sha256(b"").hexdigest() == EMPTY_SHA256


@pytest.fixture
def lean_store(s3_server, s3_bucket):
    store = bare_store(f"s3://{s3_bucket}/lean", **s3_server.store_options())
    yield store
    run(store.close())


def test_round_trip_of_awkward_keys_and_metadata(lean_store):
    """SeaweedFS checks every signature: keys that need escaping, metadata that needs
    trimming, conditions and ranges all pass, on the lean path."""
    keys = ["sp ace/ü/a+b=c~d%e&f.bin", "x/y/z", "(parens)[brackets]{braces}!$'*,;@"]
    for i, key in enumerate(keys):
        data = bytes([i]) * 1000 + key.encode()
        meta = run(lean_store.put(key, data, PutOptions(metadata={"note": "a  b", "n": str(i)})))
        assert lean_store._http is not None, "the lean path should serve SeaweedFS"
        got_meta, got = run(lean_store.get_with_meta(key))
        assert got == data
        assert got_meta.metadata["note"] == "a b" or got_meta.metadata["note"] == "a  b"
        assert got_meta.metadata["n"] == str(i)
        assert got_meta.etag == meta.etag
        assert run(lean_store.get_range(key, 10, 20)) == data[10:20]
        st = run(lean_store.stat(key))
        assert st.size == len(data) and st.mtime is not None
    with pytest.raises(NotFound):
        run(lean_store.stat("missing"))
    with pytest.raises(NotFound):
        run(lean_store.get("missing"))
    with pytest.raises(PreconditionFailed):
        run(lean_store.put(keys[1], b"x", PutOptions(mode="if_match", if_match='"nope"')))


def test_wrong_secret_is_a_clear_permission_error(s3_server, s3_bucket):
    unlike_aws(s3_server, "wrong_credentials")
    opts = {**s3_server.store_options(), "secret_key": "wrong-" + uuid.uuid4().hex}
    store = bare_store(f"s3://{s3_bucket}/p", **opts)
    try:
        with pytest.raises(PermissionDenied, match="SignatureDoesNotMatch|AccessDenied"):
            run(store.put("k", b"data"))
        assert store._http is not None  # refused by the server, not by a fallback
    finally:
        run(store.close())


def test_redirect_falls_back_to_botocore_for_good(s3_server, s3_bucket, fault_proxy):
    opts = {**s3_server.store_options(), "endpoint_url": fault_proxy.endpoint_url}
    store = bare_store(f"s3://{s3_bucket}/r", **opts)
    try:
        run(store.put("before", b"1"))
        assert store._http is not None
        fault_proxy.set_plan([Rule("redirect", method="PUT", times=1)])
        run(store.put("after", b"2"))
        assert store._http is None
        assert run(store.get("after")) == b"2"
        assert run(store.get("before")) == b"1"
    finally:
        run(store.close())


def test_lean_requests_off_uses_botocore_only(s3_server, s3_bucket):
    store = bare_store(
        f"s3://{s3_bucket}/b", **{**s3_server.store_options(), "lean_requests": False}
    )
    try:
        run(store.put("k", b"v", PutOptions(metadata={"a": "1"})))
        assert store._http is None
        meta, data = run(store.get_with_meta("k"))
        assert data == b"v" and meta.metadata["a"] == "1"
    finally:
        run(store.close())


def test_multipart_uploads_match_botocore(s3_server, s3_bucket):
    """Started, completed and aborted by the lean transport or by botocore: the same
    object, metadata and whole-object CRC32C; a create-only upload over an existing object
    is refused; an aborted writer and a refused upload leave no upload behind."""
    boto3 = s3_server.boto3_client()
    data = os.urandom(12 << 20)
    seen = {}
    for lean in (True, False):
        opts = {**s3_server.store_options(), "part_size": 5 << 20, "lean_requests": lean}
        store = bare_store(f"s3://{s3_bucket}/mp-{lean}", **opts)
        try:
            meta = run(store.put("k", data, PutOptions(mode="create", metadata={"a": "1"})))
            assert meta.etag and meta.etag.endswith("-3")
            got, data_back = run(store.get_with_meta("k"))
            assert data_back == data and got.metadata["a"] == "1"
            assert lean == (_client_of(store) is None)
            with pytest.raises(AlreadyExists):
                run(store.put("k", os.urandom(12 << 20), PutOptions(mode="create")))

            async def abandon(store=store):
                w = await store.open_writer("w")
                await w.write(os.urandom(6 << 20))
                await w.abort()

            run(abandon())
            assert (store._http is not None) == lean
            assert lean == (_client_of(store) is None)
            assert not run(store.exists("w"))
            seen[lean] = (got.metadata, run(store.stored_crc32c("k")))
        finally:
            run(store.close())
    assert seen[True] == seen[False]
    assert seen[True][1][1] is not None
    uploads = boto3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads if u["Key"].startswith("mp-")] == []


def test_listing_matches_botocore(s3_server, s3_bucket):
    """Keys XML cannot carry plainly, pagination, delimiters and start-after: the lean
    listing and botocore's agree entry for entry."""
    keys = [f"d{i % 3}/k{i:04d}" for i in range(25)] + ["top", "sp ace/ü+&<>'\"", "e/%41"]
    lean = bare_store(f"s3://{s3_bucket}/l", **s3_server.store_options())
    boto = bare_store(
        f"s3://{s3_bucket}/l", **{**s3_server.store_options(), "lean_requests": False}
    )
    try:
        for k in keys:
            run(lean.put(k, k.encode()))

        def listing(store, **kw):
            async def go():
                return [
                    (m.key, m.size, m.etag, m.is_dir, m.mtime is not None)
                    async for m in store.list(**kw)
                ]

            return run(go())

        for kw in (
            {"page_size": 7},
            {"recursive": False},
            {"prefix": "d1/", "page_size": 2},
            {"start_after": "d1/k0010"},
        ):
            got = listing(lean, **kw)
            assert got == listing(boto, **kw), kw
            assert got
        assert lean._http is not None and boto._http is None
        assert sorted(k for k, *_ in listing(lean)) == sorted(keys)
    finally:
        run(lean.close())
        run(boto.close())


def _client_of(store):
    return store._shared.client if store._shared is not None else None


def test_botocore_client_is_created_only_when_a_call_needs_it(s3_server, s3_bucket):
    """With an endpoint, a region and keys given, reads, listings and writes, multipart
    uploads included, never create botocore's client (0.6 s of start-up for a command); a
    delete does."""
    store = bare_store(
        f"s3://{s3_bucket}/lazy", **{**s3_server.store_options(), "part_size": 5 << 20}
    )
    try:
        run(store.put("small", b"abc"))
        assert run(store.get("small")) == b"abc"
        assert run(store.list_keys("")) == ["small"]
        assert store._http is not None and _client_of(store) is None
        with pytest.raises(NotFound):
            run(store.stat("missing/key"))  # a 404 asks HeadBucket (botocore) why
        assert _client_of(store) is not None
        store2 = bare_store(
            f"s3://{s3_bucket}/lazy", **{**s3_server.store_options(), "part_size": 5 << 20}
        )
        try:
            assert run(store2.get("small")) == b"abc"
            assert store2._shared is store._shared  # one pool for equal options
        finally:
            run(store2.close())
        big = bytes(range(256)) * (48 << 12)  # 12 MiB: a multipart upload
        # Other options: a client of its own, not the one the 404 above created.
        fresh = bare_store(
            f"s3://{s3_bucket}/lazy2", **{**s3_server.store_options(), "part_size": 6 << 20}
        )
        try:
            run(fresh.put("small", b"x"))
            assert _client_of(fresh) is None
            run(fresh.put("big", big))
            assert run(fresh.get("big")) == big
            assert _client_of(fresh) is None
            run(fresh.delete("big"))
            assert _client_of(fresh) is not None
        finally:
            run(fresh.close())
    finally:
        run(store.close())


def test_keys_from_the_environment_serve_the_lean_path_alone(s3_server, s3_bucket, monkeypatch):
    opts = {
        k: v for k, v in s3_server.store_options().items() if k not in ("access_key", "secret_key")
    }
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_SECURITY_TOKEN", raising=False)
    monkeypatch.delenv("AWS_CREDENTIAL_EXPIRATION", raising=False)
    store = bare_store(f"s3://{s3_bucket}/env", **opts)
    try:
        run(store.put("k", b"v"))
        assert run(store.get("k")) == b"v"
        assert store._http is not None and _client_of(store) is None
    finally:
        run(store.close())
    # Credentials that expire are botocore's to refresh: the client is made up front.
    monkeypatch.setenv("AWS_CREDENTIAL_EXPIRATION", "2099-01-01T00:00:00Z")
    store = bare_store(f"s3://{s3_bucket}/env2", **opts)
    try:
        run(store.put("k", b"v"))
        assert _client_of(store) is not None and store._http is not None
    finally:
        run(store.close())


def test_get_into_receives_in_place_and_survives_a_truncated_body(
    s3_server, s3_bucket, fault_proxy
):
    """Ranged reads go straight into the caller's buffer (several ranges at once); a body
    cut short midway is read again into the same place."""
    opts = {**s3_server.store_options(), "endpoint_url": fault_proxy.endpoint_url}
    store = bare_store(f"s3://{s3_bucket}/into", **opts, part_size=5 << 20)
    data = bytes(range(256)) * (13 << 12)  # 13 MiB: three ranges of a 5 MiB part size
    try:
        run(store.put("k", data))
        fault_proxy.set_plan([Rule("truncate", method="GET", times=1, after_bytes=3 << 20)])
        out = bytearray(len(data) - 100)
        run(store.get_into("k", 100, memoryview(out)))
        assert out == data[100:]
        assert fault_proxy.injected["truncate"] == 1
        assert store._http is not None
    finally:
        run(store.close())


def test_a_cancelled_get_into_writes_nothing_more(s3_server, s3_bucket, fault_proxy):
    """Once a read into the caller's buffer is cancelled, the rest of a body still on its
    way never lands there: the copy engine hands such buffers to the next part."""
    opts = {**s3_server.store_options(), "endpoint_url": fault_proxy.endpoint_url}
    store = bare_store(f"s3://{s3_bucket}/cancel", **opts)
    data = b"\x01" * (4 << 20)
    try:
        run(store.put("k", data))
        fault_proxy.set_plan([Rule("pause", method="GET", times=1, after_bytes=1 << 20, delay=1)])
        out = bytearray(len(data))

        async def cancelled():
            task = asyncio.ensure_future(store.get_into("k", 0, memoryview(out)))
            await asyncio.sleep(0.5)  # the first MiB is in, the rest is held back
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            out[:] = bytes(len(out))
            await asyncio.sleep(1.5)  # the stall is over: the rest was sent

        run(cancelled())
        assert out.count(0) == len(out)
        again = bytearray(len(data))
        run(store.get_into("k", 0, memoryview(again)))
        assert again == data
    finally:
        run(store.close())


def test_read_to_streams_through_a_small_ring_on_either_path(s3_server, s3_bucket):
    """The lean path hands the body over ring by ring as it arrives (never more than the
    ring at once); botocore's path hands over its stream's chunks; both in order."""
    data = bytes(range(256)) * (12 << 12)  # 12 MiB
    for lean in (True, False):
        opts = {**s3_server.store_options(), "lean_requests": lean}
        store = bare_store(f"s3://{s3_bucket}/rt-{lean}", **opts)
        try:
            run(store.put("k", data))
            got, sizes = bytearray(), []

            def take(view, got=got, sizes=sizes):
                got.extend(view)
                sizes.append(view.nbytes)
                return asyncio.sleep(0) if len(sizes) % 3 == 0 else None  # some wait

            run(store.read_to("k", 5, len(data) - 5, take))
            assert got == data[5:-5]
            assert (store._http is not None) == lean
            if lean:
                assert max(sizes) == STREAM_RING and len(sizes) > 40
            got.clear()
            run(store.read_to("k", 7, 7, got.extend))
            assert got == b""
            with pytest.raises(InvalidRange):
                run(store.read_to("k", 0, len(data) + 1, got.extend))
            with pytest.raises(NotFound):
                run(store.read_to("missing", 0, 10, got.extend))
        finally:
            run(store.close())


def test_read_to_raises_the_consumers_error_without_retrying(lean_store):
    run(lean_store.put("k", b"z" * (1 << 20)))
    calls = []

    def full(view):
        calls.append(view.nbytes)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left") as e:
        run(lean_store.read_to("k", 0, 1 << 20, full))
    assert type(e.value) is OSError and len(calls) == 1

    async def fails():
        raise ValueError("consumer gave up")

    with pytest.raises(ValueError, match="gave up"):
        run(lean_store.read_to("k", 0, 1 << 20, lambda view: fails()))


def test_read_to_an_object_overwritten_between_attempts_is_unavailable(
    s3_server, s3_bucket, fault_proxy
):
    """Bytes already consumed came from the first version: a resumed GET that finds another
    version must not splice the two."""
    opts = {**s3_server.store_options(), "endpoint_url": fault_proxy.endpoint_url}
    store = bare_store(f"s3://{s3_bucket}/rt-over", **opts)
    boto = s3_server.boto3_client()
    try:
        run(store.put("k", b"1" * (4 << 20)))
        fault_proxy.set_plan([Rule("truncate", method="GET", times=1, after_bytes=2 << 20)])
        got = bytearray()

        def take(view):
            if not got:  # while the first GET is under way, someone overwrites the object
                boto.put_object(Bucket=s3_bucket, Key="rt-over/k", Body=b"2" * (4 << 20))
            got.extend(view)

        with pytest.raises(StoreUnavailable, match="changed while it was read"):
            run(store.read_to("k", 0, 4 << 20, take))
        assert set(got) == {ord("1")}
    finally:
        run(store.close())


@pytest.mark.parametrize(
    "text",
    [
        "Sun, 06 Nov 1994 08:49:37 GMT",
        "Mon, 22 Nov 2026 14:27:03 GMT",
        "Sunday, 06-Nov-94 08:49:37 GMT",
        "Sun Nov  6 08:49:37 1994",
        "Sun, 06 Nov 1994 08:49:37 +0100",
    ],
)
def test_http_dates_parse_as_the_standard_library_does(text):
    from email.utils import parsedate_to_datetime

    from fmstore.stores.s3.lean import _http_date

    assert _http_date(text) == parsedate_to_datetime(text)
    assert _http_date("not a date") is None
