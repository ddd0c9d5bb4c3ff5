"""Reads of the S3 backend, and the checks of what they read.

Large reads are split into ranged GETs fetched in parallel; every range after the first is
conditional on the first response's ETag, so a concurrent overwrite restarts the read
instead of mixing two versions.  Every *full* read is checked against the whole-object
CRC32C fmstore recorded, or the server's composite part checksum of a streamed upload (a
mismatch is read again once, then raises :class:`~fmstore.errors.CorruptData`).  Bodies
come back as the pieces the connection delivered, go straight into the caller's buffer, or
stream through a small ring (:meth:`S3Reads.read_to`), whichever transport serves them.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ... import runtime
from ...errors import CorruptData, FmstoreError, InvalidRange, PermissionDenied, StoreUnavailable
from ..base import Buffer, ObjectMeta
from ..crc import combine_all, composite_of, from_b64
from ..http1 import Sink
from . import pages
from .core import S3Base
from .options import META_CRC, META_PART_SIZE, STREAM_RING, writer_part_size
from .retry import Restart, ShortBody, count_retry, error_code
from .transport import Body
from .util import all_or_cancel, b64, crc32c, crc_off_loop, join, quote, unquote

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
#: A multipart upload's ETag ends in ``-<parts>``.
_MULTIPART_ETAG = re.compile(r"-(\d+)\"?$")


class S3Reads(S3Base):
    """GET, ranged and whole, into buffers or rings; HEAD (``stat``)."""

    async def _get(
        self,
        key: str,
        full: str,
        start: int,
        end: int | None,
        *,
        if_match: str | None = None,
        into: memoryview | None = None,
    ) -> tuple[dict[str, Any], list[Buffer], int]:
        """One GET (retried as a whole, body included); ``end`` None means to the end.

        The body comes back as the pieces the connection delivered, unjoined: the caller
        copies them once, into its buffer or into the one ``bytes`` it returns.  (Joining
        per request, then again per object, cost two more passes over fresh memory, about
        1 s of CPU per GB on a machine where page faults are dear.)  Or, where the
        transport can (the lean one), it goes straight into ``into`` (at least the range's size) where it fits: then no
        pieces come back, only the length.
        """
        kwargs: dict[str, Any] = {"Key": full}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if if_match:
            kwargs["IfMatch"] = quote(if_match)

        async def attempt() -> tuple[dict[str, Any], list[Buffer], int]:
            try:
                resp = await (await self._objects()).get_object(into=into, **kwargs)
            except Exception as e:
                code, status = error_code(e)
                if if_match and (status == 412 or code == "PreconditionFailed"):
                    raise Restart() from e
                raise
            body: Body = resp.pop("Body")
            chunks = body.pieces  # what came with the response (the lean transport: all)
            n = body.nbytes
            try:
                # Timeouts and broken bodies raise asyncio / aiohttp errors here (on the
                # lean transport, in the request), which the retrier treats like botocore's.
                while chunk := await body.readany():
                    chunks.append(chunk)
                    n += len(chunk)
            finally:
                body.close()
            if n != int(resp.get("ContentLength", n)):
                raise ShortBody(f"got {n} of {resp.get('ContentLength')} bytes")
            return resp, chunks, n

        return await self.retrier.call("get", key, attempt)

    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        _, pieces = await self._read(key, start, end, None)
        return await join(pieces)

    async def get_range_pieces(self, key: str, start: int, end: int) -> list[Buffer]:
        _, pieces = await self._read(key, start, end, None)
        return pieces

    async def get_into(self, key: str, start: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        await self._read(key, start, start + out.nbytes, out)

    async def read_to(
        self,
        key: str,
        start: int,
        end: int,
        consume: Callable[[memoryview], Any],
        *,
        etag: str | None = None,
        ring: memoryview | None = None,
    ) -> None:
        """Bytes ``[start, end)`` to ``consume`` in order as they arrive (see
        :meth:`Store.read_to`): one GET, received into a small ring (``ring`` when given)
        on the lean transport.  A GET
        that breaks off is resumed where it stopped, pinned to the ETag it began with (or to
        ``etag`` from the start); the object changing in between is :class:`StoreUnavailable`
        (what was consumed came from the old one).  Nothing is checked against a checksum
        here: the caller has the bytes.
        """
        full = self._full(key)
        if start < 0 or end < start:
            raise InvalidRange(f"bad range [{start}, {end})", tier=self.tier, key=key)
        if end == start:
            meta = await self.stat(key)
            self._check_range(key, meta.size, start, end)
            if etag is not None and unquote(meta.etag) != unquote(etag):
                raise StoreUnavailable("object changed while it was read", tier=self.tier, key=key)
            return
        pos, etag = start, unquote(etag) if etag else None
        failed: list[Exception] = []  # what ``consume`` raised: its error, never retried

        def feed(view: memoryview) -> Awaitable[None] | None:
            nonlocal pos
            try:
                pending = consume(view)
            except Exception as e:
                failed.append(e)
                raise
            if pending is None:
                pos += view.nbytes
                return None
            return counted(pending, view.nbytes)

        async def counted(pending: Awaitable[None], n: int) -> None:
            nonlocal pos
            try:
                await pending
            except Exception as e:
                failed.append(e)
                raise
            pos += n

        def accept(status: int, headers: Mapping[str, str]) -> bool:
            """Stream only the range asked for; anything else is sorted out below."""
            nonlocal etag
            m = _CONTENT_RANGE.match(headers.get("content-range", ""))
            if status != 206 or not m or (int(m.group(1)), int(m.group(2))) != (pos, end - 1):
                return False
            etag = etag or unquote(headers.get("etag"))
            return True

        if ring is None:
            ring = memoryview(bytearray(STREAM_RING))

        async def attempt() -> None:
            nonlocal etag
            if pos == end:  # all consumed; the answer's end was lost (a dropped connection)
                return
            kwargs: dict[str, Any] = {"Key": full, "Range": f"bytes={pos}-{end - 1}"}
            if etag:
                kwargs["IfMatch"] = quote(etag)
            try:
                objects = await self._objects()
                resp = await objects.get_object(sink=Sink(ring, feed, accept), **kwargs)
                body: Body = resp.pop("Body")
                try:
                    # Bodies the sink did not take: botocore's stream, or the lean
                    # transport's pieces (a range the server answered otherwise than asked).
                    size, first = _total_size(resp, int(resp.get("ContentLength", 0)))
                    self._check_range(key, size, start, end)
                    etag = etag or unquote(resp.get("ETag"))
                    skip = pos - first
                    if skip < 0:
                        raise ShortBody(f"asked for bytes from {pos}, got them from {first}")
                    pieces = iter(body.pieces)
                    while chunk := next(pieces, None) or await body.readany():
                        view = memoryview(chunk)[max(skip, 0) :][: end - pos]
                        skip -= len(chunk)
                        if view.nbytes and (pending := feed(view)) is not None:
                            await pending
                finally:
                    body.close()
            except Exception as e:
                if failed:
                    return  # the consumer's error, raised below
                code, status = error_code(e)
                if etag and (status == 412 or code == "PreconditionFailed"):
                    raise Restart() from e
                raise
            if pos != end:
                raise ShortBody(f"got {pos - start} of {end - start} bytes")

        try:
            await self.retrier.call("get", key, attempt)
        except Restart as e:
            raise StoreUnavailable(
                "object changed while it was read", tier=self.tier, key=key
            ) from e
        if failed:
            raise failed[0]

    async def get_with_meta(self, key: str) -> tuple[ObjectMeta, bytes]:
        """Whole object and metadata from the same GETs (every range pinned to one ETag)."""
        meta, pieces = await self._read(key, 0, None, None)
        return meta, await join(pieces)

    async def _read(
        self, key: str, start: int, end: int | None, out: memoryview | None
    ) -> tuple[ObjectMeta, list[Buffer]]:
        """Bytes ``[start, end)`` (into ``out`` when given, else as the pieces the
        connections delivered) and the version they come from."""
        full = self._full(key)
        if start < 0 or (end is not None and end < start):
            raise InvalidRange(f"bad range [{start}, {end})", tier=self.tier, key=key)
        verify_failures = 0
        for _ in range(8):
            try:
                return await self._read_once(key, full, start, end, out)
            except Restart:
                continue  # overwritten while we read: read the new version from the start
            except CorruptData:
                verify_failures += 1
                if verify_failures > 1:
                    raise
                count_retry(self.tier, "checksum")
        raise FmstoreError(
            "object kept changing while it was read (8 attempts)", tier=self.tier, key=key
        )

    async def _read_once(
        self, key: str, full: str, start: int, end: int | None, out: memoryview | None
    ) -> tuple[ObjectMeta, list[Buffer]]:
        chunk = self.options.part_size
        if end is not None and end == start:
            meta = await self.stat(key)
            self._check_range(key, meta.size, start, end)
            return meta, []
        first_end = start + chunk if end is None else min(end, start + chunk)
        try:
            # The first range tells the size, ETag and metadata; the rest go in parallel.
            into = None if out is None else out[: first_end - start]
            resp, first, n = await self._get(key, full, start, first_end, into=into)
        except InvalidRange:
            meta = await self.stat(key)
            self._check_range(key, meta.size, start, end)
            return meta, []
        size, got_start = _total_size(resp, n)
        end = self._check_range(key, size, start, end)
        etag = unquote(resp.get("ETag"))
        meta = self._meta(key, resp, size)
        if got_start != start or got_start + n > end:
            # The server sent more than asked (a range it ignored): cut to [start, end).
            body = b"".join(first) if first or out is None else bytes(out[:n])
            joined = body[start - got_start : end - got_start]
            first, n = [joined], len(joined)
        pieces: list[list[Buffer]] = [first]
        if out is not None:
            _copy_chunks(out, 0, first)  # nothing to copy where the body went there already
        pos = start + n
        if pos < end:
            bounds = [(a, min(a + chunk, end)) for a in range(pos, end, chunk)]

            async def fetch(a: int, b: int) -> list[Buffer]:
                into = None if out is None else out[a - start : b - start]
                _, got, m = await self._get(key, full, a, b, if_match=etag, into=into)
                if m != b - a:
                    raise Restart()
                if out is not None:
                    _copy_chunks(out, a - start, got)
                    return []
                return got

            pieces += await all_or_cancel(fetch(a, b) for a, b in bounds)
        flat: list[Buffer] = [] if out is not None else [c for p in pieces for c in p]
        if start == 0 and end == size and self.options.checksum != "off":
            whole: Buffer = out if out is not None else await join(flat)
            await self._verify(key, full, resp, etag, whole)
            if out is None:
                flat = [whole]
        return meta, flat

    async def _verify(
        self, key: str, full: str, resp: Mapping[str, Any], etag: str | None, data: Buffer
    ) -> None:
        """Check a full read against the CRC32C fmstore recorded, or the server's composite
        part checksum for streamed uploads; CorruptData on a mismatch."""
        meta = resp.get("Metadata") or {}
        want = meta.get(META_CRC)
        if want is not None:
            got = await crc_off_loop(data)
            if f"{got:08x}" != want.lower():
                raise CorruptData(
                    f"CRC32C mismatch on read: object records {want}, bytes give {got:08x}",
                    tier=self.tier,
                    key=key,
                )
            return
        base = meta.get(META_PART_SIZE)
        if base is None or not etag or "-" not in etag:
            return
        composite, kind = resp.get("ChecksumCRC32C"), resp.get("ChecksumType")
        if not composite:
            head = await self._head(key, full, ChecksumMode="ENABLED", IfMatch=quote(etag))
            composite, kind = head.get("ChecksumCRC32C"), head.get("ChecksumType")
        parts = _MULTIPART_ETAG.search(etag)
        if composite and "-" not in composite and kind != "FULL_OBJECT" and parts:
            composite = f"{composite}-{parts.group(1)}"  # a HEAD without the part count (moto)
        if not composite or "-" not in composite:
            return
        mine = await runtime.to_cpu(_composite_crc32c, data, int(base))
        if mine != composite:
            raise CorruptData(
                f"composite CRC32C mismatch on read: server has {composite}, bytes give {mine}",
                tier=self.tier,
                key=key,
            )

    async def stat(self, key: str) -> ObjectMeta:
        full = self._full(key)
        return self._meta(key, await self._head(key, full))

    async def stored_crc32c(self, key: str) -> tuple[int, int | None]:
        """The server's CRC32C of the object (HEAD with ``x-amz-checksum-mode: ENABLED``).

        What it proves: every upload of this backend sends the CRC32C of its bytes (whole
        object or each part, and for multipart the whole one at completion), so the server
        refuses bytes that do not match it and keeps the checksum it checked.  A
        ``FULL_OBJECT`` (or single-part) checksum is returned as is; a composite one
        (``crc-N``: the CRC of the parts' CRCs) is turned into the whole object's by
        combining its parts' checksums where the server lists them (GetObjectAttributes),
        after checking that they give the composite one.  None when the server keeps no
        checksum for the object (written without one, or a server without flexible
        checksums) or cannot list the parts'."""
        full = self._full(key)
        if self.options.checksum != "crc32c":
            return (await self.stat(key)).size, None
        try:
            head = await self._head(key, full, ChecksumMode="ENABLED")
        except PermissionDenied:
            # SSE-KMS objects need kms:Decrypt for their checksum; the bytes are read instead.
            return (await self.stat(key)).size, None
        size = int(head.get("ContentLength", 0))
        value = head.get("ChecksumCRC32C")
        if not value:
            return size, None
        text, _, count = str(value).partition("-")
        if count and not count.isdigit():
            return size, None
        kind = head.get("ChecksumType")
        if not count and kind != "COMPOSITE":
            parts = _MULTIPART_ETAG.search(str(head.get("ETag") or ""))
            if kind == "FULL_OBJECT" or parts is None:
                return size, from_b64(text)
            # A multipart object's checksum that names neither its type nor its part count
            # (moto's HEAD of a composite one): taken for what a multipart checksum was
            # before FULL_OBJECT, composite, and only trusted once its parts give it.
            count = parts.group(1)
        return size, await self._whole_from_parts(key, full, size, text, count, head.get("ETag"))

    async def _whole_from_parts(
        self, key: str, full: str, size: int, composite: str, count: str, etag: str | None
    ) -> int | None:
        """The whole object's CRC32C from the CRC32Cs and sizes of its parts, or None where
        the server does not list them all, or they do not give its composite checksum."""
        want = from_b64(composite)
        pieces: list[tuple[int, int]] = []
        marker = 0
        guard = pages.Pages("object part", tier=self.tier, key=key, max_pages=pages.MAX_PART_PAGES)
        while True:
            try:
                resp = await self._call(
                    "stat",
                    key,
                    "get_object_attributes",
                    Key=full,
                    ObjectAttributes=["ETag", "ObjectParts"],
                    MaxParts=1000,
                    PartNumberMarker=marker,
                )
            except FmstoreError:
                return None  # no GetObjectAttributes here: the caller reads the bytes
            if etag and unquote(resp.get("ETag")) != unquote(etag):
                return None  # replaced since the HEAD
            parts = resp.get("ObjectParts") or {}
            for p in parts.get("Parts") or []:
                crc = from_b64(p.get("ChecksumCRC32C"))
                if crc is None:
                    return None
                pieces.append((crc, int(p.get("Size", -1))))
            if not parts.get("IsTruncated"):
                break
            marker = guard.next_part(parts.get("NextPartNumberMarker"))
        if (
            want is None
            or (count and int(count) != len(pieces))
            or sum(n for _c, n in pieces) != size
            or composite_of(c for c, _n in pieces) != want
        ):
            return None
        return combine_all(pieces)


def _copy_chunks(out: memoryview, pos: int, chunks: list[Buffer]) -> None:
    for c in chunks:
        out[pos : pos + len(c)] = c
        pos += len(c)


def _total_size(resp: Mapping[str, Any], n: int) -> tuple[int, int]:
    """Object size and the offset of the returned bytes, from a (ranged) GET response."""
    cr = resp.get("ContentRange")
    if cr:
        m = _CONTENT_RANGE.match(cr)
        if m and m.group(3) != "*":
            return int(m.group(3)), int(m.group(1))
    return n, 0


def _composite_crc32c(data: Buffer, base: int) -> str:
    """S3's composite CRC32C of ``data`` uploaded in :func:`writer_part_size` parts."""
    view = memoryview(data).cast("B")
    crcs = bytearray()
    pos = i = 0
    while pos < view.nbytes or i == 0:
        n = writer_part_size(base, i)
        crcs += crc32c(view[pos : pos + n]).to_bytes(4, "big")
        pos += n
        i += 1
    return f"{b64(crc32c(crcs))}-{i}"
