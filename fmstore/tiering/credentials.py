"""Which S3 credentials a process signs with, as a digest (never the secret itself).

The tier probe's per-node result (:mod:`.probe`) stands only for processes that would
sign with the same keys.  The keys are resolved the way botocore's chain starts, without
a request: a tier's own ``access_key`` / ``secret_key`` (or ``[s3]``'s), else
``$AWS_ACCESS_KEY_ID`` / ``$AWS_SECRET_ACCESS_KEY`` (skipped, as botocore does, where the
options name a ``profile``), else the profile's keys in the shared credentials file, then
in the config file.  Keys that come from elsewhere (SSO, a credential process, a role)
are not read; the digest then covers where they would come from: the profile, its section
of the config file and the variables that point botocore at them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

from ..config import Config
from ..stores import Location

__all__ = ["credentials_digest", "resolved_keys"]

#: Variables that point botocore's later providers at credentials (their values only
#: name where the keys are, or are the keys of a container role).
_SOURCE_VARS = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
)


def _section(path_var: str, default: str, name: str, *, config_file: bool) -> dict[str, Any]:
    path = os.path.expanduser(os.environ.get(path_var) or default)
    if not os.path.isfile(path):
        return {}
    from botocore.configloader import load_config, raw_config_parse

    try:
        if config_file:
            got = load_config(path).get("profiles", {}).get(name, {})
        else:
            got = raw_config_parse(path).get(name, {})
    except Exception:  # botocore reports a broken file when it reads it
        return {}
    return dict(got) if isinstance(got, Mapping) else {}


def resolved_keys(options: Mapping[str, Any]) -> tuple[str, str] | str:
    """``(access key id, secret)`` an S3 store with ``options`` signs with where they can be
    read without a request; else a description of where they would come from."""
    if options.get("access_key") or options.get("secret_key"):
        return str(options.get("access_key") or ""), str(options.get("secret_key") or "")
    env = os.environ
    profile = options.get("profile")
    if not profile and env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    name = str(profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default")
    creds = _section("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials", name, config_file=False)
    conf = _section("AWS_CONFIG_FILE", "~/.aws/config", name, config_file=True)
    for found in (creds, conf):
        if found.get("aws_access_key_id") and found.get("aws_secret_access_key"):
            return str(found["aws_access_key_id"]), str(found["aws_secret_access_key"])
    sources = {v: env.get(v, "") for v in _SOURCE_VARS}
    return repr(["profile", name, sorted(map(str, conf.items())), sorted(sources.items())])


def credentials_digest(config: Config, tier: str) -> str | None:
    """SHA-256 (hex) of the credentials S3 tier ``tier`` resolves to in this process
    (:func:`resolved_keys`); None for any other kind of tier."""
    loc = Location.parse(config.tier(tier).url, config)
    if loc.scheme != "s3":
        return None
    keys = resolved_keys(loc.options)
    text = "\0".join(keys) if isinstance(keys, tuple) else keys
    return hashlib.sha256(text.encode()).hexdigest()
