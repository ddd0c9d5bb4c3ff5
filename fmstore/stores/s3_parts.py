"""The resumable part writer of the S3 backend: one multipart upload, the token names it.

Parts go straight into a multipart upload of a hidden temporary key (``TMP_MARK`` in its
name, so listings skip it); the token carries the part size, the temporary key's nonce and
the upload id, so a later process continues the same upload and ``ListParts`` tells which
parts are already there.  Commit completes the upload at the temporary key and copies it
server-side to the final key with the metadata known only then (a whole-object checksum),
under the write's conditions (create-only, if-match); no byte crosses the network twice.
Each part carries its ``Content-MD5``, which S3 checks on every upload whatever the
upload's checksum settings (a resumed upload cannot re-send CRC32C part checksums, which
``ListParts`` does not return on every server).

A writer dropped without commit or abort leaves its upload for resumption, as the
interface asks; a bucket lifecycle rule (``AbortIncompleteMultipartUpload``) bounds how
long such uploads are kept.
"""

from __future__ import annotations

import base64
import hashlib
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import runtime
from ..errors import FmstoreError, InvalidRange, NotFound
from .base import Buffer, ObjectMeta, PartWriter, PutOptions, part_bounds, part_count
from .parts import TMP_MARK

if TYPE_CHECKING:
    from .s3 import S3Store

_PREFIX = "s3mp"


def _tmp_key(full: str, nonce: str) -> str:
    d, _, name = full.rpartition("/")
    tmp = f"{TMP_MARK}mp.{nonce}.{name[:80]}"
    return f"{d}/{tmp}" if d else tmp


class S3PartWriter(PartWriter):
    def __init__(
        self,
        store: S3Store,
        key: str,
        full: str,
        nonce: str,
        upload_id: str,
        size: int,
        part_size: int,
        resumed: bool,
        options: PutOptions,
    ) -> None:
        self.store, self.key, self.full = store, key, full
        self.tmp = _tmp_key(full, nonce)
        self.upload_id, self.size, self.part_size = upload_id, size, part_size
        self.token = f"{_PREFIX}.{part_size:x}.{nonce}.{upload_id}"
        self.resumed, self.options = resumed, options
        self._done = False

    @classmethod
    async def open(
        cls,
        store: S3Store,
        key: str,
        full: str,
        size: int,
        part_size: int,
        token: str | None,
        options: PutOptions,
    ) -> S3PartWriter:
        if token:
            bits = token.split(".", 3)
            if len(bits) == 4 and bits[0] == _PREFIX and bits[1] == f"{part_size:x}":
                nonce, upload_id = bits[2], bits[3]
                try:
                    await store._call(
                        "open_part_writer",
                        key,
                        "list_parts",
                        Key=_tmp_key(full, nonce),
                        UploadId=upload_id,
                        MaxParts=1,
                    )
                except NotFound:
                    pass  # gone (aborted, completed or expired): start afresh
                else:
                    return cls(store, key, full, nonce, upload_id, size, part_size, True, options)
        nonce = uuid.uuid4().hex[:16]
        upload_id = await store._create_upload(key, _tmp_key(full, nonce), {}, checksums=False)
        return cls(store, key, full, nonce, upload_id, size, part_size, False, options)

    def _check_open(self) -> None:
        if self._done:
            raise FmstoreError("part writer is closed", tier=self.store.tier, key=self.key)

    async def write_part(self, index: int, data: Buffer) -> None:
        self._check_open()
        start, end = part_bounds(index, self.size, self.part_size)
        view = memoryview(data).cast("B")
        if view.nbytes != end - start or not 0 <= index < part_count(self.size, self.part_size):
            raise InvalidRange(
                f"part {index} must be {end - start} bytes, not {view.nbytes}",
                tier=self.store.tier,
                key=self.key,
            )
        body = data if isinstance(data, bytes | bytearray) else view.tobytes()
        md5 = await runtime.to_cpu(lambda: hashlib.md5(body).digest())
        await self.store._call(
            "put_part",
            self.key,
            "upload_part",
            Key=self.tmp,
            UploadId=self.upload_id,
            PartNumber=index + 1,
            Body=body,
            ContentMD5=base64.b64encode(md5).decode(),
        )

    async def _parts(self) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        marker = 0
        while True:
            resp = await self.store._call(
                "commit",
                self.key,
                "list_parts",
                Key=self.tmp,
                UploadId=self.upload_id,
                PartNumberMarker=marker,
            )
            for p in resp.get("Parts", []):
                out[int(p["PartNumber"])] = p
            if not resp.get("IsTruncated"):
                return out
            marker = int(resp["NextPartNumberMarker"])

    async def commit(self, metadata: Mapping[str, str] | None = None) -> ObjectMeta:
        self._check_open()
        n = part_count(self.size, self.part_size)
        have = await self._parts()
        parts = []
        for i in range(n):
            start, end = part_bounds(i, self.size, self.part_size)
            p = have.get(i + 1)
            if p is None:
                raise NotFound(
                    f"part {i} of a pending write is missing", tier=self.store.tier, key=self.key
                )
            if int(p.get("Size", end - start)) != end - start:
                raise InvalidRange(
                    f"part {i} has {p.get('Size')} bytes, expected {end - start}",
                    tier=self.store.tier,
                    key=self.key,
                )
            parts.append({"PartNumber": i + 1, "ETag": p["ETag"]})
        head = await self.store._complete(self.key, self.tmp, self.upload_id, parts, PutOptions())
        self._done = True
        try:
            head = await self.store._head(self.key, self.tmp)
            meta = {**(self.options.metadata or {}), **(metadata or {})}
            await self.store._copy_from(self.tmp, head, self.key, self.full, meta, self.options)
        finally:
            await self.store._call("delete", self.key, "delete_object", Key=self.tmp)
        return await self.store.stat(self.key)

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        await self.store._abort_upload(self.key, self.tmp, self.upload_id)
