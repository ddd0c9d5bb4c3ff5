"""The S3 suites' two servers, and the table of where they differ from AWS.

The S3 suites (the store conformance suite, the S3 transport tests, the location matrix's S3
cells) run against SeaweedFS and against moto's standalone ``moto_server``: a test module
says ``s3_server = both_s3_servers()``.  Where the two disagree, AWS's documented behaviour
decides what the test expects; a server that does otherwise has a row in
:data:`DIFFERENCES`, and a test skips a case on a server only through :func:`unlike_aws`,
which names the row.
"""

from __future__ import annotations

import pytest

#: The S3 implementations the S3 suites run against (fixtures ``<name>_server``).
S3_SERVERS = ("seaweed", "moto")

#: (server, case) -> what the server does where AWS does otherwise (or what it lacks).
#: Read with moto 5.2 and SeaweedFS 4.48.
DIFFERENCES: dict[tuple[str, str], str] = {
    # Identities: AWS refuses a bad signature (SignatureDoesNotMatch) and a policy's denial.
    ("moto", "wrong_credentials"): "accepts any signature (its IAM checks are off by default)",
    ("moto", "read_only_identity"): "has no identities: every key may write",
    # Checksums.  AWS: HeadObject with x-amz-checksum-mode answers a composite multipart
    # checksum as "<base64>-<parts>" with x-amz-checksum-type COMPOSITE (FULL_OBJECT: the
    # whole object's, no suffix); GetObjectAttributes lists each part's checksum; PutObject
    # keeps the x-amz-checksum-crc32c it was sent and refuses bytes that do not match it.
    ("moto", "head_composite_suffix"): (
        "HeadObject answers a composite checksum without its -<parts> and without "
        "x-amz-checksum-type (GetObject has both)"
    ),
    ("moto", "object_part_checksums"): "GetObjectAttributes answers no ObjectParts",
    ("seaweed", "object_part_checksums"): "GetObjectAttributes lists parts without checksums",
    # Conditional writes.  AWS checks If-None-Match and If-Match on PutObject and on
    # CompleteMultipartUpload (412 PreconditionFailed).
    (
        "moto",
        "if_match_on_complete",
    ): "CompleteMultipartUpload ignores If-Match (not If-None-Match)",
    # Not a difference, a cost: 256 MiB through moto's in-memory Python server takes 20-50 s;
    # moto meets the same multipart calls in the smaller cases of the suite.
    ("moto", "big_object_roundtrip"): "costs 20-50 s at 256 MiB (no behaviour differs)",
    ("moto", "cancelled_big_write"): "costs ~18 s of 40 MiB stalled parts (client-side only)",
    ("moto", "put_checksum_kept"): (
        "keeps a PutObject's x-amz-checksum-crc32c only when x-amz-sdk-checksum-algorithm "
        "names it too"
    ),
    ("moto", "checksum_verified"): (
        "never checks a PutObject's or UploadPart's x-amz-checksum-crc32c against the bytes "
        "(AWS answers BadDigest): flipped bytes are stored"
    ),
    # Uploads.  AWS's ListMultipartUploads gives each upload's Initiated time.
    ("moto", "upload_initiated"): (
        "answers a fixed Initiated (2010-11-10T20:48:33Z), so an upload begun by a lost "
        "attempt cannot be told from an older one"
    ),
}


#: Suites that run on SeaweedFS alone, and why: they check fmstore's layers above the
#: server (wrapper stores, the botocore transport's own conformance) with the same S3 calls
#: the two-server suites already make, and their 256 MiB and 1,050-object cases cost tens
#: of seconds on moto's in-memory Python server.
ONE_SERVER: dict[str, str] = {
    "TestS3BotocoreConformance": "the same calls as TestS3Conformance, through botocore",
    "TestReadThroughOverS3Conformance": "a wrapper store over TestS3Conformance's store",
    "TestS3PrefixConformance": "a prefix wrapper over TestS3Conformance's store",
}


def seaweed_only(name: str):
    """An ``s3_server`` fixture for a class of :data:`ONE_SERVER`: SeaweedFS alone."""
    assert name in ONE_SERVER, f"{name} runs on one server without a row in ONE_SERVER"

    @pytest.fixture(scope="class")
    def s3_server(self, seaweed_server):  # a method of the class it is set on
        return seaweed_server

    return s3_server


def both_s3_servers():
    """An ``s3_server`` fixture that runs each test of a module on every server."""

    @pytest.fixture(scope="module", params=S3_SERVERS)
    def s3_server(request):
        return request.getfixturevalue(f"{request.param}_server")

    return s3_server


def as_aws(server, case: str, aws, otherwise):
    """What a test expects: ``aws`` (AWS's documented answer), or ``otherwise`` where the
    table has a row for ``case`` on ``server``."""
    return otherwise if (server.name, case) in DIFFERENCES else aws


def like_aws(server, case: str) -> bool:
    """Whether ``server`` does ``case`` as AWS does (no row in the table)."""
    return (server.name, case) not in DIFFERENCES


def unlike_aws(server, case: str) -> None:
    """Skip ``case`` on ``server`` where the table says the server does not do what AWS
    does; a case without a row runs."""
    why = DIFFERENCES.get((server.name, case))
    if why is not None:
        pytest.skip(f"{server.name}: {why} ({case})")
