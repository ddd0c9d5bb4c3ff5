"""How the S3 backend sends its hot calls: one :class:`Transport` interface, two
implementations, and the choice between them, made here and nowhere else.

The calls that carry objects' bytes and listings (PutObject, UploadPart, GetObject,
HeadObject, ListObjectsV2) and those that start, complete and abort the multipart uploads
of every large write go through a :class:`Transport`, bound to one bucket, with
botocore's parameter and response names and botocore's ``ClientError`` for error answers,
so retries and error translation (:mod:`.retry`) are one code path whichever sends them:

* :class:`~.lean.LeanTransport`: fmstore's own SigV4 signer and HTTP/1.1 client, a tenth of
  botocore's CPU per request;
* :class:`BotocoreTransport`: the aiobotocore client.

:class:`FallbackTransport` is what a store calls: the lean transport while it serves, and
botocore for good once the lean one raises :class:`LeanUnsupported` (a redirect to another
region, an endpoint that refuses our signature shape).  Whether a lean transport exists at
all (``S3Options.lean_requests``, a proxy in the environment, an endpoint it cannot serve)
is settled once per shared client, when :mod:`.client` makes it.  Every other call
(listing parts and uploads, copies, deletes) stays on botocore's client.

A GetObject body is a :class:`Body` on either transport: the bytes already received, then
(on botocore) the rest as it arrives, so readers never ask which transport answered.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..base import Buffer, Pieces, joined

if TYPE_CHECKING:
    from ..http1 import Sink

log = logging.getLogger(__name__)


class LeanUnsupported(Exception):
    """The lean transport cannot serve this store; use botocore instead."""


class Body:
    """A GetObject body, the same on every transport.

    ``pieces``: the bytes received with the response, as the connection delivered them (the
    lean transport reads the whole body in the request); ``nbytes``: how many bytes were
    received with it, counting those that went straight into the caller's buffer
    (``into``) or through a sink, which are not in ``pieces``.  :meth:`readany` then gives
    the rest, if any is still on its way (botocore's streamed body), and ``b""`` at the end.
    """

    __slots__ = ("pieces", "nbytes")

    def __init__(self, pieces: list[Buffer], nbytes: int) -> None:
        self.pieces, self.nbytes = pieces, nbytes

    async def readany(self) -> Buffer:
        """The next bytes not yet received; ``b""`` once the body is over."""
        return b""

    def close(self) -> None:
        pass


class _StreamedBody(Body):
    """botocore's streaming body: nothing received with the response, the rest read here."""

    __slots__ = ("_stream",)

    def __init__(self, stream: Any) -> None:
        super().__init__([], 0)
        self._stream = stream

    async def readany(self) -> Buffer:
        # Timeouts and broken bodies raise asyncio / aiohttp errors here, which the
        # retrier treats like botocore's.
        chunk: Buffer = await self._stream.raw_stream.content.readany()
        return chunk

    def close(self) -> None:
        self._stream.close()


class Transport(abc.ABC):
    """PutObject / UploadPart / Create-, Complete- and AbortMultipartUpload / GetObject /
    HeadObject / ListObjectsV2 on one bucket.

    Parameters and response keys are botocore's (``Key``, ``Body``, ``IfMatch``… in;
    ``ETag``, ``ContentLength``, ``Metadata``… out); error answers raise botocore's
    ``ClientError``.  Only the parameters fmstore sends are part of the interface.
    """

    @abc.abstractmethod
    async def put_object(
        self,
        *,
        Key: str,
        Body: Buffer | Pieces,
        Metadata: Mapping[str, str] | None = None,
        IfNoneMatch: str | None = None,
        IfMatch: str | None = None,
        ChecksumCRC32C: str | None = None,
        ContentMD5: str | None = None,
        ServerSideEncryption: str | None = None,
        SSEKMSKeyId: str | None = None,
    ) -> dict[str, Any]:
        """``ETag`` and, where the server returns it, ``ChecksumCRC32C``."""

    @abc.abstractmethod
    async def upload_part(
        self,
        *,
        Key: str,
        UploadId: str,
        PartNumber: int,
        Body: Buffer | Pieces,
        ChecksumCRC32C: str | None = None,
        ContentMD5: str | None = None,
    ) -> dict[str, Any]:
        """``ETag`` and, where the server returns it, ``ChecksumCRC32C``."""

    @abc.abstractmethod
    async def create_multipart_upload(
        self,
        *,
        Key: str,
        Metadata: Mapping[str, str] | None = None,
        ChecksumAlgorithm: str | None = None,
        ChecksumType: str | None = None,
        ServerSideEncryption: str | None = None,
        SSEKMSKeyId: str | None = None,
    ) -> dict[str, Any]:
        """``UploadId``."""

    @abc.abstractmethod
    async def complete_multipart_upload(
        self,
        *,
        Key: str,
        UploadId: str,
        MultipartUpload: Mapping[str, Any],
        IfNoneMatch: str | None = None,
        IfMatch: str | None = None,
        ChecksumCRC32C: str | None = None,
        ChecksumType: str | None = None,
    ) -> dict[str, Any]:
        """``ETag`` and, where the server returns them, ``ChecksumCRC32C`` and
        ``ChecksumType``.  An error the server reports in a 200 answer raises like any
        other (a server error: retried)."""

    @abc.abstractmethod
    async def abort_multipart_upload(self, *, Key: str, UploadId: str) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def get_object(
        self,
        *,
        Key: str,
        Range: str | None = None,
        IfMatch: str | None = None,
        into: memoryview | None = None,
        sink: Sink | None = None,
    ) -> dict[str, Any]:
        """The object's fields and its ``Body`` (a :class:`Body`).  ``into``: where a
        successful body that fits may be received in place; ``sink``: where it may be
        streamed (see :class:`.http1.Sink`).  A transport that does neither (botocore)
        returns the bytes in the body as usual."""

    @abc.abstractmethod
    async def head_object(
        self, *, Key: str, IfMatch: str | None = None, ChecksumMode: str | None = None
    ) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def list_objects_v2(
        self,
        *,
        Prefix: str = "",
        MaxKeys: int = 1000,
        Delimiter: str | None = None,
        StartAfter: str | None = None,
        ContinuationToken: str | None = None,
    ) -> dict[str, Any]: ...

    async def close(self) -> None:
        """Close the connections this transport opened itself."""


class BotocoreTransport(Transport):
    """The calls on aiobotocore's client, created when the first call needs it
    (``client``: returns it)."""

    def __init__(self, client: Callable[[], Awaitable[Any]], bucket: str) -> None:
        self._client, self.bucket = client, bucket

    async def _send(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        fn = getattr(await self._client(), method)
        resp: dict[str, Any] = await fn(Bucket=self.bucket, **args)
        return resp

    # Only the parameters given go to botocore: it would send a None as "None".
    async def put_object(self, **args: Any) -> dict[str, Any]:
        return await self._send("put_object", {**args, "Body": joined(args["Body"])})

    async def upload_part(self, **args: Any) -> dict[str, Any]:
        # botocore sends one buffer: pieces are joined (a copy the lean transport avoids).
        return await self._send("upload_part", {**args, "Body": joined(args["Body"])})

    async def create_multipart_upload(self, **args: Any) -> dict[str, Any]:
        return await self._send("create_multipart_upload", args)

    async def complete_multipart_upload(self, **args: Any) -> dict[str, Any]:
        return await self._send("complete_multipart_upload", args)

    async def abort_multipart_upload(self, **args: Any) -> dict[str, Any]:
        return await self._send("abort_multipart_upload", args)

    async def get_object(
        self, *, into: memoryview | None = None, sink: Sink | None = None, **args: Any
    ) -> dict[str, Any]:
        del into, sink  # botocore streams every body
        resp = await self._send("get_object", args)
        resp["Body"] = _StreamedBody(resp["Body"])
        return resp

    async def head_object(self, **args: Any) -> dict[str, Any]:
        return await self._send("head_object", args)

    async def list_objects_v2(self, **args: Any) -> dict[str, Any]:
        return await self._send("list_objects_v2", args)


class FallbackTransport(Transport):
    """``lean`` while it serves, else ``botocore`` for good: the first
    :class:`LeanUnsupported` logs why and sends that call, and every later one, on
    botocore.  ``where`` names the store in the log."""

    def __init__(self, lean: Transport | None, botocore: Transport, where: str) -> None:
        self.lean, self.botocore, self.where = lean, botocore, where

    async def _send(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        lean = self.lean
        if lean is not None:
            try:
                resp: dict[str, Any] = await getattr(lean, method)(**args)
                return resp
            except LeanUnsupported as e:
                log.info("S3 %s: %s; using botocore for every call", self.where, e)
                self.lean = None
        resp = await getattr(self.botocore, method)(**args)
        return resp

    async def put_object(self, **args: Any) -> dict[str, Any]:
        return await self._send("put_object", args)

    async def upload_part(self, **args: Any) -> dict[str, Any]:
        return await self._send("upload_part", args)

    async def create_multipart_upload(self, **args: Any) -> dict[str, Any]:
        return await self._send("create_multipart_upload", args)

    async def complete_multipart_upload(self, **args: Any) -> dict[str, Any]:
        return await self._send("complete_multipart_upload", args)

    async def abort_multipart_upload(self, **args: Any) -> dict[str, Any]:
        return await self._send("abort_multipart_upload", args)

    async def get_object(self, **args: Any) -> dict[str, Any]:
        return await self._send("get_object", args)

    async def head_object(self, **args: Any) -> dict[str, Any]:
        return await self._send("head_object", args)

    async def list_objects_v2(self, **args: Any) -> dict[str, Any]:
        return await self._send("list_objects_v2", args)
