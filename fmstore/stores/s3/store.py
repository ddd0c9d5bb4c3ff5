"""S3 backend: the ``s3`` tier.

Guarantees beyond the :class:`~fmstore.stores.base.Store` contract:

* **Atomic writes.**  ``put`` is one PutObject, or a multipart upload for objects larger
  than ``part_size``; both become visible at once on completion.  A multipart upload that
  fails, is aborted, whose writer is garbage-collected or whose task is cancelled is
  aborted on the server, so no orphaned upload is left behind.
* **Integrity end to end.**  Every PUT and every part carries its CRC32C
  (``x-amz-checksum-crc32c``) so the server refuses corrupted bytes; objects written by
  ``put`` also record their whole-object CRC32C in ``x-amz-meta-fmstore-crc32c``, streamed
  writes record their part size in ``x-amz-meta-fmstore-part-size`` so the server's
  composite part checksum can be checked.  Every *full* read is checked against one of
  the two (a mismatch is read again once, then raises
  :class:`~fmstore.errors.CorruptData`).
* **Consistent multi-request reads.**  Large reads are split into ranged GETs fetched in
  parallel; every range after the first is conditional on the first response's ETag, so a
  concurrent overwrite restarts the read instead of mixing two versions.
* **Retries** of the whole request, body included (see :mod:`.retry`), under a
  concurrency limit that halves while the server throttles.
* **Conditional writes**: ``mode="create"`` sends ``If-None-Match: *`` and
  ``mode="if_match"`` sends ``If-Match`` (on PutObject, CompleteMultipartUpload and
  CopyObject); with ``conditional_writes=False`` (servers without them) ``create`` is a
  best-effort HEAD check that a concurrent writer can race.

How the backend is laid out: :mod:`.options` (options, part sizes, URLs), :mod:`.client`
(the clients shared by the stores of a process) and :mod:`.core` (a store's binding to
one, and its helpers), :mod:`.transport` (the hot calls on the lean transport,
:mod:`.lean`, or on botocore), :mod:`.reads`, :mod:`.uploads`, :mod:`.writers` and
:mod:`.retry`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import fields
from typing import Any

from ...errors import ConfigError, InvalidRange, NotFound
from ..base import Leftover, ObjectMeta, PartWriter, PutOptions, Writer, part_count
from ..types import TMP_MARK
from . import pages
from .options import MAX_PART, MAX_PARTS, MIN_PART, S3Options, parse_s3_url
from .reads import S3Reads
from .retry import translate
from .uploads import S3Uploads
from .util import all_or_cancel, unquote
from .writers import S3PartWriter, S3Writer


class S3Store(S3Reads, S3Uploads):
    """One bucket (and optionally a prefix inside it) as a :class:`Store`."""

    @classmethod
    def from_url(cls, url: str, *, tier: str = "s3", **options: Any) -> S3Store:
        bucket, prefix = parse_s3_url(url)
        known = {f.name for f in fields(S3Options)}
        unknown = set(options) - known
        if unknown:
            raise ConfigError(f"unknown option(s) for an S3 store: {', '.join(sorted(unknown))}")
        return cls(bucket, prefix, tier=tier, options=S3Options(**options))

    # ---- writers --------------------------------------------------------------------------

    async def open_part_writer(
        self,
        key: str,
        size: int,
        part_size: int,
        *,
        token: str | None = None,
        options: PutOptions = PutOptions(),
    ) -> PartWriter:
        """A resumable multipart upload (see :mod:`.writers`); part layouts S3 cannot take
        (parts under 5 MiB, more than 10,000 parts) fall back to temporary part objects."""
        full = self._full(key)
        if size < 0 or part_size <= 0:
            raise InvalidRange(f"bad size {size} / part size {part_size}", tier=self.tier, key=key)
        n = part_count(size, part_size)
        if (n > 1 and part_size < MIN_PART) or n > MAX_PARTS or part_size > MAX_PART:
            return await super().open_part_writer(
                key, size, part_size, token=token, options=options
            )
        await self._precheck(key, options)
        return await S3PartWriter.open(self, key, full, size, part_size, token, options)

    async def open_writer(self, key: str, options: PutOptions = PutOptions()) -> Writer:
        full = self._full(key)
        await self._precheck(key, options)
        if options.mode == "if_match":
            self._conditions(key, options)  # validate now, not at commit
        w = S3Writer(self, key, full, options)
        self._writers.add(w)
        return w

    # ---- listing, delete ------------------------------------------------------------------

    async def leftovers(self, under: str = "") -> list[Leftover]:
        """The multipart uploads in progress below ``under``, each with the bytes of its
        parts and the time since its newest part (or its start) as ``idle``."""
        prefix = self.root + self._prefix(under)
        out: list[Leftover] = []
        kw: dict[str, Any] = {"Prefix": prefix}
        now = time.time()
        guard = pages.Pages(
            "multipart upload", tier=self.tier, key=under, max_pages=pages.MAX_UPLOAD_PAGES
        )
        while True:
            resp = await self._call("list_uploads", None, "list_multipart_uploads", **kw)
            for u in resp.get("Uploads", []):
                key, upload_id = u.get("Key"), u.get("UploadId")
                if not isinstance(key, str) or not isinstance(upload_id, str):
                    continue
                if not key.startswith(prefix):
                    continue  # the server answered for another prefix: not ours to touch
                size, last = await self._upload_parts(key, upload_id)
                last = max(last, _timestamp(u.get("Initiated")))
                rel = key[len(self.root) :]
                out.append(Leftover("upload", rel, size, max(0.0, now - last), upload_id))
            if not resp.get("IsTruncated"):
                return out
            key_marker, id_marker = resp.get("NextKeyMarker"), resp.get("NextUploadIdMarker")
            guard.next((key_marker, id_marker) if key_marker else None)
            kw = {"Prefix": prefix, "KeyMarker": key_marker}
            if id_marker:
                kw["UploadIdMarker"] = id_marker

    async def _upload_parts(self, full: str, upload_id: str) -> tuple[int, float]:
        """Bytes held by an upload's parts and when the newest was written (0: none)."""
        size, last = 0, 0.0
        kw: dict[str, Any] = {"Key": full, "UploadId": upload_id}
        for _ in range(10_000):  # S3 allows 10,000 parts: a server that pages forever stops
            try:
                resp = await self._call("list_parts", full, "list_parts", **kw)
            except NotFound:  # finished or aborted meanwhile
                break
            for p in resp.get("Parts", []):
                n = p.get("Size")
                if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                    size += n
                last = max(last, _timestamp(p.get("LastModified")))
            marker = resp.get("NextPartNumberMarker")
            if not resp.get("IsTruncated") or marker in (None, kw.get("PartNumberMarker")):
                break
            kw["PartNumberMarker"] = marker
        return size, last

    async def remove_leftover(self, item: Leftover) -> None:
        if item.kind != "upload" or not item.token:
            raise ValueError(f"not an upload of this store: {item.key!r}")
        key = self._key(item.key)
        await self._abort_upload(key, self._full(key), item.token)

    # ---- listing, delete, copy ------------------------------------------------------------

    async def list(
        self,
        prefix: str = "",
        *,
        recursive: bool = True,
        start_after: str | None = None,
        page_size: int = 1000,
    ) -> AsyncIterator[ObjectMeta]:
        p = self._prefix(prefix)
        base: dict[str, Any] = {"Prefix": self.root + p, "MaxKeys": max(1, min(page_size, 1000))}
        if not recursive:
            base["Delimiter"] = "/"
        if start_after:
            base["StartAfter"] = self.root + start_after
        cut = len(self.root)
        token: str | None = None
        guard = pages.Pages("object", tier=self.tier, key=p, max_pages=pages.MAX_LIST_PAGES)
        while True:
            req = dict(base)
            if token:
                req["ContinuationToken"] = token

            async def page(req: dict[str, Any] = req) -> dict[str, Any]:
                return await (await self._objects()).list_objects_v2(**req)

            resp = await self.retrier.call("list", p or None, page)
            raw = [o["Key"] for o in resp.get("Contents", [])]
            raw += [c["Prefix"] for c in resp.get("CommonPrefixes", [])]
            guard.under(raw, base["Prefix"])
            entries = [
                ObjectMeta(
                    key=o["Key"][cut:],
                    size=int(o.get("Size", 0)),
                    mtime=o["LastModified"].timestamp() if o.get("LastModified") else None,
                    etag=unquote(o.get("ETag")),
                )
                for o in resp.get("Contents", [])
                # Temporary objects of pending part writes are not objects yet.
                if not o["Key"].rpartition("/")[2].startswith(TMP_MARK)
                and not o["Key"].endswith("/")
            ]
            # Folder markers (a key ending in "/": the AWS console's "Create folder",
            # Hadoop S3A, rclone) are directories, never files: in a recursive listing each
            # is one directory entry (its directory's own included, so an empty folder is
            # seen); in a flat one the server lists them as common prefixes already.
            if recursive:
                entries += [
                    ObjectMeta(key=o["Key"][cut:], size=0, is_dir=True)
                    for o in resp.get("Contents", [])
                    if o["Key"].endswith("/") and len(o["Key"]) > cut
                ]
            entries += [
                ObjectMeta(key=c["Prefix"][cut:], size=0, is_dir=True)
                for c in resp.get("CommonPrefixes", [])
            ]
            entries.sort(key=lambda m: m.key.encode("utf-8", "surrogatepass"))
            for m in entries:
                yield m
            if not resp.get("IsTruncated"):
                return
            guard.entries(raw)
            token = resp.get("NextContinuationToken")
            guard.next(token, entries=len(raw))

    def _full_or_marker(self, key: str) -> str:
        """The full key; a key ending in "/" (a directory a recursive listing gave) names
        that directory's folder marker."""
        return self.root + self._prefix(key) if key.endswith("/") else self._full(key)

    async def delete(self, key: str) -> None:
        full = self._full(key)
        await self._call("delete", key, "delete_object", Key=full)

    async def delete_many(self, keys: Iterable[str]) -> None:
        """DeleteObjects in batches of 1,000 (S3's limit), batches sent concurrently; a key
        ending in "/" (a directory entry of a recursive listing) names its folder marker."""
        fulls = [self._full_or_marker(k) for k in keys]
        batches = [fulls[i : i + 1000] for i in range(0, len(fulls), 1000)]

        async def one(batch: list[str]) -> None:
            resp = await self._call(
                "delete_many",
                batch[0][len(self.root) :],
                "delete_objects",
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            for err in resp.get("Errors", []):
                if err.get("Code") in ("NoSuchKey", None):
                    continue
                from botocore.exceptions import ClientError

                fake = ClientError({"Error": err, "ResponseMetadata": {}}, "DeleteObjects")
                raise translate(
                    fake,
                    tier=self.tier,
                    key=str(err.get("Key", ""))[len(self.root) :],
                    bucket=self.bucket,
                    op="delete_many",
                )

        await all_or_cancel(one(b) for b in batches)


def _timestamp(value: Any) -> float:
    """Seconds since the epoch of a listing's date (a datetime from botocore), 0 if none."""
    try:
        return float(value.timestamp())
    except (AttributeError, TypeError, ValueError, OverflowError, OSError):
        return 0.0
