"""The writers of the S3 backend: :class:`S3Writer`, a streamed multipart upload, and
:class:`S3PartWriter`, a resumable one.

:class:`S3Writer` uploads up to ``writer_parts_in_flight`` parts while the caller keeps
writing; objects smaller than one part become a single PUT.  Its parts grow with the part
number (:func:`~.options.writer_part_size`) and it records its base part size in
``x-amz-meta-fmstore-part-size``, so a full read can check the server's composite CRC32C.
One dropped without commit or abort is aborted on the server by a finaliser.

:class:`S3PartWriter`: parts go straight into a multipart upload of the final key (S3
shows nothing there before the upload completes); the token carries the part size and the
upload id, so a later process continues the same upload and ``ListParts`` tells which parts
are already there.
With ``checksum="crc32c"`` (the default) the upload asks for CRC32C and every part carries
its own, so the server refuses a part damaged on the way; completing such an upload must
name every part's checksum, which some servers' ``ListParts`` does not return: a resumed
write gets those of earlier parts from its caller (``commit(part_crc32c=...)``, the copy
engine keeps them in its journal).  ``checksum="md5"`` sends ``Content-MD5`` instead.

Metadata is fixed when the upload starts.  Metadata known only at commit (a whole-object
checksum the caller could not compute up front) is applied by a server-side copy of the
completed object onto itself, so callers that know it early should pass it at open.

A part writer dropped without commit or abort leaves its upload for resumption, as the
interface asks; a bucket lifecycle rule (``AbortIncompleteMultipartUpload``) bounds how
long such uploads are kept.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import logging
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ... import runtime
from ...errors import FmstoreError, InvalidRange, NotFound
from ..base import (
    Buffer,
    ObjectMeta,
    PartWriter,
    Pieces,
    PutOptions,
    Writer,
    joined,
    nbytes,
    part_bounds,
    part_count,
    views_of,
)
from ..crc import combine_all, from_b64
from . import pages
from .options import META_PART_SIZE, writer_part_size
from .uploads import S3Uploads
from .util import b64, crc_off_loop, unquote

log = logging.getLogger(__name__)

_PREFIX = "s3mp2"


class S3PartWriter(PartWriter):
    def __init__(
        self,
        store: S3Uploads,
        key: str,
        full: str,
        upload_id: str,
        size: int,
        part_size: int,
        resumed: bool,
        options: PutOptions,
    ) -> None:
        self.store, self.key, self.full = store, key, full
        self.upload_id, self.size, self.part_size = upload_id, size, part_size
        self.token = f"{_PREFIX}.{part_size:x}.{upload_id}"
        self.resumed, self.options = resumed, options
        self.crc_parts = store.options.checksum == "crc32c"
        self._crcs: dict[int, int] = {}  # part index -> CRC32C of the parts sent here
        self._done = False

    @classmethod
    async def open(
        cls,
        store: S3Uploads,
        key: str,
        full: str,
        size: int,
        part_size: int,
        token: str | None,
        options: PutOptions,
    ) -> S3PartWriter:
        if token:
            bits = token.split(".", 2)
            if len(bits) == 3 and bits[0] == _PREFIX and bits[1] == f"{part_size:x}":
                upload_id = bits[2]
                try:
                    await store._call(
                        "open_part_writer",
                        key,
                        "list_parts",
                        Key=full,
                        UploadId=upload_id,
                        MaxParts=1,
                    )
                except NotFound:
                    pass  # gone (aborted, completed or expired): start afresh
                else:
                    return cls(store, key, full, upload_id, size, part_size, True, options)
        upload_id = await store._create_upload(
            key,
            full,
            dict(options.metadata or {}),
            checksums=store.options.checksum == "crc32c",
            full_object=True,
        )
        return cls(store, key, full, upload_id, size, part_size, False, options)

    def _check_open(self) -> None:
        if self._done:
            raise FmstoreError("part writer is closed", tier=self.store.tier, key=self.key)

    async def write_part(self, index: int, data: Buffer | Pieces) -> None:
        self._check_open()
        start, end = part_bounds(index, self.size, self.part_size)
        data = joined(data)
        view = memoryview(data).cast("B")
        if view.nbytes != end - start or not 0 <= index < part_count(self.size, self.part_size):
            raise InvalidRange(
                f"part {index} must be {end - start} bytes, not {view.nbytes}",
                tier=self.store.tier,
                key=self.key,
            )
        body = data if isinstance(data, bytes | bytearray) else view  # sent as is, not copied
        sums: dict[str, Any] = {}
        if self.crc_parts:
            crc = await crc_off_loop(body)
            sums["ChecksumCRC32C"] = b64(crc)
        elif self.store.options.checksum == "md5":
            md5 = await runtime.to_cpu(lambda: hashlib.md5(body).digest())
            sums["ContentMD5"] = base64.b64encode(md5).decode()
        await self.store._put_part(self.key, self.full, self.upload_id, index + 1, body, sums)
        if self.crc_parts:
            self._crcs[index] = crc

    async def _parts(self) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        marker = 0
        guard = pages.Pages(
            "upload part", tier=self.store.tier, key=self.key, max_pages=pages.MAX_PART_PAGES
        )
        while True:
            resp = await self.store._call(
                "commit",
                self.key,
                "list_parts",
                Key=self.full,
                UploadId=self.upload_id,
                PartNumberMarker=marker,
            )
            for p in resp.get("Parts", []):
                out[int(p["PartNumber"])] = p
            if not resp.get("IsTruncated"):
                return out
            marker = guard.next_part(resp.get("NextPartNumberMarker"))

    async def commit(
        self,
        metadata: Mapping[str, str] | None = None,
        *,
        part_crc32c: Mapping[int, int] | None = None,
    ) -> ObjectMeta:
        self._check_open()
        n = part_count(self.size, self.part_size)
        have = await self._parts()
        known = {**(part_crc32c or {}), **self._crcs}
        parts = []
        pieces: list[tuple[int, int]] = []  # (CRC32C, length) of each part, for the whole
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
            entry = {"PartNumber": i + 1, "ETag": p["ETag"]}
            if self.crc_parts:
                crc = p.get("ChecksumCRC32C") or (b64(known[i]) if i in known else None)
                if crc is None:
                    raise FmstoreError(
                        f"cannot complete the upload: the CRC32C of part {i}, written by an "
                        "earlier process, is unknown (pass part_crc32c to commit)",
                        tier=self.store.tier,
                        key=self.key,
                    )
                entry["ChecksumCRC32C"] = crc
                value = from_b64(crc)
                if value is not None:
                    pieces.append((value, end - start))
            parts.append(entry)
        # The whole object's CRC32C, for the server to check its parts against: the
        # caller's when it knows it (from the source), else the parts' combined.
        whole = self.options.content_crc32c
        if whole is None and self.crc_parts and len(pieces) == n:
            whole = combine_all(pieces)
        head = await self.store._complete(
            self.key, self.full, self.upload_id, parts, self.options, whole_crc32c=whole
        )
        self._done = True
        opened = dict(self.options.metadata or {})
        final = {**opened, **(metadata or {})}
        if final == opened:
            etag = head.get("ETag")
            return ObjectMeta(
                key=self.key,
                size=self.size,
                mtime=time.time(),
                etag=etag.strip('"') if etag else None,
                metadata=final,
            )
        # Metadata only known now: rewrite it in place, pinned to the object just completed.
        head = await self.store._head(self.key, self.full)
        return await self.store._copy_from(
            self.full,
            head,
            self.key,
            self.full,
            final,
            PutOptions(mode="if_match", if_match=self.store._meta(self.key, head).etag),
        )

    async def abort(self) -> None:
        if self._done:
            return
        self._done = True
        await self.store._abort_upload(self.key, self.full, self.upload_id)


@dataclass
class _UploadState:
    """What an orphaned writer's finaliser needs (never the writer itself)."""

    upload_id: str | None = None
    done: bool = False


def _abort_orphan(store: S3Uploads, key: str, full: str, state: _UploadState) -> None:
    """Finaliser of an :class:`S3Writer` dropped without commit or abort."""
    if state.done or state.upload_id is None or store._pid != os.getpid():
        return
    state.done = True
    upload_id = state.upload_id
    loop = store._loop
    if loop is None or loop.is_closed():
        return

    def schedule() -> None:
        task = loop.create_task(store._abort_upload(key, full, upload_id))
        store._background.add(task)
        task.add_done_callback(store._background.discard)

    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(schedule)


class S3Writer(Writer):
    """A streamed multipart upload; objects smaller than one part become a single PUT.

    Up to ``writer_parts_in_flight`` parts upload while the caller keeps writing, so memory
    stays bounded by that many parts plus the one being filled.
    """

    def __init__(self, store: S3Uploads, key: str, full: str, options: PutOptions) -> None:
        self.store, self.key, self.full, self.options = store, key, full, options
        self._base = store.options.part_size
        self._buf = bytearray()
        self._index = 0
        self._size = 0
        self._parts: list[dict[str, Any]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(store.options.writer_parts_in_flight)
        self._error: BaseException | None = None
        self._closed = False
        self._state = _UploadState()
        self._finalizer = weakref.finalize(self, _abort_orphan, store, key, full, self._state)

    def _check_open(self) -> None:
        if self._closed:
            raise FmstoreError(
                "writer is already committed or aborted", tier=self.store.tier, key=self.key
            )
        if self._error is not None:
            raise self._error

    async def write(self, data: Buffer | Pieces) -> None:
        """Append ``data`` (a buffer or pieces).

        Bytes are copied into the part being filled, which uploads while the caller goes
        on (``writer_parts_in_flight`` at most).  A big write sends its leading whole parts
        straight from the caller's memory instead, several at once (the store's
        concurrency bounds them), and waits for them before it returns: only its last
        ``writer_parts_in_flight`` parts are copied, so it returns as early as an all-copy
        write would, which also waits for every part but those last ones.
        """
        self._check_open()
        pending = collections.deque(views_of(data))
        left = sum(v.nbytes for v in pending)
        keep = self.store.options.writer_parts_in_flight + 1
        direct: list[asyncio.Task[None]] = []
        try:
            while pending:
                size = writer_part_size(self._base, self._index)
                if not self._buf and left >= size * keep:
                    part: list[memoryview] = []
                    while size:
                        v = pending.popleft()
                        if v.nbytes > size:
                            v, rest = v[:size], v[size:]
                            pending.appendleft(rest)
                        part.append(v)
                        size -= v.nbytes
                        left -= v.nbytes
                    direct.append(await self._start(part, slot=False))
                    continue
                v = pending.popleft()
                room = size - len(self._buf)
                if v.nbytes > room:
                    pending.appendleft(v[room:])
                self._buf += v[:room]
                left -= min(room, v.nbytes)
                if len(self._buf) == size:
                    await self._flush()
        finally:
            if direct:
                # The parts read the caller's memory: none may still be sending once this
                # call is over, whichever way it ends.
                done = asyncio.gather(*direct, return_exceptions=True)
                try:
                    await asyncio.shield(done)
                except BaseException:
                    for t in direct:
                        t.cancel()
                    await done
                    raise
        self._check_open()

    async def _flush(self) -> None:
        body, self._buf = self._buf, bytearray()
        await self._slots.acquire()
        await self._start(body, slot=True)

    async def _start(self, body: bytearray | list[memoryview], *, slot: bool) -> asyncio.Task[None]:
        """Start uploading ``body`` as the next part (``slot``: it holds one of the
        ``writer_parts_in_flight`` slots, released once it is sent)."""
        try:
            if self._state.upload_id is None:
                metadata = dict(self.options.metadata or {})
                if self.store.options.checksum != "off":
                    metadata[META_PART_SIZE] = str(self._base)
                self._state.upload_id = await self.store._create_upload(
                    self.key, self.full, metadata
                )
        except BaseException:
            if slot:
                self._slots.release()
            raise
        self._size += nbytes(body)
        self._index += 1
        task = asyncio.get_running_loop().create_task(self._send(self._index, body, slot))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _send(self, number: int, body: bytearray | list[memoryview], slot: bool) -> None:
        try:
            upload_id = self._state.upload_id
            assert upload_id is not None
            self._parts.append(
                await self.store._upload_part(self.key, self.full, upload_id, number, body)
            )
        except Exception as e:
            if self._error is None:
                self._error = e
        finally:
            if slot:
                self._slots.release()

    async def commit(self) -> ObjectMeta:
        self._check_open()
        try:
            if self._state.upload_id is None:
                body = bytes(self._buf)
                self._buf = bytearray()
                meta = await self.store._put_single(self.key, self.full, body, self.options)
            else:
                if self._buf:
                    await self._flush()
                if self._tasks:
                    await asyncio.gather(*list(self._tasks))
                if self._error is not None:
                    raise self._error
                resp = await self.store._complete(
                    self.key, self.full, self._state.upload_id, self._parts, self.options
                )
                meta = ObjectMeta(
                    key=self.key,
                    size=self._size,
                    mtime=time.time(),
                    etag=unquote(resp.get("ETag")),
                    metadata=dict(self.options.metadata or {}),
                )
        except BaseException:
            await asyncio.shield(self.abort())
            raise
        self._closed = True
        self._state.done = True
        self._finalizer.detach()
        return meta

    async def abort(self) -> None:
        if self._state.done:
            self._closed = True
            return
        self._closed = True
        self._state.done = True
        self._finalizer.detach()
        self._buf = bytearray()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        upload_id = self._state.upload_id
        if upload_id is not None:
            try:
                await asyncio.shield(self.store._abort_upload(self.key, self.full, upload_id))
            except FmstoreError as e:
                log.warning(
                    "could not abort multipart upload %s of %s: %s", upload_id, self.full, e
                )
