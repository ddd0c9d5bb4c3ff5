"""What every call of an :class:`~.store.S3Store` stands on: its options, its binding to a
shared client (:mod:`.client`) on one process and event loop, the transport it sends the hot
calls on (:mod:`.transport`), its retrier (:mod:`.retry`), and the small helpers reads and
writes share (keys, conditions, metadata, HEAD).

A store is bound on its first call, to the running loop; a forked child or a store whose
loop has closed starts afresh (:meth:`S3Base._reset`), and using it from another, running
loop is an error.
"""

from __future__ import annotations

import asyncio
import base64
import os
import weakref
from collections.abc import Mapping
from typing import Any

from ... import keys as _keys
from ... import runtime
from ...errors import AlreadyExists, ConfigError, InvalidKey, NotFound
from ..base import Buffer, ObjectMeta, Pieces, PutOptions, Store, Writer, as_pieces
from ..http1 import check_header
from .client import SharedClient, leave_to_parent, make_shared, shared_client
from .options import S3Options
from .retry import AdaptiveLimiter, Retrier, RetryPolicy
from .transport import FallbackTransport, Transport
from .util import b64, crc_off_loop, quote, unquote


class S3Base(Store):
    """One bucket (and optionally a prefix inside it): state, binding and shared helpers;
    :class:`~.store.S3Store` adds reads and writes."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        tier: str = "s3",
        options: S3Options | None = None,
    ) -> None:
        self.bucket = bucket
        self.root = _keys.validate_prefix(prefix, tier=tier) if prefix else ""
        self.tier = tier
        self.options = options or S3Options()
        self.url = f"s3://{bucket}/{self.root}".rstrip("/")
        self._pid = os.getpid()
        self._client: Any = None
        self._transport: FallbackTransport | None = None
        self._shared: SharedClient | None = None
        self._reset()

    # ---- client lifecycle ---------------------------------------------------------------

    def _reset(self) -> None:
        """Forget every loop- and process-bound object (after fork, or a dead loop)."""
        if self._shared is not None and self._pid != os.getpid():
            leave_to_parent(self._shared)
        o = self.options
        self._pid = os.getpid()
        self._client = None
        self._transport = None
        self._shared = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bucket_ok = False
        self.limiter = AdaptiveLimiter(o.max_concurrency)
        self.retrier = Retrier(
            RetryPolicy(
                max_attempts=o.max_attempts,
                base_delay=o.retry_base_delay,
                deadline=o.retry_deadline,
            ),
            self.limiter,
            tier=self.tier,
            bucket=self.bucket,
        )
        self._writers: weakref.WeakSet[Writer] = weakref.WeakSet()
        self._background: set[asyncio.Task[Any]] = set()

    async def _cli(self) -> Any:
        """The aiobotocore client, created on first use on the running loop."""
        shared = await self._bind()  # first: a forked child or a new loop resets the store
        if self._client is None:
            self._client = await shared.botocore()
        return self._client

    async def _bind(self) -> SharedClient:
        """The shared client of this process, loop, options and bucket; created on first
        use on the running loop."""
        if self._pid != os.getpid():
            self._reset()  # a forked child must not touch the parent's connections
        running = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not running:
            if not self._loop.is_closed():
                raise RuntimeError(
                    f"{self!r} is bound to another event loop; use it from the fmstore "
                    "runtime loop (fmstore.runtime.run / submit)"
                )
            self._reset()
        if self._shared is not None:
            return self._shared
        # The lean transport is bound to one bucket, so the bucket is part of the key.
        key = (self._pid, running, self.options, self.bucket)
        shared = await shared_client(
            key, lambda: make_shared(key, self.options, bucket=self.bucket, tier=self.tier)
        )
        if self._shared is None:
            shared.users.add(self)
            self._shared, self._client, self._loop = shared, shared.client, running
            self._transport = FallbackTransport(shared.lean, shared.boto, self.url)
        return shared

    async def _objects(self) -> Transport:
        """The transport of PutObject, UploadPart, GetObject, HeadObject and ListObjectsV2
        (the lean one while it serves this store, else botocore), bound on first use."""
        await self._bind()
        assert self._transport is not None
        return self._transport

    @property
    def _http(self) -> Transport | None:
        """The lean transport while it serves this store (None before the first call, after
        a fallback to botocore, or with ``lean_requests=False``)."""
        return None if self._transport is None else self._transport.lean

    async def close(self) -> None:
        """Abort open writers, then let go of the client: its connection pool is closed
        once no other open store of this process uses it."""
        if self._pid != os.getpid():
            self._reset()
            return
        for w in list(self._writers):
            await w.abort()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        shared, self._shared, self._client, self._loop = self._shared, None, None, None
        self._transport = None
        if shared is not None:
            await shared.release(self)

    # ---- helpers ------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return self.root + self._key(key)

    async def _call(
        self, op: str, key: str | None, method: str, *, create: bool = False, **kwargs: Any
    ) -> Any:
        """One S3 API call with retries; kwargs get ``Bucket`` added."""
        cli = await self._cli()
        fn = getattr(cli, method)
        return await self.retrier.call(
            op, key, lambda: fn(Bucket=self.bucket, **kwargs), create=create
        )

    def _check_metadata(self, key: str, metadata: Mapping[str, str]) -> None:
        """Metadata goes out as ``x-amz-meta-*`` headers: a name or value that would break
        the request's framing (CR, LF: header injection) is refused before anything is
        sent, on either transport."""
        for k, v in metadata.items():
            try:
                check_header(f"x-amz-meta-{k}", str(v))
            except InvalidKey as e:
                raise InvalidKey(f"metadata: {e.message}", tier=self.tier, key=key) from None

    def _sse(self) -> dict[str, Any]:
        o = self.options
        out: dict[str, Any] = {}
        if o.sse:
            out["ServerSideEncryption"] = o.sse
        if o.sse_kms_key_id:
            out["SSEKMSKeyId"] = o.sse_kms_key_id
        return out

    def _conditions(self, key: str, options: PutOptions) -> dict[str, Any]:
        if options.mode == "create" and self.options.conditional_writes:
            return {"IfNoneMatch": "*"}
        if options.mode == "if_match":
            if not options.if_match:
                raise ConfigError(
                    "PutOptions(mode='if_match') needs if_match", tier=self.tier, key=key
                )
            return {"IfMatch": quote(options.if_match)}
        return {}

    async def _precheck(self, key: str, options: PutOptions) -> None:
        """Best-effort create-only check for servers without conditional writes."""
        if (
            options.mode == "create"
            and not self.options.conditional_writes
            and await self.exists(key)
        ):
            raise AlreadyExists(
                "object already exists (create-only write)", tier=self.tier, key=key
            )

    def _meta(self, key: str, head: Mapping[str, Any], size: int | None = None) -> ObjectMeta:
        lm = head.get("LastModified")
        return ObjectMeta(
            key=key,
            size=int(head.get("ContentLength", 0) if size is None else size),
            mtime=lm.timestamp() if lm is not None else None,
            etag=unquote(head.get("ETag")),
            metadata=dict(head.get("Metadata") or {}),
        )

    async def _check_bucket(self, key: str | None) -> None:
        """Turn a bare 404 into "bucket does not exist" when that is the reason."""
        if self._bucket_ok:
            return
        try:
            await self._call("head_bucket", key, "head_bucket")
        except NotFound:
            raise NotFound(
                f"bucket {self.bucket!r} does not exist", tier=self.tier, key=key
            ) from None
        self._bucket_ok = True

    async def _head(self, key: str, full: str, **extra: Any) -> dict[str, Any]:
        async def head() -> dict[str, Any]:
            return await (await self._objects()).head_object(Key=full, **extra)

        try:
            return dict(await self.retrier.call("stat", key, head))
        except NotFound:
            await self._check_bucket(key)
            raise

    async def _checksum_args(
        self, body: Buffer | Pieces, known: int | None = None
    ) -> tuple[dict[str, Any], int | None]:
        """Request checksum headers for ``body`` (a buffer or pieces) and its CRC32C (None
        when checksums are off)."""
        mode = self.options.checksum
        if mode == "off":
            return {}, None
        n = known if known is not None else await crc_off_loop(body)
        if mode == "md5":
            import hashlib

            def md5() -> bytes:
                h = hashlib.md5()
                for piece in as_pieces(body):
                    h.update(piece)
                return h.digest()

            digest = await runtime.to_cpu(md5)
            return {"ContentMD5": base64.b64encode(digest).decode()}, n
        return {"ChecksumCRC32C": b64(n)}, n
