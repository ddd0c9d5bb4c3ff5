"""S3 decisions that need no server: what options print, and how a retried create-only put
recognises its own earlier attempt."""

from __future__ import annotations

import hashlib

from fmstore.stores.s3 import META_PUT_TOKEN, S3Options, etag_is_md5, landed_ours


def test_repr_of_options_hides_the_secret_key_and_session_token():
    o = S3Options(access_key="AKIAEXAMPLE", secret_key="s3cr3t-value", session_token="tok-value")
    text = repr(o)
    assert "s3cr3t-value" not in text and "tok-value" not in text
    assert "AKIAEXAMPLE" in text  # the key id names the identity; it is not a secret
    assert o.secret_key == "s3cr3t-value"


def test_under_sse_kms_a_retried_create_compares_its_token_not_the_etag():
    body = b"x" * 100
    md5 = hashlib.md5(body).hexdigest()
    assert etag_is_md5(None) and etag_is_md5("AES256")
    assert not etag_is_md5("aws:kms") and not etag_is_md5("aws:kms:dsse")
    # SSE-KMS: the ETag is opaque (not the MD5), so our own landed attempt is recognised by
    # its token, and another writer's object (same bytes, no token of ours) is not ours.
    ours = {"ETag": '"0f3a9c-opaque"', "Metadata": {META_PUT_TOKEN: "t1"}}
    theirs = {"ETag": f'"{md5}"', "Metadata": {META_PUT_TOKEN: "t2"}}
    assert landed_ours(ours, md5=None, token="t1")
    assert not landed_ours(theirs, md5=None, token="t1")
    assert not landed_ours({"ETag": '"x"'}, md5=None, token="t1")
    # Without KMS the ETag is the MD5 of the bytes.
    assert landed_ours({"ETag": f'"{md5}"'}, md5=md5, token=None)
    assert not landed_ours({"ETag": '"other"'}, md5=md5, token=None)
