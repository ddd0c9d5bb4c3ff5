"""Every paginated S3 loop stops on a listing that never ends (issue: a repeated
continuation token ran ``fmstore stage`` for ever, memory growing).

The fault proxy answers the listings itself (:class:`~fmstore.testing.s3pages.HostilePages`):
the same token on every page, two taken in turn, fresh tokens over the same entries, empty
pages, a truncated page without a token, and pages that go on for ever.  Each loop ends in
:class:`~fmstore.errors.CorruptData` naming the tier, after a bounded number of pages counted
in the proxy's request log.  Listings alone need no server behind the proxy; the writer's
part listing at commit and the object-part listing of a checksum need a real upload, on
both servers.
"""

from __future__ import annotations

import os
import uuid

import pytest
from s3_servers import both_s3_servers

from fmstore import runtime
from fmstore.errors import CorruptData
from fmstore.stores import open_store
from fmstore.stores.s3 import pages
from fmstore.testing.faultproxy import FaultProxy, Rule
from fmstore.testing.s3pages import HostilePages
from fmstore.testing.seaweed import free_ports

pytestmark = pytest.mark.s3

s3_server = both_s3_servers()

BOUND = 60
BROKEN = ("same", "cycle", "replay", "empty", "no_marker")


def run(coro):
    return runtime.run(coro, timeout=BOUND)


@pytest.fixture
def lone_proxy():
    """A proxy with nothing behind it (a closed port): it answers every listing itself."""
    (dead,) = free_ports(1)
    with FaultProxy(f"http://127.0.0.1:{dead}") as proxy:
        yield proxy


@pytest.fixture
def tier():
    return f"pg-{uuid.uuid4().hex[:8]}"


def _store(url: str, endpoint: str, tier: str, **extra):
    return open_store(
        url,
        tier=tier,
        metered=False,
        endpoint_url=endpoint,
        access_key="k",
        secret_key="s",
        region="us-east-1",
        addressing_style="path",
        max_attempts=1,
        **extra,
    )


@pytest.fixture
def small_bounds(monkeypatch):
    """Bounds a test reaches in a few dozen pages instead of millions."""
    monkeypatch.setattr(pages, "MAX_EMPTY_PAGES", 20)
    monkeypatch.setattr(pages, "MAX_LIST_PAGES", 30)
    monkeypatch.setattr(pages, "MAX_UPLOAD_PAGES", 30)
    monkeypatch.setattr(pages, "MAX_PART_PAGES", 30)


@pytest.mark.parametrize("mode", [*BROKEN, "endless"])
def test_object_listing_stops_on_pages_that_never_end(lone_proxy, tier, small_bounds, mode):
    lone_proxy.set_plan(
        [Rule("answer", method="GET", path="list-type=2", answer=HostilePages(mode))]
    )
    store = _store("s3://bkt/root", lone_proxy.endpoint_url, tier)

    async def drain() -> int:
        return len([m async for m in store.list("d")])

    try:
        with pytest.raises(CorruptData) as ei:
            run(drain())
        assert ei.value.tier == tier
        assert "pagination is broken" in str(ei.value)
        assert lone_proxy.injected["answer"] <= 31  # the bound, not a page more
    finally:
        run(store.close())


@pytest.mark.parametrize("key", ["root/elsewhere", "root/d", "", "other/d/x"])
def test_a_listed_key_outside_the_prefix_is_refused_before_it_is_yielded(lone_proxy, tier, key):
    """S3 lists only keys under the prefix asked for; one outside it would be taken for
    another key of ours (``root/elsewhere`` as ``here`` under ``d/``) and, say, deleted."""
    body = (
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Contents><Key>root/d/ok</Key></Contents><Contents><Key>{key}</Key></Contents>"
        "<IsTruncated>false</IsTruncated></ListBucketResult>"
    ).encode()
    lone_proxy.set_plan([Rule("answer", method="GET", answer=lambda m, p: body)])
    store = _store("s3://bkt/root", lone_proxy.endpoint_url, tier)
    got: list[str] = []

    async def drain() -> None:
        async for m in store.list("d"):
            got.append(m.key)

    try:
        with pytest.raises(CorruptData, match="outside the prefix") as ei:
            run(drain())
        assert ei.value.tier == tier
        assert got == []  # not even the good key of that page
    finally:
        run(store.close())


@pytest.mark.parametrize("mode", ["same", "cycle", "no_marker", "endless"])
def test_upload_listing_stops_on_pages_that_never_end(lone_proxy, tier, small_bounds, mode):
    lone_proxy.set_plan(
        [Rule("answer", method="GET", path=r"\?uploads", answer=HostilePages(mode))]
    )
    store = _store("s3://bkt/root", lone_proxy.endpoint_url, tier)
    try:
        with pytest.raises(CorruptData, match="multipart upload listing") as ei:
            run(store.leftovers())
        assert ei.value.tier == tier
        assert lone_proxy.injected["answer"] <= 31
    finally:
        run(store.close())


@pytest.fixture
def proxied(s3_server, s3_bucket, tier):
    with FaultProxy(s3_server.endpoint_url) as proxy:
        opts = {**s3_server.store_options(), "endpoint_url": proxy.endpoint_url}
        store = open_store(
            f"s3://{s3_bucket}/p", tier=tier, metered=False, part_size=5 << 20, **opts
        )
        yield proxy, store
        proxy.clear()
        run(store.close())


@pytest.mark.parametrize("mode", ["same", "cycle", "no_marker", "endless"])
def test_the_writers_part_listing_at_commit_stops(
    proxied, s3_server, s3_bucket, tier, small_bounds, mode
):
    proxy, store = proxied
    data = os.urandom((5 << 20) + 10)

    async def write():
        w = await store.open_part_writer("obj", len(data), 5 << 20)
        await w.write_part(0, data[: 5 << 20])
        await w.write_part(1, data[5 << 20 :])
        proxy.set_plan([Rule("answer", method="GET", path="uploadId=", answer=HostilePages(mode))])
        try:
            await w.commit()
        finally:
            proxy.clear()
            await w.abort()

    with pytest.raises(CorruptData, match="upload part listing") as ei:
        run(write())
    assert (ei.value.tier, ei.value.key) == (tier, "obj")
    assert proxy.injected["answer"] <= 31  # endless: part numbers past the bound


@pytest.mark.parametrize("mode", ["same", "cycle", "no_marker"])
def test_the_object_part_listing_of_a_checksum_stops(proxied, s3_server, s3_bucket, tier, mode):
    """A composite checksum is turned into the whole object's from its parts' checksums,
    listed by GetObjectAttributes: a listing that never ends stops there too."""
    proxy, store = proxied

    async def write():
        async with await store.open_writer("obj") as w:
            await w.write(os.urandom((5 << 20) + 10))

    run(write())
    etag = s3_server.boto3_client().head_object(Bucket=s3_bucket, Key="p/obj")["ETag"]
    hostile = HostilePages(mode, etag=etag.strip('"'))
    proxy.set_plan([Rule("answer", method="GET", path=r"\?attributes", answer=hostile)])
    with pytest.raises(CorruptData, match="object part listing") as ei:
        run(store.stored_crc32c("obj"))
    assert (ei.value.tier, ei.value.key) == (tier, "obj")
    assert proxy.injected["answer"] <= 3


def test_a_listing_in_directory_order_is_not_refused(s3_server, s3_bucket):
    """AWS lists keys in UTF-8 order; SeaweedFS walks its directory tree (``d1/k0`` before
    ``d1.x``): the guards refuse repeats, not an order, so both list whole at any page size."""
    store = open_store(f"s3://{s3_bucket}/r", **s3_server.store_options())
    keys = ["d1", "d1.x", "d1/k0", "d1/k1", "d1~", "d10", "d0/k0", "d2/k0"]

    async def go():
        for k in keys:
            await store.put(k, b"x")
        flat = [m.key async for m in store.list("", page_size=2)]
        top = [m.key async for m in store.list("", recursive=False, page_size=1)]
        return flat, top

    try:
        flat, top = run(go())
    finally:
        run(store.close())
    assert sorted(flat) == sorted(keys)
    assert sorted(top) == ["d0/", "d1", "d1.x", "d1/", "d10", "d1~", "d2/"]
