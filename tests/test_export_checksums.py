"""Exports to S3 verified by the server's own CRC32C, not by reading the copy back.

Against the real SeaweedFS through the fault proxy, which lists every request: a verified
export sends no GET of its blobs; a blob replaced behind fmstore's back is caught by the
checksum the server keeps; a server that gives no checksum (the proxy strips it) gets the
blobs read back instead; and a body damaged on the way is refused by the server itself.
"""

from __future__ import annotations

import base64
import dataclasses
import os

import pytest
import torch

import fmstore
from fmstore import runtime
from fmstore.checkpoint.layout import read_manifest_bytes
from fmstore.checkpoint.verify import blob_checksums, verify_checkpoint
from fmstore.stores import open_store
from fmstore.stores.crc import composite_of, crc32c
from fmstore.testing.faultproxy import Rule
from fmstore.tiering.exports.mover import CHECKPOINT_COPY, copy_checkpoint, has_checkpoint

pytestmark = pytest.mark.s3

MiB = 1 << 20
#: Blobs of 7 and 11 MiB: above the engine's threshold (8 MiB) the 11 MiB one goes through
#: the resumable part writer; the 7 MiB one is one put (a single PUT with the store's 8 MiB
#: parts, a multipart upload with 5 MiB ones).
COPY = dataclasses.replace(CHECKPOINT_COPY, multipart_threshold=8 * MiB, part_size=5 * MiB)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("src") / "ckpt")
    g = torch.Generator().manual_seed(0)
    state = {
        "a": torch.randn(MiB // 4, generator=g),
        "b": torch.randn(6 * MiB // 4, generator=g),
        "c": torch.randn(11 * MiB // 4, generator=g),
    }
    fmstore.save(state, root, compression="raw", blob_size=12 * MiB, chunk_size=MiB)
    return root


@pytest.fixture(params=[8 * MiB, 5 * MiB], ids=["put", "multipart-put"])
def stores(request, ckpt, s3_server, s3_bucket, fault_proxy):
    """The source on a file system; the destination through the proxy, and the same
    bucket straight (to change it behind the proxy's back)."""
    opts = {**s3_server.store_options(), "part_size": request.param}
    src = open_store(ckpt, tier="nvme")
    dst = open_store(
        f"s3://{s3_bucket}/ckpt", tier="s3", **{**opts, "endpoint_url": fault_proxy.endpoint_url}
    )
    direct = open_store(f"s3://{s3_bucket}/ckpt", tier="s3", **opts)
    yield src, dst, direct, fault_proxy
    for s in (src, dst, direct):
        runtime.run(s.close(), timeout=30)


def blob_gets(proxy, start: int = 0) -> list[str]:
    """GetObjects of checkpoint blobs (not the manifest, not ListParts of an upload) the
    proxy saw since call ``start``."""
    return [
        p
        for m, p in proxy.calls[start:]
        if m == "GET" and ".bin" in p and "uploadId=" not in p and "attributes" not in p
    ]


def test_an_export_is_verified_without_reading_the_copy_back(stores):
    src, dst, direct, proxy = stores
    _, m = runtime.run(read_manifest_bytes(src))
    assert [b.size for b in m.blobs] == [7 * MiB, 11 * MiB]
    res = runtime.run(copy_checkpoint(src, dst, options=COPY))
    assert runtime.run(has_checkpoint(dst))
    assert blob_gets(proxy) == []
    assert res.check is not None and res.check.by_store_checksum == 2
    # The server keeps the whole object's CRC32C of every blob, equal to the one the
    # manifest's chunk checksums give.
    want = blob_checksums(m)
    for i in range(len(m.blobs)):
        assert runtime.run(direct.stored_crc32c(m.blob_key(i))) == (m.blobs[i].size, want[i])
    check = runtime.run(verify_checkpoint(dst, store_checksums=True))
    assert check.ok and check.by_store_checksum == 2 and check.read_back == 0
    # And the bytes really are the source's (read back once, here, by the test).
    assert runtime.run(verify_checkpoint(direct)).ok


def test_a_blob_replaced_behind_our_back_is_caught_by_the_servers_checksum(stores):
    src, dst, direct, proxy = stores
    _, m = runtime.run(read_manifest_bytes(src))
    runtime.run(copy_checkpoint(src, dst, options=COPY))
    key = m.blob_key(0)
    # Same size, other bytes, uploaded with their own (correct) CRC32C: only a comparison
    # with the manifest's checksum can tell.
    runtime.run(direct.put(key, os.urandom(m.blobs[0].size)))
    start = len(proxy.calls)
    check = runtime.run(verify_checkpoint(dst, store_checksums=True))
    assert not check.ok and check.by_store_checksum == 1 and check.read_back == 0
    assert key in check.problems[0] and "store's CRC32C" in check.problems[0]
    assert blob_gets(proxy, start) == []
    # The mover finds the damaged copy, copies it again and verifies it.
    res = runtime.run(copy_checkpoint(src, dst, options=COPY))
    assert not res.already_there
    assert runtime.run(verify_checkpoint(direct)).ok


def test_a_blob_without_a_server_checksum_is_read_back(stores, s3_server, s3_bucket):
    src, dst, direct, proxy = stores
    _, m = runtime.run(read_manifest_bytes(src))
    runtime.run(copy_checkpoint(src, dst, options=COPY))
    # Replaced by a writer that sends no checksum: the server keeps none for it.
    plain = open_store(
        f"s3://{s3_bucket}/ckpt", tier="s3", **s3_server.store_options(), checksum="off"
    )
    try:
        runtime.run(plain.put(m.blob_key(1), os.urandom(m.blobs[1].size)))
    finally:
        runtime.run(plain.close())
    assert runtime.run(direct.stored_crc32c(m.blob_key(1)))[1] is None
    start = len(proxy.calls)
    check = runtime.run(verify_checkpoint(dst, store_checksums=True))
    assert check.by_store_checksum == 1 and check.read_back == 1
    assert not check.ok and "fails its checksum" in check.problems[0]
    assert blob_gets(proxy, start) and all(m.blob_key(1) in p for p in blob_gets(proxy, start))


def test_without_server_checksums_the_export_reads_the_copy_back(stores):
    src, dst, direct, proxy = stores
    _, m = runtime.run(read_manifest_bytes(src))
    proxy.add(Rule("strip_checksums", method="HEAD"))
    runtime.run(copy_checkpoint(src, dst, options=COPY))
    assert proxy.injected["strip_checksums"] >= 2
    # Every blob was read back (in ranges) by the verification.
    got = blob_gets(proxy)
    assert {k for k in (m.blob_key(i) for i in range(2)) if any(k in p for p in got)} == {
        m.blob_key(0),
        m.blob_key(1),
    }
    check = runtime.run(verify_checkpoint(dst, store_checksums=True))
    assert check.ok and check.read_back == 2 and check.by_store_checksum == 0


def test_a_body_damaged_on_the_way_is_refused_by_the_server(stores):
    src, dst, direct, proxy = stores
    _, m = runtime.run(read_manifest_bytes(src))
    proxy.add(Rule("corrupt_request", method="PUT", path=r"\.bin", times=2))
    runtime.run(copy_checkpoint(src, dst, options=COPY))
    assert proxy.injected["corrupt_request"] == 2
    # The damaged uploads were refused and sent again: the copy holds the source's bytes.
    assert runtime.run(verify_checkpoint(direct)).ok


def test_composite_checksum_math_matches_the_server(s3_server, s3_bucket, s3_store):
    """A streamed upload keeps a composite checksum (the CRC32C of its parts' CRC32Cs):
    the same as fmstore computes from the parts, and not taken for the whole object's
    where the server does not list the parts' checksums (SeaweedFS): read back instead."""
    part = 8 * MiB  # the store's part size: the streamed writer's first parts
    data = os.urandom(2 * part + 12345)

    async def write() -> None:
        async with await s3_store.open_writer("streamed") as w:
            await w.write(data)

    runtime.run(write())
    head = s3_server.boto3_client().head_object(
        Bucket=s3_bucket, Key="prefix/streamed", ChecksumMode="ENABLED"
    )
    pieces = [data[i : i + part] for i in range(0, len(data), part)]
    composite = composite_of(crc32c(p) for p in pieces).to_bytes(4, "big")
    assert head["ChecksumCRC32C"] == f"{base64.b64encode(composite).decode()}-3"
    assert runtime.run(s3_store.stored_crc32c("streamed")) == (len(data), None)
