"""Options, limits and URLs of the S3 backend: :class:`S3Options`, the part-size rules and
``s3://bucket/prefix`` parsing.  Nothing here talks to S3."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from ... import keys as _keys
from ...errors import ConfigError

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


@dataclass(frozen=True)
class S3Options:
    """How an :class:`S3Store` talks to S3.

    Credentials come from ``access_key`` / ``secret_key`` (/ ``session_token``) when given,
    else from botocore's usual chain (``AWS_*`` variables, ``profile``, instance role).
    ``endpoint_url`` / ``region`` left unset are botocore's to resolve, as boto3 does
    (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the profile's ``services`` section or
    ``endpoint_url``).  ``addressing_style`` left unset is the profile's ``s3 =
    addressing_style``, else ``path`` when ``endpoint_url`` is set here (SeaweedFS, MinIO),
    else botocore's ``auto``; the lean transport uses the URL botocore's rules give.  ``max_concurrency`` caps requests in flight per store
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
    a time.  ``lean_requests``: send PutObject, UploadPart, GetObject, HeadObject, listings
    and the start, completion and abort of multipart uploads through fmstore's own signer
    and HTTP/1.1 client (:mod:`.lean`, a tenth of botocore's CPU per request);
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
        if self.addressing_style not in (None, "auto", "path", "virtual"):
            raise ConfigError(
                f"S3 addressing_style must be path, virtual or auto, not {self.addressing_style!r}"
            )
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


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` → ``("bucket", "some/prefix/")``."""
    m = re.match(r"^s3a?://([^/]+)/?(.*)$", url)
    if not m or not m.group(1):
        raise ConfigError(f"not an S3 URL (s3://bucket/prefix): {url!r}")
    bucket, prefix = m.group(1), m.group(2)
    if not re.match(r"^[a-zA-Z0-9][a-zA-Z0-9._-]{1,254}$", bucket):
        raise ConfigError(f"invalid S3 bucket name {bucket!r} in {url!r}")
    return bucket, _keys.validate_prefix(prefix, tier="s3") if prefix.strip("/") else ""
