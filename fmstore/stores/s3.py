"""S3 backend on aiobotocore: the ``s3`` tier.

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
* **Retries** of the whole request, body included (see :mod:`.s3_retry`), under a
  concurrency limit that halves while the server throttles.
* **Conditional writes**: ``mode="create"`` sends ``If-None-Match: *`` and
  ``mode="if_match"`` sends ``If-Match`` (on PutObject, CompleteMultipartUpload and
  CopyObject); with ``conditional_writes=False`` (servers without them) ``create`` is a
  best-effort HEAD check that a concurrent writer can race.

The aiobotocore client is created lazily on the running loop (the fmstore runtime loop for
sync callers) and shared, with its lean request path, by every store of the process with the
same :class:`S3Options` and bucket on that loop: creating one costs 0.1-0.3 s of CPU (botocore
parses its service models), which code that opens a store per checkpoint (DCP's writers and
readers) would otherwise pay on every save and load, with a fresh connection pool each time.
Where the lean path needs nothing botocore resolves (an explicit endpoint and region, static
keys in the options or the environment), the client is only made for the first call the lean
path does not serve, so a command that lists and reads starts 0.6 s sooner.  The last
:meth:`S3Store.close` of the stores using a client closes it (a store dropped without
``close`` leaves it open for the next store); whatever is open at exit is closed then.  A
forked child creates its own.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import os
import re
import socket
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

import crc32c as _crc32c

from .. import keys as _keys
from .. import runtime
from ..errors import (
    AlreadyExists,
    ConfigError,
    CorruptData,
    FmstoreError,
    InvalidKey,
    InvalidRange,
    NotFound,
    PreconditionFailed,
    StoreUnavailable,
)
from .base import Buffer, ObjectMeta, PartWriter, PutOptions, Store, Writer, nbytes, part_count
from .http1 import check_header
from .parts import TMP_MARK
from .s3_retry import (
    AdaptiveLimiter,
    Restart,
    Retrier,
    RetryPolicy,
    count_retry,
    error_code,
    translate,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

MiB = 1 << 20
GiB = 1 << 30
#: S3's limits on multipart uploads.
MAX_PARTS = 10_000
MIN_PART = 5 * MiB
MAX_PART = 5 * GiB
#: Largest object a single CopyObject may copy.
MAX_COPY = 5 * GiB
#: Buffers up to this size are checksummed / joined on the event loop (tens of µs).
INLINE_BYTES = 256 << 10
#: What a streamed read (:meth:`S3Store.read_to`) is received into: small enough to stay
#: in the CPU's cache between the socket and the consumer.
STREAM_RING = 256 << 10
#: User-metadata keys fmstore itself writes (``x-amz-meta-`` is added by S3).
META_CRC = "fmstore-crc32c"
META_PART_SIZE = "fmstore-part-size"
#: A random token sent with a create-only put whose ETag is not an MD5 (SSE-KMS), so that a
#: retry can recognise its own earlier attempt.
META_PUT_TOKEN = "fmstore-put-token"
#: A forked child's inherited clients, kept alive and untouched (see ``S3Store._reset``).
_FORK_LEFTOVERS: list[Any] = []


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
#: botocore's loader of service models and endpoint rules, shared by every session of the
#: process.  Parsing those JSON files is most of what creating a client costs (0.2-0.4 s
#: of CPU); a forked child (a DataLoader worker) inherits the parsed models from its parent
#: and so creates its own client in a few milliseconds.  The loader holds only parsed
#: files: no connection, credential or event-loop state.  Keyed by botocore's ``data_path``
#: setting, the one thing a loader is built from.
_DATA_LOADERS: dict[Any, Any] = {}


@dataclass(frozen=True)
class S3Options:
    """How an :class:`S3Store` talks to S3.

    Credentials come from ``access_key`` / ``secret_key`` (/ ``session_token``) when given,
    else from botocore's usual chain (``AWS_*`` variables, ``profile``, instance role).
    ``addressing_style`` defaults to ``path`` when ``endpoint_url`` is set (SeaweedFS,
    MinIO) and to ``auto`` on AWS.  ``max_concurrency`` caps requests in flight per store
    (the connection pool is sized to match); ``part_size`` is the multipart part and GET
    range size, scaled up so no object needs more than 10,000 parts.  ``sse`` /
    ``sse_kms_key_id`` pass through as ``ServerSideEncryption`` / ``SSEKMSKeyId``.
    ``max_attempts`` and ``retry_deadline`` (seconds) bound the retries of one request;
    ``connect_timeout`` / ``read_timeout`` bound one attempt's connect and each socket
    read.  ``checksum``: ``crc32c`` (``x-amz-checksum-crc32c`` on every upload and checks
    on full reads), ``md5`` (``Content-MD5`` for servers without flexible checksums, and
    the same checks on reads) or ``off``.  ``socket_buffer`` sets each connection's
    kernel send and receive buffers (capped by ``net.core.wmem_max`` / ``rmem_max``; 0
    leaves them to the kernel's autotuning): with the small default buffers most of a part
    is first copied into asyncio's own buffer, then trickled out one event-loop wake-up at
    a time.  ``lean_requests``: send PutObject, GetObject and HeadObject through fmstore's
    own signer and HTTP/1.1 client (:mod:`.s3_http`, a tenth of botocore's CPU per request);
    False keeps every call on botocore.
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key: str | None = None
    # Kept out of repr: options are logged and printed in tracebacks.
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    addressing_style: Literal["auto", "path", "virtual"] | None = None
    max_concurrency: int = 16
    part_size: int = 8 * MiB
    writer_parts_in_flight: int = 4
    sse: str | None = None
    sse_kms_key_id: str | None = None
    max_attempts: int = 10
    retry_deadline: float = 120.0
    retry_base_delay: float = 0.05
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    checksum: Literal["crc32c", "md5", "off"] = "crc32c"
    conditional_writes: bool = True
    copy_threshold: int = MAX_COPY
    socket_buffer: int = 8 * MiB
    lean_requests: bool = True

    def __post_init__(self) -> None:
        if self.part_size < MIN_PART or self.part_size > MAX_PART:
            raise ConfigError(f"S3 part_size must be between 5 MiB and 5 GiB, not {self.part_size}")
        if self.max_concurrency < 1 or self.writer_parts_in_flight < 1:
            raise ConfigError("S3 max_concurrency and writer_parts_in_flight must be at least 1")
        if self.checksum not in ("crc32c", "md5", "off"):
            raise ConfigError(f"S3 checksum must be crc32c, md5 or off, not {self.checksum!r}")
        if self.socket_buffer < 0:
            raise ConfigError("S3 socket_buffer must be 0 (kernel default) or a size in bytes")
        if self.max_attempts < 1:
            raise ConfigError("S3 max_attempts must be at least 1")
        if not MIN_PART <= self.copy_threshold <= MAX_COPY:
            raise ConfigError("S3 copy_threshold must be between 5 MiB and 5 GiB")


def writer_part_size(base: int, index: int) -> int:
    """Size of part ``index`` (0-based) of a streamed upload whose total size is unknown.

    Doubles every 1,000 parts, so 10,000 parts of an 8 MiB base hold over 7 TiB (more than
    S3's 5 TiB object limit) while small objects keep small parts.  Readers recompute the
    part boundaries from ``base`` to check the server's composite checksum.
    """
    return min(base << (index // 1000), MAX_PART)


def put_part_size(base: int, size: int) -> int:
    """Part size for an object of known ``size``: ``base``, or larger so that no more than
    10,000 parts are needed (rounded up to whole MiB)."""
    need = -(-size // MAX_PARTS)
    need = -(-need // MiB) * MiB
    return min(max(base, need), MAX_PART)


def crc32c(data: Buffer, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value))


async def _crc_off_loop(data: Buffer) -> int:
    """CRC32C of ``data``: inline when small (the hand-off to the CPU pool and back costs
    more than the CRC of a few hundred KiB), else in the CPU pool, off the event loop."""
    if memoryview(data).nbytes <= INLINE_BYTES:
        return crc32c(data)
    return await runtime.to_cpu(crc32c, data)


async def _join(pieces: list[Buffer]) -> bytes:
    """The pieces of a read as one ``bytes``: a single piece as it is, small reads joined
    inline, big ones in the CPU pool."""
    if len(pieces) == 1 and isinstance(pieces[0], bytes):
        return pieces[0]
    if nbytes(pieces) <= INLINE_BYTES:
        return b"".join(pieces)
    return await runtime.to_cpu(b"".join, pieces)


def _b64(n: int) -> str:
    return base64.b64encode(n.to_bytes(4, "big")).decode()


def _quote(etag: str) -> str:
    return etag if etag.startswith('"') else f'"{etag}"'


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
    return md5 is not None and _unquote(head.get("ETag")) == md5


def _unquote(etag: str | None) -> str | None:
    return etag.strip('"') if etag else etag


async def _all_or_cancel(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Like ``gather`` but the first failure cancels (and awaits) the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if pending:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` → ``("bucket", "some/prefix/")``."""
    m = re.match(r"^s3a?://([^/]+)/?(.*)$", url)
    if not m or not m.group(1):
        raise ConfigError(f"not an S3 URL (s3://bucket/prefix): {url!r}")
    bucket, prefix = m.group(1), m.group(2)
    if not re.match(r"^[a-zA-Z0-9][a-zA-Z0-9._-]{1,254}$", bucket):
        raise ConfigError(f"invalid S3 bucket name {bucket!r} in {url!r}")
    return bucket, _keys.validate_prefix(prefix, tier="s3") if prefix.strip("/") else ""


class _SharedClient:
    """One aiobotocore client, the lean request path and their connection pools, shared by
    the stores of this process with equal options on one loop (see the module docstring).

    ``client`` may be created late, on the first call the lean path does not serve
    (:meth:`botocore`): a command that only lists, reads and writes small objects never
    pays for botocore's client (about 0.6 s of imports and service-model parsing).
    """

    def __init__(
        self,
        key: tuple[Any, ...],
        client: Any,
        http: Any,
        stack: AsyncExitStack,
        make: Callable[[AsyncExitStack], Awaitable[Any]],
    ) -> None:
        self.key, self.client, self.http, self.stack = key, client, http, stack
        self.users: weakref.WeakSet[S3Store] = weakref.WeakSet()
        self.closed = False
        self._make = make
        self._making: asyncio.Lock | None = None

    async def botocore(self) -> Any:
        """The aiobotocore client, created on first use."""
        if self.client is None:
            self._making = self._making or asyncio.Lock()
            async with self._making:
                if self.client is None:
                    self.client = await self._make(self.stack)
        return self.client

    async def release(self, store: S3Store) -> None:
        """``store`` is closed: close the client when no open store uses it any more."""
        self.users.discard(store)
        if not self.users:
            await self.close()

    async def close(self) -> None:
        """Close every store still using the client (their writers are aborted), then it."""
        for store in list(self.users):
            try:
                await store.close()
            except Exception as e:  # one store's failed abort must not keep the pool open
                log.warning("closing %r: %s", store, e)
        if self.closed:
            return
        self.closed = True
        if _SHARED.get(self.key) is self:
            del _SHARED[self.key]
        await self.stack.aclose()


#: (pid, loop, options, bucket) -> the shared client; creations in progress in ``_CREATING``.
_SHARED: dict[tuple[Any, ...], _SharedClient] = {}
_CREATING: dict[tuple[Any, ...], asyncio.Future[_SharedClient]] = {}
#: One botocore session per profile: it caches the parsed service models.
_SESSIONS: dict[tuple[int, str | None], Any] = {}


class S3Store(Store):
    """One bucket (and optionally a prefix inside it) as a :class:`Store`."""

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
        self._http: Any = None
        self._shared: _SharedClient | None = None
        self._reset()

    @classmethod
    def from_url(cls, url: str, *, tier: str = "s3", **options: Any) -> S3Store:
        bucket, prefix = parse_s3_url(url)
        known = {f.name for f in fields(S3Options)}
        unknown = set(options) - known
        if unknown:
            raise ConfigError(f"unknown option(s) for an S3 store: {', '.join(sorted(unknown))}")
        return cls(bucket, prefix, tier=tier, options=S3Options(**options))

    # ---- client lifecycle ---------------------------------------------------------------

    def _reset(self) -> None:
        """Forget every loop- and process-bound object (after fork, or a dead loop)."""
        if self._shared is not None and self._pid != os.getpid():
            # Never let a forked child close (or garbage-collect) the parent's client: its
            # transports would unregister their sockets from the epoll instance the child
            # shares with the parent, and the parent's next response would never arrive.
            _FORK_LEFTOVERS.append(self._shared)
        o = self.options
        self._pid = os.getpid()
        self._client = None
        self._http = None
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
        self._writers: weakref.WeakSet[S3Writer] = weakref.WeakSet()
        self._background: set[asyncio.Task[Any]] = set()

    async def _cli(self) -> Any:
        """The aiobotocore client, created on first use on the running loop."""
        shared = await self._bind()  # first: a forked child or a new loop resets the store
        if self._client is None:
            self._client = await shared.botocore()
        return self._client

    async def _bind(self) -> _SharedClient:
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
        # The lean request path is bound to one bucket, so the bucket is part of the key.
        key = (self._pid, running, self.options, self.bucket)
        shared = _SHARED.get(key)
        if shared is None:
            pending = _CREATING.get(key)
            if pending is None:
                for k in [k for k in _SHARED if k[1].is_closed()]:
                    _FORK_LEFTOVERS.append(_SHARED.pop(k))  # a dead loop's: unusable, left as is
                pending = running.create_future()
                _CREATING[key] = pending
                try:
                    shared = await self._make_shared(key)
                except BaseException as e:
                    pending.set_exception(e)
                    pending.exception()  # retrieved: no "never retrieved" warning
                    raise
                finally:
                    del _CREATING[key]
                _SHARED[key] = shared
                pending.set_result(shared)
                runtime.close_at_exit(shared)  # close the pool at exit, not at garbage collection
            else:
                shared = await asyncio.shield(pending)
        if self._shared is None:
            shared.users.add(self)
            self._shared, self._client, self._loop = shared, shared.client, running
            self._http = shared.http
        return shared

    async def _make_shared(self, key: tuple[Any, ...]) -> _SharedClient:
        stack = AsyncExitStack()
        try:
            http = self._lean_static()
            if http is not None:
                stack.push_async_callback(http.close)
                client = None
            else:
                client = await self._make_client(stack)
                http = self._lean(client)
                if http is not None:
                    stack.push_async_callback(http.close)
        except Exception as e:
            await stack.aclose()
            raise translate(e, tier=self.tier, key=None, bucket=self.bucket, op="connect") from e
        return _SharedClient(key, client, http, stack, self._make_client)

    async def _make_client(self, stack: AsyncExitStack) -> Any:
        """An aiobotocore client, closed with ``stack``; errors as :mod:`fmstore.errors`."""
        try:
            return await self._create_client(stack)
        except Exception as e:
            raise translate(e, tier=self.tier, key=None, bucket=self.bucket, op="connect") from e

    async def _create_client(self, stack: AsyncExitStack) -> Any:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import AioSession

        o = self.options
        style = o.addressing_style or ("path" if o.endpoint_url else "auto")
        config = AioConfig(
            region_name=o.region,
            # botocore SHA256-signs every body sent over plain http, on the event loop (about
            # 1 s of CPU per GB).  When a checksum of ours covers the body (CRC32C or MD5,
            # checked by the server) the signature need not cover it too: UNSIGNED-PAYLOAD,
            # as botocore itself does over https.
            s3={"addressing_style": style, "payload_signing_enabled": o.checksum == "off"},
            # Our own loop (s3_retry) retries whole requests including their bodies.
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=o.max_concurrency + 4,
            connect_timeout=o.connect_timeout,
            read_timeout=o.read_timeout,
            # We send CRC32C ourselves (computed off the loop); botocore would compute
            # CRC32 on the event loop for every body.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # botocore's validation refuses memoryview bodies (only bytes, bytearray or
            # files), so every part of a large put would need a copy (~1 s of CPU per GB
            # here, mostly page faults on fresh memory).  Every request is built by this
            # module from validated keys, so the check only costs time.
            parameter_validation=False,
            connector_args={"socket_factory": functools.partial(_socket, o.socket_buffer)},
        )
        kwargs: dict[str, Any] = {"config": config}
        if o.endpoint_url:
            kwargs["endpoint_url"] = o.endpoint_url
            if o.endpoint_url.startswith("http://"):
                kwargs["verify"] = False  # no TLS: skip loading the CA bundle (~0.1 s)
        if o.access_key or o.secret_key:
            kwargs["aws_access_key_id"] = o.access_key
            kwargs["aws_secret_access_key"] = o.secret_key
            kwargs["aws_session_token"] = o.session_token
        session = _SESSIONS.get((self._pid, o.profile))
        if session is None:
            session = AioSession(profile=o.profile) if o.profile else AioSession()
            session.register_component("data_loader", _data_loader(session))
            _SESSIONS[(self._pid, o.profile)] = session
        region = o.region or session.get_config_variable("region")
        kwargs["region_name"] = region or "us-east-1"
        client = await stack.enter_async_context(session.create_client("s3", **kwargs))
        _keep_bodies_as_bytes(client)
        return client

    def _lean_static(self) -> Any:
        """The lean request path without botocore, where nothing needs botocore to resolve
        it: an explicit endpoint, a region and static keys given in the options or in the
        environment (botocore's first source of credentials; a profile would skip it).
        None otherwise, and the client's resolution is used."""
        o = self.options
        env = os.environ
        region = o.region or env.get("AWS_DEFAULT_REGION")
        if not o.lean_requests or not o.endpoint_url or not region:
            return None
        if o.access_key and o.secret_key:
            creds = (o.access_key, o.secret_key, o.session_token)
        elif (
            not o.profile
            and "AWS_CREDENTIAL_EXPIRATION" not in env  # refreshing: botocore's job
            and env.get("AWS_ACCESS_KEY_ID")
            and env.get("AWS_SECRET_ACCESS_KEY")
        ):
            token = env.get("AWS_SECURITY_TOKEN") or env.get("AWS_SESSION_TOKEN")
            creds = (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], token)
        else:
            return None
        from .s3_http import Credentials

        frozen = Credentials(*creds)
        return self._lean_http(o.endpoint_url, region, lambda: frozen)

    def _lean(self, client: Any) -> Any:
        """The lean request path (:mod:`.s3_http`) for ``client``'s endpoint, region and
        credentials, or None where it cannot serve them."""
        creds = getattr(getattr(client, "_request_signer", None), "_credentials", None)
        if not self.options.lean_requests or creds is None:
            return None
        return self._lean_http(
            client.meta.endpoint_url, client.meta.region_name, creds.get_frozen_credentials
        )

    def _lean_http(self, endpoint: str, region: str, credentials: Callable[[], Any]) -> Any:
        from .s3_http import LeanUnsupported, S3Http

        o = self.options
        style = o.addressing_style or ("path" if o.endpoint_url else "auto")
        try:
            return S3Http(
                endpoint_url=endpoint,
                region=region,
                bucket=self.bucket,
                path_style=style == "path",
                credentials=credentials,
                sign_payload=o.checksum == "off",
                pool=o.max_concurrency + 4,
                connect_timeout=o.connect_timeout,
                read_timeout=o.read_timeout,
                socket_factory=functools.partial(_socket, o.socket_buffer),
            )
        except LeanUnsupported:
            return None

    async def _object_call(
        self, method: str, lean: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        """PutObject / UploadPart / GetObject / HeadObject / ListObjectsV2 (botocore names), on the lean
        path while it serves this store, else on botocore; ``lean``: the lean path's own
        extra arguments."""
        await self._bind()
        http = self._http
        if http is not None:
            from .s3_http import LeanUnsupported

            try:
                return await getattr(http, method)(Bucket=self.bucket, **kwargs, **(lean or {}))
            except LeanUnsupported as e:
                log.info("S3 %s: %s; using botocore for every call", self.url, e)
                self._http = None
        return await getattr(await self._cli(), method)(Bucket=self.bucket, **kwargs)

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
        self._http = None
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
        sent, on the lean path and botocore's alike."""
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
            return {"IfMatch": _quote(options.if_match)}
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
            etag=_unquote(head.get("ETag")),
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
        try:
            return dict(
                await self.retrier.call(
                    "stat", key, lambda: self._object_call("head_object", Key=full, **extra)
                )
            )
        except NotFound:
            await self._check_bucket(key)
            raise

    # ---- writes -------------------------------------------------------------------------

    async def _checksum_args(
        self, body: Buffer, known: int | None = None
    ) -> tuple[dict[str, Any], int | None]:
        """Request checksum headers for ``body`` and its CRC32C (None when checksums are off)."""
        mode = self.options.checksum
        if mode == "off":
            return {}, None
        n = known if known is not None else await _crc_off_loop(body)
        if mode == "md5":
            import hashlib

            digest = await runtime.to_cpu(lambda: hashlib.md5(body).digest())
            return {"ContentMD5": base64.b64encode(digest).decode()}, n
        return {"ChecksumCRC32C": _b64(n)}, n

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
            return await self._object_call(
                "put_object",
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
            etag=_unquote(resp.get("ETag")),
            metadata=metadata,
        )

    async def _create_upload(
        self, key: str, full: str, metadata: Mapping[str, str], *, checksums: bool = True
    ) -> str:
        self._check_metadata(key, metadata)
        extra: dict[str, Any] = dict(self._sse())
        if checksums and self.options.checksum == "crc32c":
            extra["ChecksumAlgorithm"] = "CRC32C"
        cli = await self._cli()
        retried = False

        def note(_: BaseException) -> None:
            nonlocal retried
            retried = True

        started = time.time()
        resp = await self.retrier.call(
            "open_writer",
            key,
            lambda: cli.create_multipart_upload(
                Bucket=self.bucket, Key=full, Metadata=dict(metadata), **extra
            ),
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
        self, key: str, full: str, upload_id: str, number: int, body: Buffer
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
        body: Buffer,
        sums: Mapping[str, str],
    ) -> dict[str, Any]:
        """One UploadPart (lean path where it serves), retried."""
        args: dict[str, Any] = {"Key": full, "UploadId": upload_id, "PartNumber": number}
        args.update(sums, Body=body)
        return await self.retrier.call(
            "put_part", key, lambda: self._object_call("upload_part", **args)
        )

    async def _complete(
        self,
        key: str,
        full: str,
        upload_id: str,
        parts: list[dict[str, Any]],
        options: PutOptions,
    ) -> dict[str, Any]:
        parts = sorted(parts, key=lambda p: p["PartNumber"])
        retried = False

        def note(_: BaseException) -> None:
            nonlocal retried
            retried = True

        cli = await self._cli()

        async def send() -> Any:
            return await cli.complete_multipart_upload(
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **self._conditions(key, options),
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
            if _unquote(head.get("ETag")) == f"{digest}-{len(parts)}":
                return head
            raise

    async def _abort_upload(self, key: str, full: str, upload_id: str) -> None:
        with contextlib.suppress(NotFound):  # already gone: aborted or completed elsewhere
            await self._call("abort", key, "abort_multipart_upload", Key=full, UploadId=upload_id)

    async def _put_multipart(
        self, key: str, full: str, view: memoryview, options: PutOptions
    ) -> ObjectMeta:
        size = view.nbytes
        psize = put_part_size(self.options.part_size, size)
        metadata = dict(options.metadata or {})
        if self.options.checksum != "off":
            crc = options.content_crc32c
            if crc is None:
                crc = await runtime.to_cpu(crc32c, view)
            metadata[META_CRC] = f"{crc:08x}"
        upload_id = await self._create_upload(key, full, metadata)
        done = False
        try:

            async def one(i: int) -> dict[str, Any]:
                # Each part is sent straight from the caller's buffer, never copied.
                async with sem:
                    body = view[i * psize : (i + 1) * psize]
                    return await self._upload_part(key, full, upload_id, i + 1, body)

            sem = asyncio.Semaphore(self.options.max_concurrency)
            count = -(-size // psize)
            parts = await _all_or_cancel(one(i) for i in range(count))
            resp = await self._complete(key, full, upload_id, parts, options)
            done = True
        finally:
            if not done:
                await asyncio.shield(self._abort_upload(key, full, upload_id))
        return ObjectMeta(
            key=key,
            size=size,
            mtime=time.time(),
            etag=_unquote(resp.get("ETag")),
            metadata=metadata,
        )

    async def open_part_writer(
        self,
        key: str,
        size: int,
        part_size: int,
        *,
        token: str | None = None,
        options: PutOptions = PutOptions(),
    ) -> PartWriter:
        """A resumable multipart upload (see :mod:`.s3_parts`); part layouts S3 cannot take
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
        from .s3_parts import S3PartWriter

        return await S3PartWriter.open(self, key, full, size, part_size, token, options)

    async def open_writer(self, key: str, options: PutOptions = PutOptions()) -> Writer:
        full = self._full(key)
        await self._precheck(key, options)
        if options.mode == "if_match":
            self._conditions(key, options)  # validate now, not at commit
        w = S3Writer(self, key, full, options)
        self._writers.add(w)
        return w

    # ---- reads --------------------------------------------------------------------------

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
        1 s of CPU per GB on a machine where page faults are dear.)  Or, on the lean path,
        it goes straight into ``into`` (at least the range's size) where it fits: then no
        pieces come back, only the length.
        """
        kwargs: dict[str, Any] = {"Key": full}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if if_match:
            kwargs["IfMatch"] = _quote(if_match)

        async def attempt() -> tuple[dict[str, Any], list[Buffer], int]:
            from .s3_retry import ShortBody

            try:
                resp = await self._object_call(
                    "get_object", None if into is None else {"into": into}, **kwargs
                )
            except Exception as e:
                code, status = error_code(e)
                if if_match and (status == 412 or code == "PreconditionFailed"):
                    raise Restart() from e
                raise
            body = resp.pop("Body")
            chunks: list[Buffer] = getattr(body, "pieces", [])  # the lean path's, read already
            n = getattr(body, "nbytes", 0)
            try:
                # Timeouts and broken bodies raise asyncio / aiohttp errors here (on the
                # lean path, in the request), which the retrier treats like botocore's.
                content = None if hasattr(body, "pieces") else body.raw_stream.content
                while content is not None and (chunk := await content.readany()):
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
        return await _join(pieces)

    async def get_range_pieces(self, key: str, start: int, end: int) -> list[Buffer]:
        _, pieces = await self._read(key, start, end, None)
        return pieces

    async def get_into(self, key: str, start: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        await self._read(key, start, start + out.nbytes, out)

    async def read_to(
        self, key: str, start: int, end: int, consume: Callable[[memoryview], Any]
    ) -> None:
        """Bytes ``[start, end)`` to ``consume`` in order as they arrive (see
        :meth:`Store.read_to`): one GET, received into a small ring on the lean path.  A GET
        that breaks off is resumed where it stopped, pinned to the ETag it began with; the
        object changing in between is :class:`StoreUnavailable` (what was consumed came from
        the old one).  Nothing is checked against a checksum here: the caller has the bytes.
        """
        from .http1 import Sink
        from .s3_retry import ShortBody

        full = self._full(key)
        if start < 0 or end < start:
            raise InvalidRange(f"bad range [{start}, {end})", tier=self.tier, key=key)
        if end == start:
            self._check_range(key, (await self.stat(key)).size, start, end)
            return
        pos, etag = start, None
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
            etag = etag or _unquote(headers.get("etag"))
            return True

        ring = memoryview(bytearray(STREAM_RING))

        async def attempt() -> None:
            nonlocal etag
            if pos == end:  # all consumed; the answer's end was lost (a dropped connection)
                return
            kwargs: dict[str, Any] = {"Key": full, "Range": f"bytes={pos}-{end - 1}"}
            if etag:
                kwargs["IfMatch"] = _quote(etag)
            try:
                resp = await self._object_call(
                    "get_object", {"sink": Sink(ring, feed, accept)}, **kwargs
                )
                body = resp.pop("Body")
                try:
                    # Bodies the sink did not take: botocore's stream, or the lean path's
                    # pieces (a range the server answered otherwise than asked).
                    size, first = _total_size(resp, int(resp.get("ContentLength", 0)))
                    self._check_range(key, size, start, end)
                    etag = etag or _unquote(resp.get("ETag"))
                    skip = pos - first
                    if skip < 0:
                        raise ShortBody(f"asked for bytes from {pos}, got them from {first}")
                    content = None if hasattr(body, "pieces") else body.raw_stream.content
                    pieces = iter(getattr(body, "pieces", ()))
                    while chunk := next(pieces, None) or (content and await content.readany()):
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
        return meta, await _join(pieces)

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
        etag = _unquote(resp.get("ETag"))
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

            pieces += await _all_or_cancel(fetch(a, b) for a, b in bounds)
        flat: list[Buffer] = [] if out is not None else [c for p in pieces for c in p]
        if start == 0 and end == size and self.options.checksum != "off":
            whole: Buffer = out if out is not None else await _join(flat)
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
            got = await _crc_off_loop(data)
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
        composite = resp.get("ChecksumCRC32C")
        if not composite:
            head = await self._head(key, full, ChecksumMode="ENABLED", IfMatch=_quote(etag))
            composite = head.get("ChecksumCRC32C")
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

    async def pending_uploads(self) -> list[tuple[str, str]]:
        """``(key, upload_id)`` of every multipart upload in progress under this store's root."""
        out: list[tuple[str, str]] = []
        kw: dict[str, Any] = {"Prefix": self.root}
        while True:
            resp = await self._call("list_uploads", None, "list_multipart_uploads", **kw)
            out += [(u["Key"][len(self.root) :], u["UploadId"]) for u in resp.get("Uploads", [])]
            if not resp.get("IsTruncated"):
                return out
            kw = {
                "Prefix": self.root,
                "KeyMarker": resp.get("NextKeyMarker"),
                "UploadIdMarker": resp.get("NextUploadIdMarker"),
            }

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
        while True:
            req = dict(base)
            if token:
                req["ContinuationToken"] = token
            resp = await self.retrier.call(
                "list",
                p or None,
                functools.partial(self._object_call, "list_objects_v2", **req),
            )
            entries = [
                ObjectMeta(
                    key=o["Key"][cut:],
                    size=int(o.get("Size", 0)),
                    mtime=o["LastModified"].timestamp() if o.get("LastModified") else None,
                    etag=_unquote(o.get("ETag")),
                )
                for o in resp.get("Contents", [])
                # Temporary objects of pending part writes are not objects yet.
                if not o["Key"].rpartition("/")[2].startswith(TMP_MARK)
            ]
            entries += [
                ObjectMeta(key=c["Prefix"][cut:], size=0, is_dir=True)
                for c in resp.get("CommonPrefixes", [])
            ]
            entries.sort(key=lambda m: m.key.encode("utf-8", "surrogatepass"))
            for m in entries:
                yield m
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:
                return

    async def delete(self, key: str) -> None:
        full = self._full(key)
        await self._call("delete", key, "delete_object", Key=full)

    async def delete_many(self, keys: Iterable[str]) -> None:
        """DeleteObjects in batches of 1,000 (S3's limit), batches sent concurrently."""
        fulls = [self._full(k) for k in keys]
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

        await _all_or_cancel(one(b) for b in batches)

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
                CopySourceIfMatch=_quote(head["ETag"]),
                MetadataDirective="REPLACE",
                Metadata=metadata,
                **self._conditions(dst, options),
                **self._sse(),
            )
            etag = _unquote((resp.get("CopyObjectResult") or {}).get("ETag"))
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
                    CopySourceIfMatch=_quote(head["ETag"]),
                )
                return {"PartNumber": i + 1, "ETag": resp["CopyPartResult"]["ETag"]}

            parts = await _all_or_cancel(one(i) for i in range(-(-size // psize)))
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
            etag=_unquote(resp.get("ETag")),
            metadata=metadata,
        )


def _data_loader(session: Any) -> Any:
    """The process-wide botocore data loader for ``session``'s data path."""
    path = session.get_config_variable("data_path")
    loader = _DATA_LOADERS.get(path)
    if loader is None:
        loader = _DATA_LOADERS[path] = session.get_component("data_loader")
    return loader


def _socket(buffer: int, addr_info: Any) -> socket.socket:
    """A connection's socket: keep-alive on (aiobotocore ignores ``tcp_keepalive``) and
    ``buffer`` bytes of kernel send / receive buffer when non-zero."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
    except OSError:
        sock.close()
        raise
    return sock


def _copy_chunks(out: memoryview, pos: int, chunks: list[Buffer]) -> None:
    for c in chunks:
        out[pos : pos + len(c)] = c
        pos += len(c)


def _keep_bodies_as_bytes(client: Any) -> None:
    """Stop botocore wrapping ``bytes`` bodies in ``BytesIO``.

    botocore does that so its own retries can rewind the body; ours resend the whole
    request, so it only costs: aiohttp copies a ``BytesIO`` once more (``getbuffer``) and
    then sends it in 256 KiB pieces with an event-loop round trip each, where ``bytes``
    go to the socket in one write.
    """
    from botocore.handlers import convert_body_to_file_like_object

    for op in ("PutObject", "UploadPart"):
        client.meta.events.unregister(
            f"before-parameter-build.s3.{op}", convert_body_to_file_like_object
        )


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
    return f"{_b64(crc32c(crcs))}-{i}"


@dataclass
class _UploadState:
    """What an orphaned writer's finaliser needs (never the writer itself)."""

    upload_id: str | None = None
    done: bool = False


def _abort_orphan(store: S3Store, key: str, full: str, state: _UploadState) -> None:
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

    def __init__(self, store: S3Store, key: str, full: str, options: PutOptions) -> None:
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

    async def write(self, data: Buffer) -> None:
        self._check_open()
        view = memoryview(data).cast("B")
        while view.nbytes:
            room = writer_part_size(self._base, self._index) - len(self._buf)
            self._buf += view[:room]
            view = view[room:]
            if len(self._buf) == writer_part_size(self._base, self._index):
                await self._flush()
        self._check_open()

    async def _flush(self) -> None:
        if self._state.upload_id is None:
            metadata = dict(self.options.metadata or {})
            if self.store.options.checksum != "off":
                metadata[META_PART_SIZE] = str(self._base)
            self._state.upload_id = await self.store._create_upload(self.key, self.full, metadata)
        body, self._buf = self._buf, bytearray()
        self._size += len(body)
        self._index += 1
        number = self._index
        await self._slots.acquire()
        task = asyncio.get_running_loop().create_task(self._send(number, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, number: int, body: bytearray) -> None:
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
                    etag=_unquote(resp.get("ETag")),
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
