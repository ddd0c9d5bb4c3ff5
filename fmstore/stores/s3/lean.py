"""The lean transport: S3's hot calls (PutObject, UploadPart, GetObject, HeadObject,
ListObjectsV2, and starting, completing and aborting multipart uploads) signed and sent by
fmstore itself.

botocore spends about 2 ms of CPU on every request (event hooks, model-driven
serialisation and parsing, slow XML parsing of listings) where signing and sending it take
about 0.5 ms.  For objects of a few KiB that overhead *is* the cost of a copy, and on a
training node the cores it burns are shared with everything else.  :class:`LeanTransport`
signs (SigV4, :class:`Signer`) and sends those calls itself on a small HTTP/1.1 client of
its own (:mod:`..http1`), with the endpoint, region and credentials botocore resolved, and
answers in botocore's shapes: the same response dict keys, and botocore ``ClientError`` for
error responses, so retries and error translation (:mod:`.retry`) stay one code path.
Everything else (listing parts and uploads, copies, deletes) stays on botocore, whose
client (about half a second to import and build) a plain upload or download then never
needs.

Where the lean transport cannot follow S3 (a redirect to another region, an endpoint that
rejects our signature shape, an HTTP proxy in the environment), it raises
:class:`~.transport.LeanUnsupported` and the store falls back to botocore for good
(:class:`~.transport.FallbackTransport`); ``S3Options(lean_requests=False)`` never uses it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
import ssl
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, urlsplit
from urllib.parse import unquote_plus as _unquote_plus
from xml.etree import ElementTree

import botocore.exceptions as bx

from ... import runtime
from ..http1 import Pool, Response, Sink
from ..types import Buffer, Pieces, views_of
from .transport import Body, LeanUnsupported, Transport

#: SHA-256 of an empty payload (GET and HEAD).
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: Bodies up to this size are hashed on the event loop when the payload must be signed.
_INLINE = 256 << 10
_META = "x-amz-meta-"
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
#: Answers that mean "not the request botocore would have sent": fall back to botocore.
_FALLBACK_CODES = {
    "PermanentRedirect",
    "AuthorizationHeaderMalformed",
    "IllegalLocationConstraintException",
    "TemporaryRedirect",
}


class Credentials:
    """Frozen credentials for one request: what botocore's providers resolved."""

    __slots__ = ("access_key", "secret_key", "token")

    def __init__(self, access_key: str, secret_key: str, token: str | None) -> None:
        self.access_key, self.secret_key, self.token = access_key, secret_key, token


def canonical_query(params: Mapping[str, str]) -> str:
    """SigV4's canonical query string, which is also what we send: names sorted, names and
    values percent-encoded except for RFC 3986's unreserved characters."""
    return "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(params.items())
    )


class Signer:
    """SigV4 for S3 requests, as botocore's ``S3SigV4Auth`` signs them: every header given
    is signed, the payload hash is the caller's."""

    def __init__(self, host: str, region: str) -> None:
        self.host, self.region = host, region
        self._keys: dict[tuple[str, str], bytes] = {}
        self._second, self._stamp = -1, ""

    def sign(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        payload_hash: str,
        creds: Credentials,
        now: float | None = None,
        query: str = "",
    ) -> None:
        """Add SigV4 headers (``x-amz-date``, ``x-amz-content-sha256``, ``Authorization``);
        every header in ``headers`` is signed.  ``query``: the canonical query string (see
        :func:`canonical_query`), sent exactly so."""
        second = int(time.time() if now is None else now)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(second))
        stamp = self._stamp
        day = stamp[:8]
        headers["host"] = self.host
        headers["x-amz-date"] = stamp
        headers["x-amz-content-sha256"] = payload_hash
        if creds.token:
            headers["x-amz-security-token"] = creds.token
        names = sorted(headers)
        canonical = "\n".join(
            (
                method,
                path,
                query,
                "".join(f"{k}:{' '.join(str(headers[k]).split())}\n" for k in names),
                ";".join(names),
                payload_hash,
            )
        )
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(
            ("AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest())
        )
        signature = hmac.new(
            self._signing_key(creds.secret_key, day), to_sign.encode(), hashlib.sha256
        ).hexdigest()
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )

    def _signing_key(self, secret: str, day: str) -> bytes:
        k = self._keys.get((secret, day))
        if k is None:
            k = f"AWS4{secret}".encode()
            for part in (day, self.region, "s3", "aws4_request"):
                k = hmac.new(k, part.encode(), hashlib.sha256).digest()
            self._keys = {(secret, day): k}  # keys of other days are never needed again
        return k


class LeanTransport(Transport):
    """Signs and sends the calls of :class:`~.transport.Transport` to ``bucket``; see the
    module docstring.  The calls also take botocore's ``Bucket``, and
    ignore it: the bucket is bound here.

    ``credentials`` returns the current frozen credentials (refreshed by botocore's
    providers as they expire).
    """

    def __init__(
        self,
        *,
        endpoint_url: str,
        region: str,
        bucket: str,
        path_style: bool,
        credentials: Callable[[], Any],
        sign_payload: bool,
        pool: int,
        connect_timeout: float,
        read_timeout: float,
        socket_factory: Callable[[Any], Any] | None = None,
    ) -> None:
        url = urlsplit(endpoint_url)
        try:
            port = url.port
        except ValueError:
            raise LeanUnsupported(f"endpoint {endpoint_url!r}") from None
        if url.scheme not in ("http", "https") or not url.hostname:
            raise LeanUnsupported(f"endpoint {endpoint_url!r}")
        if not path_style and not _DNS_BUCKET.match(bucket):
            path_style = True  # what botocore does for names DNS cannot carry
        host = url.hostname if path_style else f"{bucket}.{url.hostname}"
        name = f"[{host}]" if ":" in host else host  # an IPv6 address
        self.host = name if port is None else f"{name}:{port}"
        base = url.path.rstrip("/")
        self._prefix = f"{base}/{quote(bucket, safe='')}/" if path_style else f"{base}/"
        # HTTP(S)_PROXY / NO_PROXY, as botocore honours them: requests through a proxy are
        # botocore's to send.  (urllib.request is slow to import: only where one is set.)
        if any(k.lower().endswith("_proxy") for k in os.environ):
            import urllib.request

            proxy = urllib.request.getproxies().get(url.scheme)
            if proxy and not urllib.request.proxy_bypass(url.hostname):
                raise LeanUnsupported(f"requests go through the proxy {proxy}")
        self.signer = Signer(self.host, region)
        self.credentials = credentials
        self.sign_payload = sign_payload
        ssl_ctx: ssl.SSLContext | None = None
        if url.scheme == "https":
            ssl_ctx = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
        self._pool = Pool(
            host,
            port or (443 if url.scheme == "https" else 80),
            limit=pool,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            ssl=ssl_ctx,
            server_hostname=host if ssl_ctx else None,
            socket_factory=socket_factory,
        )

    async def close(self) -> None:
        await self._pool.close()

    # ---- the calls (botocore's parameter and response names) ----------------------------

    async def put_object(
        self,
        *,
        Bucket: str | None = None,
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
        del Bucket  # bound at construction
        headers = _new_object(Metadata, ServerSideEncryption, SSEKMSKeyId)
        _opt(headers, "if-none-match", IfNoneMatch)
        _opt(headers, "if-match", IfMatch)
        _opt(headers, "x-amz-checksum-crc32c", ChecksumCRC32C)
        _opt(headers, "content-md5", ContentMD5)
        digest = await self._payload_hash(Body)
        resp = await self._send("PUT", "PutObject", Key, headers, digest, Body)
        _raise_for(resp, "PutObject")
        return _put_fields(resp)

    async def upload_part(
        self,
        *,
        Bucket: str | None = None,
        Key: str,
        UploadId: str,
        PartNumber: int,
        Body: Buffer | Pieces,
        ChecksumCRC32C: str | None = None,
        ContentMD5: str | None = None,
    ) -> dict[str, Any]:
        del Bucket
        headers: dict[str, str] = {}
        _opt(headers, "x-amz-checksum-crc32c", ChecksumCRC32C)
        _opt(headers, "content-md5", ContentMD5)
        digest = await self._payload_hash(Body)
        query = {"partNumber": str(PartNumber), "uploadId": UploadId}
        resp = await self._send("PUT", "UploadPart", Key, headers, digest, Body, query)
        _raise_for(resp, "UploadPart")
        return _put_fields(resp)

    async def create_multipart_upload(
        self,
        *,
        Bucket: str | None = None,
        Key: str,
        Metadata: Mapping[str, str] | None = None,
        ChecksumAlgorithm: str | None = None,
        ChecksumType: str | None = None,
        ServerSideEncryption: str | None = None,
        SSEKMSKeyId: str | None = None,
    ) -> dict[str, Any]:
        del Bucket
        headers = _new_object(Metadata, ServerSideEncryption, SSEKMSKeyId)
        _opt(headers, "x-amz-checksum-algorithm", ChecksumAlgorithm)
        _opt(headers, "x-amz-checksum-type", ChecksumType)
        op = "CreateMultipartUpload"
        # Not resent behind the caller's back: a second upload would be left orphaned
        # (the caller's retry aborts strays).
        resp = await self._send(
            "POST", op, Key, headers, EMPTY_SHA256, None, {"uploads": ""}, resend=False
        )
        _raise_for(resp, op)
        upload_id = _xml(_result(resp, op), "UploadId")
        if not upload_id:
            raise _server_error(op, "the answer names no UploadId")
        return {"UploadId": upload_id}

    async def complete_multipart_upload(
        self,
        *,
        Bucket: str | None = None,
        Key: str,
        UploadId: str,
        MultipartUpload: Mapping[str, Any],
        IfNoneMatch: str | None = None,
        IfMatch: str | None = None,
        ChecksumCRC32C: str | None = None,
        ChecksumType: str | None = None,
    ) -> dict[str, Any]:
        del Bucket
        headers = {"content-type": "application/xml"}
        _opt(headers, "if-none-match", IfNoneMatch)
        _opt(headers, "if-match", IfMatch)
        _opt(headers, "x-amz-checksum-crc32c", ChecksumCRC32C)
        _opt(headers, "x-amz-checksum-type", ChecksumType)
        body = _completion(MultipartUpload.get("Parts", []))
        op = "CompleteMultipartUpload"
        # Not resent behind the caller's back: its retry must know, to tell a first attempt
        # that landed (the upload is then gone) from a failure.
        resp = await self._send(
            "POST",
            op,
            Key,
            headers,
            await self._payload_hash(body),
            body,
            {"uploadId": UploadId},
            resend=False,
        )
        _raise_for(resp, op)
        # S3 answers 200 before the work is done and may then report an error in the body;
        # botocore treats that as a server error (retried), and so does this.
        text = _result(resp, op)
        etag = _xml(text, "ETag")
        if not etag:
            raise _server_error(op, "the answer names no ETag")
        out: dict[str, Any] = {"ETag": etag}
        for name in ("ChecksumCRC32C", "ChecksumType"):
            value = _xml(text, name)
            if value:
                out[name] = value
        return out

    async def abort_multipart_upload(
        self, *, Bucket: str | None = None, Key: str, UploadId: str
    ) -> dict[str, Any]:
        del Bucket
        op = "AbortMultipartUpload"
        resp = await self._send("DELETE", op, Key, {}, EMPTY_SHA256, None, {"uploadId": UploadId})
        _raise_for(resp, op)
        return {}

    async def _payload_hash(self, body: Buffer | Pieces) -> str:
        """The payload hash to sign: the body's SHA-256 where payloads are signed (off the
        loop when big), else ``UNSIGNED-PAYLOAD``."""
        if not self.sign_payload:
            return "UNSIGNED-PAYLOAD"
        views = views_of(body)

        def digest() -> str:
            h = hashlib.sha256()
            for v in views:
                h.update(v)
            return h.hexdigest()

        if sum(v.nbytes for v in views) <= _INLINE:
            return digest()
        return await runtime.to_cpu(digest)

    async def get_object(
        self,
        *,
        Bucket: str | None = None,
        Key: str,
        Range: str | None = None,
        IfMatch: str | None = None,
        into: memoryview | None = None,
        sink: Sink | None = None,
    ) -> dict[str, Any]:
        """``into``: where a successful body that fits goes; ``sink``: where it streams to
        (see :meth:`.http1.Pool.request`); not botocore's parameters."""
        del Bucket
        headers: dict[str, str] = {}
        _opt(headers, "range", Range)
        _opt(headers, "if-match", IfMatch)
        resp = await self._send(
            "GET", "GetObject", Key, headers, EMPTY_SHA256, None, into=into, sink=sink
        )
        _raise_for(resp, "GetObject")
        out = _object_fields(resp.headers)
        out["Body"] = Body(list(resp.pieces), resp.nbytes)
        return out

    async def head_object(
        self,
        *,
        Bucket: str | None = None,
        Key: str,
        IfMatch: str | None = None,
        ChecksumMode: str | None = None,
    ) -> dict[str, Any]:
        del Bucket
        headers: dict[str, str] = {}
        _opt(headers, "if-match", IfMatch)
        _opt(headers, "x-amz-checksum-mode", ChecksumMode)
        resp = await self._send("HEAD", "HeadObject", Key, headers, EMPTY_SHA256, None)
        _raise_for(resp, "HeadObject")
        return _object_fields(resp.headers)

    async def list_objects_v2(
        self,
        *,
        Bucket: str | None = None,
        Prefix: str = "",
        MaxKeys: int = 1000,
        Delimiter: str | None = None,
        StartAfter: str | None = None,
        ContinuationToken: str | None = None,
    ) -> dict[str, Any]:
        del Bucket
        query = {"list-type": "2", "prefix": Prefix, "max-keys": str(MaxKeys)}
        query["encoding-type"] = "url"  # keys XML cannot carry come back escaped
        if Delimiter is not None:
            query["delimiter"] = Delimiter
        if StartAfter is not None:
            query["start-after"] = StartAfter
        if ContinuationToken is not None:
            query["continuation-token"] = ContinuationToken
        resp = await self._send("GET", "ListObjectsV2", "", {}, EMPTY_SHA256, None, query)
        _raise_for(resp, "ListObjectsV2")
        return _parse_listing(resp.body())

    # ---- signing and sending --------------------------------------------------------------

    async def _send(
        self,
        method: str,
        op: str,
        key: str,
        headers: dict[str, str],
        payload_hash: str,
        body: Buffer | Pieces | None,
        query: Mapping[str, str] | None = None,
        *,
        into: memoryview | None = None,
        sink: Sink | None = None,
        resend: bool = True,
    ) -> Response:
        path = self._prefix + quote(key, safe="/~")
        qs = canonical_query(query) if query else ""
        creds = await self._frozen()
        self.signer.sign(method, path, headers, payload_hash, creds, query=qs)
        target = f"{path}?{qs}" if qs else path
        return await self._pool.request(
            method, target, headers, body, into=into, sink=sink, resend=resend
        )

    async def _frozen(self) -> Credentials:
        creds = self.credentials()
        if hasattr(creds, "__await__"):
            creds = await creds
        if creds is None:
            raise bx.NoCredentialsError()
        if isinstance(creds, Credentials):
            return creds
        return Credentials(creds.access_key, creds.secret_key, getattr(creds, "token", None))


def _raise_for(resp: Response, op: str) -> None:
    """Raise botocore's ``ClientError`` for an error response (LeanUnsupported where the
    answer means botocore would have sent another request)."""
    status = resp.status
    if status < 300:
        return
    text = resp.body().decode("utf-8", "replace")
    code = _xml(text, "Code") or str(status)
    if status in (301, 307) or code in _FALLBACK_CODES:
        raise LeanUnsupported(f"{op}: HTTP {status} {code}")
    message = _xml(text, "Message") or resp.reason or ""
    raise bx.ClientError(
        {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": dict(resp.headers)},
        },
        op,
    )


def _server_error(op: str, message: str, code: str = "InternalError") -> bx.ClientError:
    """A 200 answer that is not the result it should be, as botocore reports one: a
    server error (HTTP 500), which the caller's retries retry."""
    return bx.ClientError(
        {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": 500, "HTTPHeaders": {}},
        },
        op,
    )


def _result(resp: Response, op: str) -> str:
    """A 200 answer's XML result; an ``<Error>`` document in its place raises as a server
    error."""
    text = resp.body().decode("utf-8", "replace")
    if re.match(r"\s*(<\?xml[^>]*>\s*)?<Error>", text):
        raise _server_error(op, _xml(text, "Message") or "", _xml(text, "Code") or "InternalError")
    return text


def _completion(parts: Any) -> bytes:
    """The CompleteMultipartUpload document for ``parts`` (botocore's ``Parts`` entries)."""
    from xml.sax.saxutils import escape

    out = ['<CompleteMultipartUpload xmlns="http://s3.amazonaws.com/doc/2006-03-01/">']
    for p in parts:
        out.append(f"<Part><PartNumber>{int(p['PartNumber'])}</PartNumber>")
        out.append(f"<ETag>{escape(str(p['ETag']))}</ETag>")
        if p.get("ChecksumCRC32C"):
            out.append(f"<ChecksumCRC32C>{escape(str(p['ChecksumCRC32C']))}</ChecksumCRC32C>")
        out.append("</Part>")
    out.append("</CompleteMultipartUpload>")
    return "".join(out).encode()


def _parse_listing(text: bytes) -> dict[str, Any]:
    """A ListObjectsV2 answer in botocore's shape.  Keys are URL-decoded only when the
    answer says it encoded them (``EncodingType`` ``url``): a server that ignores the
    request's ``encoding-type`` sends them raw, and decoding ``a+b`` there would name
    another key (which ``rm -r`` would then delete)."""
    root = ElementTree.fromstring(text)
    for el in root.iter():  # drop the S3 namespace from every tag
        el.tag = el.tag.rpartition("}")[2]
    encoded = (root.findtext("EncodingType") or "").strip().lower() == "url"

    def unquote_plus(k: str) -> str:
        return _unquote_plus(k) if encoded else k

    contents = []
    for c in root.iterfind("Contents"):
        lm = c.findtext("LastModified")
        contents.append(
            {
                "Key": unquote_plus(c.findtext("Key") or ""),
                "Size": int(c.findtext("Size") or 0),
                "ETag": c.findtext("ETag"),
                "LastModified": datetime.fromisoformat(lm.replace("Z", "+00:00")) if lm else None,
            }
        )
    out: dict[str, Any] = {
        "Contents": contents,
        "CommonPrefixes": [
            {"Prefix": unquote_plus(p.findtext("Prefix") or "")}
            for p in root.iterfind("CommonPrefixes")
        ],
        "IsTruncated": (root.findtext("IsTruncated") or "").lower() == "true",
    }
    token = root.findtext("NextContinuationToken")
    if token:
        out["NextContinuationToken"] = token
    return out


def _put_fields(resp: Response) -> dict[str, Any]:
    """The response fields of PutObject / UploadPart that fmstore reads, botocore-named."""
    out: dict[str, Any] = {"ETag": resp.headers.get("etag")}
    crc = resp.headers.get("x-amz-checksum-crc32c")
    if crc:
        out["ChecksumCRC32C"] = crc
    return out


def _new_object(
    metadata: Mapping[str, str] | None, sse: str | None, kms_key: str | None
) -> dict[str, str]:
    """The headers of a request that creates an object: its metadata and encryption."""
    headers = {_META + k.lower(): v for k, v in (metadata or {}).items()}
    _opt(headers, "x-amz-server-side-encryption", sse)
    _opt(headers, "x-amz-server-side-encryption-aws-kms-key-id", kms_key)
    return headers


def _opt(headers: dict[str, str], name: str, value: str | None) -> None:
    if value is not None:
        headers[name] = value


def _xml(text: str, tag: str) -> str | None:
    m = re.search(f"<{tag}>(.*?)</{tag}>", text, re.DOTALL)
    if m is None:
        return None
    import html  # error answers only

    return html.unescape(m.group(1))


def _object_fields(h: Mapping[str, str]) -> dict[str, Any]:
    """The response fields of GetObject / HeadObject that fmstore reads, botocore-named
    (``h``: header names lower-cased)."""
    out: dict[str, Any] = {
        "ETag": h.get("etag"),
        "ContentLength": int(h.get("content-length", 0)),
        "Metadata": {k[len(_META) :]: v for k, v in h.items() if k.startswith(_META)},
    }
    if "content-range" in h:
        out["ContentRange"] = h["content-range"]
    lm = h.get("last-modified")
    if lm:
        out["LastModified"] = _http_date(lm)
    crc = h.get("x-amz-checksum-crc32c")
    if crc:
        out["ChecksumCRC32C"] = crc
    kind = h.get("x-amz-checksum-type")
    if kind:
        out["ChecksumType"] = kind
    return out


@functools.lru_cache(maxsize=64)  # objects written together share their second
def _http_date(text: str) -> datetime | None:
    try:  # IMF-fixdate, what S3 sends: "Sun, 06 Nov 1994 08:49:37 GMT"
        _, day, month, year, hms, zone = text.split()
        h, m, sec = hms.split(":")
        if zone != "GMT":
            raise ValueError(zone)
        return datetime(
            int(year), _MONTHS[month], int(day), int(h), int(m), int(sec), tzinfo=timezone.utc
        )
    except (KeyError, ValueError):
        pass
    from email.utils import parsedate_to_datetime  # older forms; slow to import

    try:
        return parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None


_MONTHS = {
    m: i
    for i, m in enumerate(
        ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"], 1
    )
}
