"""S3's versions of two built-on Store calls, used by the copy engine.

* ``get_with_meta``: one GET returns the bytes and the user metadata together (the
  default would add a HEAD per object, doubling the requests of a small-file copy).
* ``open_part_writer``: a multipart upload whose upload id is the resume token.  A later
  process lists the upload's parts (``ListParts``) to learn their ETags, uploads only the
  missing ones and completes it.  Metadata is fixed when the upload is created, so keys
  passed to ``commit`` that were not given at open are dropped (the engine passes what it
  knows up front: the source version, POSIX attributes and the checksum when the source
  recorded one).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import runtime
from ..errors import InvalidRange, NotFound
from .base import Buffer, ObjectMeta, PartWriter, PutOptions, part_bounds, part_count

if TYPE_CHECKING:
    from .s3 import S3Store

#: S3's multipart limits.
MAX_PARTS = 10_000
MIN_PART = 5 << 20


async def get_with_meta(store: S3Store, key: str) -> tuple[ObjectMeta, bytes]:
    from .s3 import _unquote

    full = store._full(key)
    try:
        resp, data = await store._get(key, full, 0, None)
    except NotFound:
        await store._check_bucket(key)
        raise
    except InvalidRange:  # an empty object answers a ranged GET with 416 on some servers
        meta = await store.stat(key)
        return meta, b""
    if store.options.checksum != "off":
        await store._verify(key, full, resp, _unquote(resp.get("ETag")), data)
    return store._meta(key, resp, len(data)), data


class S3PartWriter(PartWriter):
    def __init__(
        self,
        store: S3Store,
        key: str,
        size: int,
        part_size: int,
        upload_id: str,
        parts: dict[int, dict[str, Any]],
        resumed: bool,
        options: PutOptions,
    ) -> None:
        self.store, self.key, self.full = store, key, store._full(key)
        self.size, self.part_size, self.options = size, part_size, options
        self.token, self.resumed = upload_id, resumed
        self._parts = parts  # part number (1-based) -> CompleteMultipartUpload entry
        self._done = False

    @classmethod
    async def open(
        cls,
        store: S3Store,
        key: str,
        size: int,
        part_size: int,
        token: str | None,
        options: PutOptions,
    ) -> S3PartWriter:
        if part_count(size, part_size) > MAX_PARTS:
            raise InvalidRange(
                f"{size} bytes need more than {MAX_PARTS} parts of {part_size}",
                tier=store.tier,
                key=key,
            )
        if part_size < MIN_PART and size > part_size:
            raise InvalidRange(
                f"S3 parts must be at least 5 MiB, not {part_size}", tier=store.tier, key=key
            )
        full = store._full(key)
        await store._precheck(key, options)
        if token:
            try:
                parts = await cls._list_parts(store, key, full, token)
            except NotFound:
                pass  # the upload was completed, aborted or expired: start afresh
            else:
                return cls(store, key, size, part_size, token, parts, True, options)
        # No ChecksumAlgorithm on the upload: completing one that has it needs every part's
        # checksum, and ListParts (on SeaweedFS) does not return them to a resuming process.
        # Parts carry Content-MD5 instead, and the engine checks each part's CRC32C.
        resp = await store._call(
            "open_writer",
            key,
            "create_multipart_upload",
            Key=full,
            Metadata=dict(options.metadata or {}),
            **store._sse(),
        )
        upload_id = str(resp["UploadId"])
        return cls(store, key, size, part_size, upload_id, {}, False, options)

    @staticmethod
    async def _list_parts(
        store: S3Store, key: str, full: str, upload_id: str
    ) -> dict[int, dict[str, Any]]:
        parts: dict[int, dict[str, Any]] = {}
        kw: dict[str, Any] = {"Key": full, "UploadId": upload_id}
        while True:
            resp = await store._call("list_parts", key, "list_parts", **kw)
            for p in resp.get("Parts", []):
                entry = {"PartNumber": int(p["PartNumber"]), "ETag": p["ETag"]}
                if p.get("ChecksumCRC32C"):
                    entry["ChecksumCRC32C"] = p["ChecksumCRC32C"]
                parts[int(p["PartNumber"])] = entry
            if not resp.get("IsTruncated"):
                return parts
            kw["PartNumberMarker"] = resp.get("NextPartNumberMarker")

    async def write_part(self, index: int, data: Buffer) -> None:
        if self._done:
            raise ValueError("writer is closed")
        start, end = part_bounds(index, self.size, self.part_size)
        view = memoryview(data).cast("B")
        if view.nbytes != end - start:
            raise InvalidRange(
                f"part {index} must be {end - start} bytes, not {view.nbytes}",
                tier=self.store.tier,
                key=self.key,
            )
        body = data if isinstance(data, bytes | bytearray) else view.tobytes()
        digest = await runtime.to_cpu(lambda: hashlib.md5(body).digest())
        resp = await self.store._call(
            "put_part",
            self.key,
            "upload_part",
            Key=self.full,
            UploadId=self.token,
            PartNumber=index + 1,
            Body=body,
            ContentMD5=base64.b64encode(digest).decode(),
        )
        self._parts[index + 1] = {"PartNumber": index + 1, "ETag": resp["ETag"]}

    async def commit(self, metadata: Mapping[str, str] | None = None) -> ObjectMeta:
        if self._done:
            raise ValueError("writer is closed")
        n = part_count(self.size, self.part_size)
        if self.size == 0:
            # S3 needs at least one part; an empty object is simpler as a plain put.
            await self.abort()
            return await self.store.put(self.key, b"", self.options)
        missing = [i for i in range(1, n + 1) if i not in self._parts]
        if missing:
            raise NotFound(
                f"parts {missing[:5]} of the pending upload are missing",
                tier=self.store.tier,
                key=self.key,
            )
        entries = [dict(self._parts[i]) for i in range(1, n + 1)]
        if not all("ChecksumCRC32C" in e for e in entries):
            # Some servers (SeaweedFS) list parts without their checksums, and refuse a
            # completion that gives checksums for some parts only: give none then (every
            # part was checked on upload).
            for e in entries:
                e.pop("ChecksumCRC32C", None)
        resp = await self.store._complete(self.key, self.full, self.token, entries, self.options)
        self._done = True
        del resp
        return await self.store.stat(self.key)

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        await asyncio.shield(self.store._abort_upload(self.key, self.full, self.token))
