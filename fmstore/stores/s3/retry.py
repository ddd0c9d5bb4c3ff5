"""Retries, throttling and error translation for the S3 backend.

botocore's own retries are set to a single attempt: they cannot see an error that happens
while a response body is being read, which is where a reset connection or a truncated body
shows up on a large GET.  :class:`Retrier` therefore wraps the *whole* request, body
included: exponential backoff with full jitter on 5xx, SlowDown / throttling, timeouts,
connection errors and short bodies, bounded both in attempts and in total time; when it gives
up it raises :class:`~fmstore.errors.StoreUnavailable` naming the tier and key.

:class:`AdaptiveLimiter` caps the requests in flight: halved when the server throttles
(once per round of requests, not once per throttled response), grown back by about one
request per round of successes.  :func:`translate` turns everything else into the error
classes of :mod:`fmstore.errors` at the edge.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import ssl
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import botocore.exceptions as bx

from ...errors import (
    AlreadyExists,
    CorruptData,
    FmstoreError,
    InvalidRange,
    NotFound,
    PermissionDenied,
    PreconditionFailed,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_THROTTLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestLimitExceeded",
    "TooManyRequests",
    "TooManyRequestsException",
    "ProvisionedThroughputExceededException",
    "BandwidthLimitExceeded",
}
_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "RequestTimeoutException",
    "PriorRequestNotComplete",
    "OperationAborted",
}
#: The server saw different bytes than we sent: corrupted on the way, so send them again.
_DIGEST_CODES = {"BadDigest", "XAmzContentSHA256Mismatch", "InvalidDigest"}
_DENIED_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AccountProblem",
    "InvalidObjectState",
}
_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404", "NoSuchVersion"}


class ShortBody(Exception):
    """A response body ended before the bytes its headers promised (retryable)."""


class Restart(Exception):
    """The object changed under a multi-request read; start the whole read again."""


def error_code(e: BaseException) -> tuple[str, int]:
    """The S3 error code and HTTP status of a ``ClientError`` (``("", 0)`` otherwise)."""
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {}) or {}
        meta = e.response.get("ResponseMetadata", {}) or {}
        return str(err.get("Code", "")), int(meta.get("HTTPStatusCode", 0) or 0)
    return "", 0


def _cert_failure(e: BaseException) -> bool:
    """Whether a TLS certificate failed verification somewhere in ``e``'s chain (botocore
    and aiohttp wrap it in connection errors): a configuration or an attack, which another
    attempt cannot fix."""
    seen = 0
    cur: BaseException | None = e
    while cur is not None and seen < 16:
        if isinstance(cur, ssl.SSLCertVerificationError):
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


#: getaddrinfo's answers that the name does not exist (not "try again": a DNS server
#: that is throttled or down, EAI_AGAIN, is retried like any connection failure).
_NO_SUCH_NAME = {
    socket.EAI_NONAME,
    getattr(socket, "EAI_NODATA", socket.EAI_NONAME),
    socket.EAI_FAIL,
}


def unresolvable(e: BaseException) -> str | None:
    """The host name that does not resolve, where ``e`` (or an error in its chain) is a
    DNS answer that it does not exist: a typo in an endpoint, which no retry fixes.  The
    host is taken from the error that names it ("" where none does); None otherwise."""
    host: str | None = None
    found = False
    seen = 0
    cur: BaseException | None = e
    while cur is not None and seen < 16:
        if isinstance(cur, socket.gaierror) and cur.errno in _NO_SUCH_NAME:
            found = True
        if host is None:
            host = _host_of(cur)
        os_error = getattr(cur, "os_error", None)  # aiohttp's connector errors
        if isinstance(os_error, socket.gaierror) and os_error.errno in _NO_SUCH_NAME:
            found = True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return (host or "") if found else None


def _host_of(e: BaseException) -> str | None:
    """The host an error names: botocore's ``endpoint_url``, aiohttp's ``host``, the
    lean client's (see ``http1.Unresolvable``)."""
    from urllib.parse import urlsplit

    host = getattr(e, "host", None)
    if isinstance(host, str) and host:
        return host
    url = (getattr(e, "kwargs", None) or {}).get("endpoint_url")
    if isinstance(url, str) and url:
        return urlsplit(url).hostname
    return None


def retry_reason(e: BaseException) -> str | None:
    """Why ``e`` is worth another attempt (a metrics label), or None when it is not."""
    if _cert_failure(e) or unresolvable(e) is not None:
        return None
    if isinstance(e, bx.ClientError):
        code, status = error_code(e)
        if code in _THROTTLE_CODES or status in (429, 503):
            return "throttled"
        if code in _DIGEST_CODES:
            return "checksum"
        if code in _TRANSIENT_CODES or status >= 500:
            return "server_error"
        return None
    if isinstance(e, ShortBody | bx.IncompleteReadError | bx.ResponseStreamingError):
        return "short_body"
    if isinstance(e, bx.ReadTimeoutError | bx.ConnectTimeoutError | asyncio.TimeoutError):
        return "timeout"
    if isinstance(
        e,
        bx.EndpointConnectionError
        | bx.ConnectionClosedError
        | bx.HTTPClientError
        | ConnectionError,
    ):
        return "connection"
    # aiohttp's errors, from botocore's calls; not imported here: the lean path alone
    # never loads aiohttp (about 0.25 s of imports), and then none of its errors can occur.
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(e, aiohttp.ClientError):
        return "connection"
    if isinstance(e, CorruptData):
        return "checksum"
    return None


def translate(
    e: BaseException,
    *,
    tier: str,
    key: str | None,
    bucket: str,
    op: str,
    create: bool = False,
) -> FmstoreError:
    """The :mod:`fmstore.errors` class for an SDK or transport error."""
    host = unresolvable(e)
    if host is not None:
        return StoreUnavailable(
            f"S3 {op}: cannot resolve the host name {host!r} of the S3 endpoint "
            "(not retried; check endpoint_url, AWS_ENDPOINT_URL* and the AWS profile)",
            tier=tier,
            key=key,
        )
    if isinstance(e, FmstoreError):
        if e.tier is None:  # raised below the store (the HTTP client): name where
            e.tier, e.key = tier, key
        return e
    if isinstance(e, bx.ClientError):
        code, status = error_code(e)
        msg = (e.response.get("Error", {}) or {}).get("Message") or code or f"HTTP {status}"
        if code == "NoSuchBucket":
            return NotFound(f"bucket {bucket!r} does not exist", tier=tier, key=key)
        if code == "NoSuchUpload":
            return NotFound(
                f"S3 {op}: the multipart upload no longer exists (aborted elsewhere?)",
                tier=tier,
                key=key,
            )
        if code in _NOT_FOUND_CODES or status == 404:
            return NotFound(f"no such object in bucket {bucket!r}", tier=tier, key=key)
        if code in _DENIED_CODES or status == 403:
            return PermissionDenied(f"S3 {op} refused: {code}: {msg}", tier=tier, key=key)
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
            if create:
                return AlreadyExists(
                    "object already exists (create-only write)", tier=tier, key=key
                )
            return PreconditionFailed(
                f"S3 {op}: the object changed (etag no longer matches)", tier=tier, key=key
            )
        if code == "InvalidRange" or status == 416:
            return InvalidRange(f"S3 {op}: range not satisfiable", tier=tier, key=key)
        if retry_reason(e) is not None:
            return StoreUnavailable(f"S3 {op} failed: {code or status}: {msg}", tier=tier, key=key)
        return FmstoreError(f"S3 {op} failed: {code or status}: {msg}", tier=tier, key=key)
    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        return PermissionDenied(
            f"no usable S3 credentials ({e}); set access_key/secret_key, AWS_* variables or a profile",
            tier=tier,
            key=key,
        )
    if isinstance(e, bx.ParamValidationError):
        return FmstoreError(f"S3 {op}: invalid request: {e}", tier=tier, key=key)
    if isinstance(e, bx.ProfileNotFound):
        return PermissionDenied(f"S3 profile not found: {e}", tier=tier, key=key)
    if retry_reason(e) is not None:
        return StoreUnavailable(f"S3 {op} failed: {type(e).__name__}: {e}", tier=tier, key=key)
    return FmstoreError(f"S3 {op} failed: {type(e).__name__}: {e}", tier=tier, key=key)


class AdaptiveLimiter:
    """A concurrency limit that halves on throttling and grows back slowly (AIMD).

    Each slot remembers the limiter's *epoch* when it was taken; a throttled response only
    halves the limit if its request started after the last halving, so one burst of 503s
    from requests that were all in flight together counts as one signal, not many.
    """

    def __init__(self, max_limit: int) -> None:
        self.max_limit = max(1, max_limit)
        self.limit = float(self.max_limit)
        self.min_seen = self.limit
        self.inflight = 0
        self.epoch = 0
        self.throttles = 0
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[int]:
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self.inflight < int(self.limit))
            self.inflight += 1
        try:
            yield self.epoch
        finally:
            async with cond:
                self.inflight -= 1
                cond.notify_all()

    def on_throttle(self, epoch: int) -> None:
        self.throttles += 1
        if epoch == self.epoch:
            self.epoch += 1
            self.limit = max(1.0, self.limit / 2)
            self.min_seen = min(self.min_seen, self.limit)

    def on_success(self) -> None:
        # Called while the slot is still held: releasing it wakes the waiters, who then
        # see the grown limit.
        if self.limit < self.max_limit:
            self.limit = min(float(self.max_limit), self.limit + 1.0 / self.limit)


@dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` tries in all, waiting ``base_delay * 2**n`` (capped at
    ``max_delay``, full jitter) between them, and never starting a new try after
    ``deadline`` seconds."""

    max_attempts: int = 10
    base_delay: float = 0.05
    max_delay: float = 5.0
    deadline: float = 120.0


def count_retry(tier: str, reason: str) -> None:
    """One retried request, in the metrics.  Imported on the first retry, not at start-up:
    a command that exports no metrics need not load prometheus_client (50 ms)."""
    from ...metrics import STORE_RETRIES

    STORE_RETRIES.labels(tier, reason).inc()


class Retrier:
    """Runs request coroutines under the limiter with retries; see the module docstring."""

    def __init__(
        self, policy: RetryPolicy, limiter: AdaptiveLimiter, *, tier: str, bucket: str
    ) -> None:
        self.policy = policy
        self.limiter = limiter
        self.tier = tier
        self.bucket = bucket
        #: The reasons already logged (one line each, after their first failed attempt).
        self._said: set[str] = set()

    async def call(
        self,
        op: str,
        key: str | None,
        fn: Callable[[], Awaitable[T]],
        *,
        create: bool = False,
        on_retry: Callable[[BaseException], None] | None = None,
    ) -> T:
        """``await fn()`` until it succeeds, fails for good, or the retry budget is spent.

        ``fn`` must be safe to repeat (each call sends the whole request again).
        ``on_retry`` sees each retried error (callers use it to remember that a later
        precondition failure may be their own earlier, unacknowledged success).
        """
        p = self.policy
        t0 = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            async with self.limiter.slot() as epoch:
                try:
                    result = await fn()
                except (Restart, asyncio.CancelledError):
                    raise
                except Exception as e:
                    err: Exception = e
                else:
                    self.limiter.on_success()
                    return result
            reason = retry_reason(err)
            if reason is None:
                raise translate(
                    err, tier=self.tier, key=key, bucket=self.bucket, op=op, create=create
                ) from err
            if reason == "throttled":
                self.limiter.on_throttle(epoch)
            delay = random.uniform(0, min(p.max_delay, p.base_delay * (2**attempt)))
            elapsed = time.monotonic() - t0
            if attempt >= p.max_attempts or elapsed + delay > p.deadline:
                # e.g. CorruptData: keep its meaning (a connection failure is summed up)
                if isinstance(err, FmstoreError) and not isinstance(err, StoreUnavailable):
                    raise err
                raise StoreUnavailable(
                    f"S3 {op} still failing after {attempt} attempts in {elapsed:.1f} s "
                    f"({reason}: {_describe(err)})",
                    tier=self.tier,
                    key=key,
                ) from err
            count_retry(self.tier, reason)
            if reason not in self._said:
                # Say once what is being retried: a dead endpoint otherwise gives the whole
                # retry budget of silence before its error.
                self._said.add(reason)
                log.warning(
                    "S3 %s of %s on tier %s failed (%s: %s); retrying, up to %d attempts in %.0f s",
                    op,
                    f"{self.bucket}/{key}" if key else self.bucket,
                    self.tier,
                    reason,
                    _describe(err)[:300],
                    p.max_attempts,
                    p.deadline,
                )
            if on_retry is not None:
                on_retry(err)
            await asyncio.sleep(delay)


def _describe(e: BaseException) -> str:
    code, status = error_code(e)
    if code or status:
        return f"{code} (HTTP {status})"
    return f"{type(e).__name__}: {e}"
