"""The server's checksums, on both servers: FULL_OBJECT against composite multipart
checksums, and the whole object's CRC32C combined from its parts' checksums listed by
GetObjectAttributes.  The fault proxy's request log shows which calls were made; where a
server does not list part checksums (``tests/s3_servers.py``), the proxy answers
GetObjectAttributes with the real parts' checksums so the combining path still runs."""

from __future__ import annotations

import os
import uuid

import crc32c
import pytest
from s3_servers import as_aws, both_s3_servers

from fmstore import runtime
from fmstore.stores import open_store
from fmstore.stores.s3.util import b64
from fmstore.testing.faultproxy import FaultProxy, Rule

pytestmark = pytest.mark.s3

s3_server = both_s3_servers()

MIB = 1 << 20
PART = 5 * MIB


def run(coro):
    return runtime.run(coro, timeout=60)


@pytest.fixture
def proxied(s3_server, s3_bucket):
    with FaultProxy(s3_server.endpoint_url) as proxy:
        opts = {**s3_server.store_options(), "endpoint_url": proxy.endpoint_url}
        tier = f"ck-{uuid.uuid4().hex[:8]}"
        store = open_store(f"s3://{s3_bucket}/c", tier=tier, metered=False, part_size=PART, **opts)
        yield proxy, store
        proxy.clear()
        run(store.close())


def _attribute_calls(proxy) -> int:
    return sum(1 for method, path in proxy.calls if method == "GET" and "?attributes" in path)


def _write_composite(store, data: bytes) -> None:
    """A streamed write: multipart with a composite checksum of the parts."""

    async def write():
        async with await store.open_writer("obj") as w:
            await w.write(data)

    run(write())


def test_a_full_object_checksum_is_the_whole_objects_from_the_head(proxied):
    proxy, store = proxied
    data = os.urandom(2 * PART + 11)

    async def write():
        w = await store.open_part_writer("obj", len(data), PART)
        for i in range(3):
            await w.write_part(i, data[i * PART : (i + 1) * PART])
        await w.commit()

    run(write())
    proxy.seen.clear()
    assert run(store.stored_crc32c("obj")) == (len(data), crc32c.crc32c(data))
    assert _attribute_calls(proxy) == 0  # FULL_OBJECT: no part listing needed


def test_a_composite_checksum_is_never_taken_for_the_whole_objects(proxied, s3_server):
    """AWS lists the parts' checksums and the whole object's CRC32C is combined from them;
    a server that does not list them leaves it unknown (None), never a wrong value (moto's
    HEAD, without -N or a type, was once taken for the whole object's)."""
    proxy, store = proxied
    data = os.urandom(PART + 11)
    _write_composite(store, data)
    proxy.seen.clear()
    size, crc = run(store.stored_crc32c("obj"))
    assert size == len(data)
    assert crc == as_aws(s3_server, "object_part_checksums", crc32c.crc32c(data), None)
    assert _attribute_calls(proxy) == 1  # GetObjectAttributes was really asked
    assert run(store.get("obj")) == data  # a full read checks the composite checksum


def test_the_whole_crc32c_is_combined_from_listed_part_checksums(proxied, s3_server, s3_bucket):
    """The combining path on both servers: the parts' checksums come from the proxy where
    the server does not list them (its row in the table), else from the server."""
    proxy, store = proxied
    data = os.urandom(PART + 11)
    _write_composite(store, data)
    etag = s3_server.boto3_client().head_object(Bucket=s3_bucket, Key="c/obj")["ETag"]
    parts = [data[:PART], data[PART:]]

    def listing(method: str, path: str) -> bytes:
        rows = "".join(
            f"<Part><PartNumber>{i}</PartNumber><ChecksumCRC32C>{b64(crc32c.crc32c(p))}"
            f"</ChecksumCRC32C><Size>{len(p)}</Size></Part>"
            for i, p in enumerate(parts, 1)
        )
        return (
            '<?xml version="1.0" encoding="UTF-8"?><GetObjectAttributesResponse '
            'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<ETag>{etag.strip(chr(34))}</ETag><ObjectParts><PartsCount>2</PartsCount>"
            f"<MaxParts>1000</MaxParts><IsTruncated>false</IsTruncated>{rows}</ObjectParts>"
            "</GetObjectAttributesResponse>"
        ).encode()

    if as_aws(s3_server, "object_part_checksums", False, True):
        proxy.set_plan([Rule("answer", method="GET", path=r"\?attributes", answer=listing)])
    proxy.seen.clear()
    assert run(store.stored_crc32c("obj")) == (len(data), crc32c.crc32c(data))
    assert _attribute_calls(proxy) == 1

    # Listed checksums that do not give the server's composite one are not trusted.
    parts = [os.urandom(PART), data[PART:]]
    proxy.set_plan([Rule("answer", method="GET", path=r"\?attributes", answer=listing)])
    assert run(store.stored_crc32c("obj")) == (len(data), None)
