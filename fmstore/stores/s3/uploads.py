"""Writes of the S3 backend: single PUTs, multipart uploads and server-side copies.

``put`` is one PutObject, or a multipart upload for objects larger than ``part_size``;
both become visible at once on completion.  A multipart upload that fails or is cancelled
is aborted on the server, so no orphaned upload is left behind.  Every PUT and part carries
its CRC32C (``x-amz-checksum-crc32c``) so the server refuses corrupted bytes, and ``put``
records the whole-object CRC32C in ``x-amz-meta-fmstore-crc32c``.  A retried create-only
write (or completion) that finds the object already there checks whether it was its own
earlier attempt that landed (:func:`landed_ours`, the multipart ETag).

The streamed and resumable writers built on these calls are in :mod:`.writers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from ... import runtime
from ...errors import AlreadyExists, FmstoreError, NotFound, PreconditionFailed
from ..base import Buffer, ObjectMeta, Pieces, PutOptions
from .core import S3Base
from .options import META_CRC, META_PART_SIZE, META_PUT_TOKEN, MiB, put_part_size
from .util import all_or_cancel, b64, crc32c, quote, unquote

log = logging.getLogger(__name__)


def etag_is_md5(sse: str | None) -> bool:
    """Whether a single-part object's ETag is the MD5 of its bytes: not under SSE-KMS
    (``aws:kms``, ``aws:kms:dsse``), where it is opaque."""
    return not (sse or "").startswith("aws:kms")


def landed_ours(head: Mapping[str, Any], *, md5: str | None, token: str | None) -> bool:
    """Whether the object ``head`` describes is the one our retried create-only put wrote:
    by the put's token when it sent one (SSE-KMS), else by the ETag, the bytes' MD5."""
    if token is not None:
        meta = {str(k).lower(): v for k, v in (head.get("Metadata") or {}).items()}
        return meta.get(META_PUT_TOKEN) == token
    return md5 is not None and unquote(head.get("ETag")) == md5


class S3Uploads(S3Base):
    """PutObject, multipart uploads (create, parts, complete, abort) and copies."""

    async def put(self, key: str, data: Buffer, options: PutOptions = PutOptions()) -> ObjectMeta:
        full = self._full(key)
        view = memoryview(data).cast("B")
        await self._precheck(key, options)
        if view.nbytes > self.options.part_size:
            return await self._put_multipart(key, full, view, options)
        body = data if isinstance(data, bytes | bytearray) else view
        return await self._put_single(key, full, body, options)

    async def _put_single(
        self, key: str, full: str, body: bytes | bytearray | memoryview, options: PutOptions
    ) -> ObjectMeta:
        conds = self._conditions(key, options)
        sums, crc = await self._checksum_args(body, options.content_crc32c)
        metadata = dict(options.metadata or {})
        self._check_metadata(key, metadata)
        if crc is not None:
            metadata[META_CRC] = f"{crc:08x}"
        retried = False
        token = None
        if options.mode == "create" and not etag_is_md5(self.options.sse):
            # The ETag cannot tell our landed attempt from another writer's: a token can.
            token = metadata[META_PUT_TOKEN] = os.urandom(12).hex()

        def note(_: BaseException) -> None:
            nonlocal retried
            retried = True

        async def send() -> Any:
            return await (await self._objects()).put_object(
                Key=full,
                Body=body,
                Metadata=metadata,
                **conds,
                **sums,
                **self._sse(),
            )

        try:
            resp = await self.retrier.call(
                "put", key, send, create=options.mode == "create", on_retry=note
            )
        except (AlreadyExists, PreconditionFailed):
            if retried:
                # An earlier attempt may have landed before its connection broke: if the
                # object now holds exactly our bytes, that attempt was ours.
                import hashlib

                head = await self._head(key, full)
                md5 = None
                if token is None:
                    md5 = await runtime.to_cpu(lambda: hashlib.md5(body).hexdigest())
                if landed_ours(head, md5=md5, token=token):
                    return self._meta(key, head, memoryview(body).nbytes)
            raise
        return ObjectMeta(
            key=key,
            size=memoryview(body).nbytes,
            mtime=time.time(),
            etag=unquote(resp.get("ETag")),
            metadata=metadata,
        )

    async def _create_upload(
        self,
        key: str,
        full: str,
        metadata: Mapping[str, str],
        *,
        checksums: bool = True,
        full_object: bool = False,
    ) -> str:
        """Start a multipart upload.  ``checksums``: every part will carry its CRC32C;
        ``full_object``: the server is asked to keep the whole object's CRC32C
        (``FULL_OBJECT``, checked against the one :meth:`_complete` sends) rather than the
        composite checksum of the parts, so a HEAD can later be compared with a checksum
        computed anywhere else (a manifest's).  A server that ignores the request keeps a
        composite one (see :meth:`~.reads.S3Reads.stored_crc32c`)."""
        self._check_metadata(key, metadata)
        extra: dict[str, Any] = dict(self._sse())
        if checksums and self.options.checksum == "crc32c":
            extra["ChecksumAlgorithm"] = "CRC32C"
            if full_object:
                extra["ChecksumType"] = "FULL_OBJECT"
        objects = await self._objects()
        retried = False

        def note(_: BaseException) -> None:
            nonlocal retried
            retried = True

        started = time.time()
        resp = await self.retrier.call(
            "open_writer",
            key,
            lambda: objects.create_multipart_upload(Key=full, Metadata=dict(metadata), **extra),
            on_retry=note,
        )
        upload_id = str(resp["UploadId"])
        if retried:
            await self._abort_strays(key, full, upload_id, started)
        return upload_id

    async def _abort_strays(self, key: str, full: str, ours: str, since: float) -> None:
        """Abort uploads an earlier, unacknowledged CreateMultipartUpload attempt made.

        Such an attempt may have created an upload whose id never reached us; left alone it
        would be orphaned.  Uploads of the same key begun while our attempts ran are taken
        to be ours (a concurrent writer of the very same key in that window would see its
        upload vanish and fail cleanly, never write wrong bytes).
        """
        slack = 2.0  # seconds of clock difference tolerated between client and server
        try:
            resp = await self._call("open_writer", key, "list_multipart_uploads", Prefix=full)
            for u in resp.get("Uploads", []):
                when = u.get("Initiated")
                if (
                    u.get("Key") == full
                    and u.get("UploadId") != ours
                    and when is not None
                    and since - slack <= when.timestamp() <= time.time() + slack
                ):
                    await self._abort_upload(key, full, str(u["UploadId"]))
        except FmstoreError as e:
            log.warning("could not check for stray uploads of %s: %s", full, e)

    async def _upload_part(
        self, key: str, full: str, upload_id: str, number: int, body: Buffer | Pieces
    ) -> dict[str, Any]:
        sums, _ = await self._checksum_args(body)
        resp = await self._put_part(key, full, upload_id, number, body, sums)
        part = {"PartNumber": number, "ETag": resp["ETag"]}
        if "ChecksumCRC32C" in sums:
            part["ChecksumCRC32C"] = resp.get("ChecksumCRC32C") or sums["ChecksumCRC32C"]
        return part

    async def _put_part(
        self,
        key: str,
        full: str,
        upload_id: str,
        number: int,
        body: Buffer | Pieces,
        sums: Mapping[str, str],
    ) -> dict[str, Any]:
        """One UploadPart (on the store's transport), retried; ``body`` may be pieces."""
        args: dict[str, Any] = {"Key": full, "UploadId": upload_id, "PartNumber": number}
        args.update(sums, Body=body)

        async def send() -> dict[str, Any]:
            return await (await self._objects()).upload_part(**args)

        return await self.retrier.call("put_part", key, send)

    async def _complete(
        self,
        key: str,
        full: str,
        upload_id: str,
        parts: list[dict[str, Any]],
        options: PutOptions,
        *,
        whole_crc32c: int | None = None,
    ) -> dict[str, Any]:
        """Complete an upload.  ``whole_crc32c``: the whole object's CRC32C, for an upload
        opened with ``full_object``: the server refuses to complete one whose parts do not
        add up to it (nothing becomes visible)."""
        parts = sorted(parts, key=lambda p: p["PartNumber"])
        sums: dict[str, Any] = {}
        if whole_crc32c is not None and self.options.checksum == "crc32c":
            sums = {"ChecksumCRC32C": b64(whole_crc32c), "ChecksumType": "FULL_OBJECT"}
        retried = False

        def note(_: BaseException) -> None:
            nonlocal retried
            retried = True

        objects = await self._objects()

        async def send() -> Any:
            return await objects.complete_multipart_upload(
                Key=full,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **self._conditions(key, options),
                **sums,
            )

        try:
            return dict(
                await self.retrier.call(
                    "commit", key, send, create=options.mode == "create", on_retry=note
                )
            )
        except (AlreadyExists, PreconditionFailed, NotFound) as e:
            if not retried:
                raise
            # The first attempt may have completed the upload before its answer was lost
            # (the retry then sees NoSuchUpload or a failed precondition); the multipart
            # ETag, the MD5 of the part MD5s, tells whether the object is ours.
            import hashlib

            try:
                digest = hashlib.md5(
                    b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in parts)
                ).hexdigest()
                head = await self._head(key, full)
            except (ValueError, NotFound):
                raise e from None
            if unquote(head.get("ETag")) == f"{digest}-{len(parts)}":
                return head
            raise

    async def _abort_upload(self, key: str, full: str, upload_id: str) -> None:
        objects = await self._objects()
        with contextlib.suppress(NotFound):  # already gone: aborted or completed elsewhere
            await self.retrier.call(
                "abort", key, lambda: objects.abort_multipart_upload(Key=full, UploadId=upload_id)
            )

    async def _put_multipart(
        self, key: str, full: str, view: memoryview, options: PutOptions
    ) -> ObjectMeta:
        size = view.nbytes
        psize = put_part_size(self.options.part_size, size)
        metadata = dict(options.metadata or {})
        crc: int | None = None
        if self.options.checksum != "off":
            crc = options.content_crc32c
            if crc is None:
                crc = await runtime.to_cpu(crc32c, view)
            metadata[META_CRC] = f"{crc:08x}"
        upload_id = await self._create_upload(key, full, metadata, full_object=True)
        done = False
        try:

            async def one(i: int) -> dict[str, Any]:
                # Each part is sent straight from the caller's buffer, never copied.
                async with sem:
                    body = view[i * psize : (i + 1) * psize]
                    return await self._upload_part(key, full, upload_id, i + 1, body)

            sem = asyncio.Semaphore(self.options.max_concurrency)
            count = -(-size // psize)
            parts = await all_or_cancel(one(i) for i in range(count))
            whole = crc if self.options.checksum == "crc32c" else None
            resp = await self._complete(key, full, upload_id, parts, options, whole_crc32c=whole)
            done = True
        finally:
            if not done:
                await asyncio.shield(self._abort_upload(key, full, upload_id))
        return ObjectMeta(
            key=key,
            size=size,
            mtime=time.time(),
            etag=unquote(resp.get("ETag")),
            metadata=metadata,
        )

    async def copy(self, src: str, dst: str, options: PutOptions = PutOptions()) -> ObjectMeta:
        """Server-side copy: CopyObject, or UploadPartCopy parts above ``copy_threshold``."""
        fsrc, fdst = self._full(src), self._full(dst)
        head = await self._head(src, fsrc)
        await self._precheck(dst, options)
        metadata = dict(head.get("Metadata") or {})
        if options.metadata is not None:
            kept = {k: v for k, v in metadata.items() if k.startswith("fmstore-")}
            metadata = {**kept, **options.metadata}
        return await self._copy_from(fsrc, head, dst, fdst, metadata, options)

    async def _copy_from(
        self,
        fsrc: str,
        head: Mapping[str, Any],
        dst: str,
        fdst: str,
        metadata: dict[str, str],
        options: PutOptions,
    ) -> ObjectMeta:
        """Copy the object ``fsrc`` (as ``head`` describes it) to ``dst`` with ``metadata``."""
        self._check_metadata(dst, metadata)
        size = int(head.get("ContentLength", 0))
        source = {"Bucket": self.bucket, "Key": fsrc}
        if size <= self.options.copy_threshold:
            resp = await self._call(
                "copy",
                dst,
                "copy_object",
                create=options.mode == "create",
                Key=fdst,
                CopySource=source,
                CopySourceIfMatch=quote(head["ETag"]),
                MetadataDirective="REPLACE",
                Metadata=metadata,
                **self._conditions(dst, options),
                **self._sse(),
            )
            etag = unquote((resp.get("CopyObjectResult") or {}).get("ETag"))
            return ObjectMeta(key=dst, size=size, mtime=time.time(), etag=etag, metadata=metadata)
        return await self._copy_multipart(dst, fdst, source, head, size, metadata, options)

    async def _copy_multipart(
        self,
        dst: str,
        fdst: str,
        source: dict[str, str],
        head: Mapping[str, Any],
        size: int,
        metadata: dict[str, str],
        options: PutOptions,
    ) -> ObjectMeta:
        # The part layout changes, so a streamed source's part size no longer describes it.
        metadata.pop(META_PART_SIZE, None)
        psize = put_part_size(
            max(self.options.part_size, min(self.options.copy_threshold, 512 * MiB)), size
        )
        # UploadPartCopy parts carry no checksum of ours, so the upload must not ask for one.
        upload_id = await self._create_upload(dst, fdst, metadata, checksums=False)
        done = False
        try:

            async def one(i: int) -> dict[str, Any]:
                a, b = i * psize, min((i + 1) * psize, size)
                resp = await self._call(
                    "copy",
                    dst,
                    "upload_part_copy",
                    Key=fdst,
                    UploadId=upload_id,
                    PartNumber=i + 1,
                    CopySource=source,
                    CopySourceRange=f"bytes={a}-{b - 1}",
                    CopySourceIfMatch=quote(head["ETag"]),
                )
                return {"PartNumber": i + 1, "ETag": resp["CopyPartResult"]["ETag"]}

            parts = await all_or_cancel(one(i) for i in range(-(-size // psize)))
            opts = PutOptions(mode=options.mode, if_match=options.if_match)
            resp = await self._complete(dst, fdst, upload_id, parts, opts)
            done = True
        finally:
            if not done:
                await asyncio.shield(self._abort_upload(dst, fdst, upload_id))
        return ObjectMeta(
            key=dst,
            size=size,
            mtime=time.time(),
            etag=unquote(resp.get("ETag")),
            metadata=metadata,
        )
