"""The AWS configuration a user already has: a plain ``s3://bucket/prefix`` finds its
endpoint and addressing style where boto3 would (``AWS_ENDPOINT_URL_S3``,
``AWS_ENDPOINT_URL``, the profile of ``AWS_PROFILE`` in ``AWS_CONFIG_FILE``) and in ``[s3]``
of fmstore.toml; the lean transport sends to exactly the URL botocore resolved; a host name
that does not resolve fails at once; a dead endpoint's retries are said after the first
failed attempt."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from s3_servers import both_s3_servers

from fmstore import runtime
from fmstore.errors import ConfigError, StoreUnavailable
from fmstore.stores import open_store
from fmstore.stores.s3 import S3Options

s3_server = both_s3_servers()

BAD_HOST = "no-such-host.invalid"
BAD = f"http://{BAD_HOST}:9000"
#: Variables of the test's own environment that would decide for the CLI under test.
_AWS_VARS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)


@pytest.fixture
def listed(s3_server, s3_bucket):
    """A bucket holding ``x/a.txt`` and ``x/b.txt``."""
    client = s3_server.boto3_client()
    for name in ("a.txt", "b.txt"):
        client.put_object(Bucket=s3_bucket, Key=f"x/{name}", Body=b"hello")
    return s3_bucket


def fm_clean(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``fmstore *args`` in a subprocess whose AWS and fmstore settings are ``env`` only
    (no AWS_* of the test's environment, no ~/.aws, an empty fmstore.toml unless given)."""
    base = {k: v for k, v in os.environ.items() if k not in _AWS_VARS}
    base = {k: v for k, v in base.items() if not k.startswith("FMSTORE")}
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    base.update(
        {
            "HOME": str(tmp_path),
            "FMSTORE_HOME": str(tmp_path / "home"),
            "FMSTORE_CONFIG": str(empty),
            "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
    )
    base.update(env)
    return subprocess.run(
        [sys.executable, "-m", "fmstore", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=base,
        cwd=tmp_path,
    )


def aws_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "aws-config"
    path.write_text(text)
    return str(path)


def keys(s3_server) -> str:
    return f"aws_access_key_id = {s3_server.access_key}\naws_secret_access_key = {s3_server.secret_key}\n"


def env_keys(s3_server) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": s3_server.region,
    }


def assert_listed(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stderr
    assert "a.txt" in r.stdout and "b.txt" in r.stdout, r.stdout


# ---- the AWS config file -----------------------------------------------------------------


def test_a_profiles_endpoint_url_serves_fmstore_ls(s3_server, listed, tmp_path):
    """The issue's case: the endpoint only in the profile that AWS_PROFILE names.  The
    endpoint is an IP address, so botocore's ``auto`` addresses it by path."""
    cfg = aws_config(
        tmp_path,
        f"[profile p]\nregion = {s3_server.region}\nendpoint_url = {s3_server.endpoint_url}\n"
        + keys(s3_server),
    )
    r = fm_clean(
        tmp_path, "ls", f"s3://{listed}/x", env={"AWS_CONFIG_FILE": cfg, "AWS_PROFILE": "p"}
    )
    assert_listed(r)


def test_a_profiles_services_section_and_s3_addressing_style(s3_server, listed, tmp_path):
    """The service-specific form (``services = NAME`` and ``[services NAME] s3 =
    endpoint_url``) with the profile's nested ``s3 = addressing_style = path``; the
    default profile is used when AWS_PROFILE names none."""
    cfg = aws_config(
        tmp_path,
        f"[default]\nregion = {s3_server.region}\n"
        + keys(s3_server)
        + "services = local\ns3 =\n  addressing_style = path\n"
        + f"[services local]\ns3 =\n  endpoint_url = {s3_server.endpoint_url}\n",
    )
    r = fm_clean(tmp_path, "ls", f"s3://{listed}/x", env={"AWS_CONFIG_FILE": cfg})
    assert_listed(r)


def test_the_lean_transport_sends_where_botocore_resolved(s3_server, listed, tmp_path, monkeypatch):
    """In process: the profile's endpoint and addressing style reach the lean transport
    (it serves, with the bucket in the path on the profile's endpoint)."""
    host = s3_server.endpoint_url.split("://", 1)[1]
    # "localhost": botocore's ``auto`` would put the bucket in the host name; the
    # profile's ``addressing_style = path`` must win, on both transports.
    endpoint = s3_server.endpoint_url.replace("127.0.0.1", "localhost")
    cfg = aws_config(
        tmp_path,
        f"[profile lean]\nregion = {s3_server.region}\nendpoint_url = {endpoint}\n"
        + keys(s3_server)
        + "s3 =\n  addressing_style = path\n",
    )
    for var in _AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", cfg)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    store = open_store(f"s3://{listed}/x", metered=False, profile="lean")
    try:
        got = sorted(runtime.run(_keys(store)))
        assert got == ["a.txt", "b.txt"]
        lean = store._http
        assert lean is not None, "the lean transport should serve the profile's endpoint"
        assert lean.host == host.replace("127.0.0.1", "localhost")
        assert lean._prefix == f"/{listed}/"
    finally:
        runtime.run(store.close())


async def _keys(store) -> list[str]:
    return [e.key async for e in store.list("")]


# ---- environment variables ---------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoints",
    [
        pytest.param({"AWS_ENDPOINT_URL": "GOOD"}, id="AWS_ENDPOINT_URL"),
        pytest.param({"AWS_ENDPOINT_URL_S3": "GOOD"}, id="AWS_ENDPOINT_URL_S3"),
        pytest.param(
            {"AWS_ENDPOINT_URL": BAD, "AWS_ENDPOINT_URL_S3": "GOOD"}, id="the-S3-one-wins"
        ),
    ],
)
def test_endpoint_variables(s3_server, listed, tmp_path, endpoints):
    env = {k: s3_server.endpoint_url if v == "GOOD" else v for k, v in endpoints.items()}
    r = fm_clean(tmp_path, "ls", f"s3://{listed}/x", env={**env_keys(s3_server), **env})
    assert_listed(r)


def test_an_endpoint_variable_beats_the_profiles(s3_server, listed, tmp_path):
    """botocore's order: AWS_ENDPOINT_URL* before the config file."""
    cfg = aws_config(
        tmp_path,
        f"[profile p]\nregion = {s3_server.region}\nendpoint_url = {BAD}\n" + keys(s3_server),
    )
    env = {"AWS_CONFIG_FILE": cfg, "AWS_PROFILE": "p", "AWS_ENDPOINT_URL": s3_server.endpoint_url}
    assert_listed(fm_clean(tmp_path, "ls", f"s3://{listed}/x", env=env))


# ---- fmstore.toml ------------------------------------------------------------------------


def test_the_s3_section_of_fmstore_toml(s3_server, listed, tmp_path):
    """``[s3]`` serves a plain s3:// URL and beats the environment; a tier's own options
    beat ``[s3]``."""
    toml = tmp_path / "fmstore.toml"
    toml.write_text(
        f'[s3]\nendpoint_url = "{s3_server.endpoint_url}"\naddressing_style = "path"\n'
        f'region = "{s3_server.region}"\n\n'
        f'[tiers.far]\nurl = "s3://{listed}/x"\nendpoint_url = "{BAD}"\n\n'
        f'[tiers.near]\nurl = "s3://{listed}"\n'
    )
    env = {**env_keys(s3_server), "FMSTORE_CONFIG": str(toml), "AWS_ENDPOINT_URL_S3": BAD}
    assert_listed(fm_clean(tmp_path, "ls", f"s3://{listed}/x", env=env))
    assert_listed(fm_clean(tmp_path, "ls", "near:x", env=env))
    r = fm_clean(tmp_path, "ls", "far:", env=env)
    assert r.returncode != 0 and BAD_HOST in r.stderr, r.stderr


def test_addressing_style_is_checked():
    with pytest.raises(ConfigError, match="addressing_style"):
        S3Options(addressing_style="pathy")  # type: ignore[arg-type]


# ---- an endpoint that does not resolve ---------------------------------------------------


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "botocore"])
def test_an_unresolvable_host_fails_at_once(s3_server, lean):
    """One attempt, no retry counted, and an error that names the host."""
    from fmstore.metrics import STORE_RETRIES

    tier = f"dns-{uuid.uuid4().hex[:8]}"
    store = open_store(
        "s3://some-bucket/x",
        tier=tier,
        metered=False,
        endpoint_url=BAD,
        region="us-east-1",
        access_key="AKIDEXAMPLE",
        secret_key="secret",
        lean_requests=lean,
    )
    calls = []
    try:
        transport = runtime.run(store._objects())
        real = transport.list_objects_v2

        async def counted(**kw):
            calls.append(kw)
            return await real(**kw)

        transport.list_objects_v2 = counted  # type: ignore[method-assign]
        with pytest.raises(StoreUnavailable) as err:
            runtime.run(_keys(store))
    finally:
        runtime.run(store.close())
    assert BAD_HOST in str(err.value) and "attempts" not in str(err.value)
    assert len(calls) == 1
    retried = sum(
        s.value
        for m in STORE_RETRIES.collect()
        for s in m.samples
        if s.labels.get("tier") == tier and s.name.endswith("_total")
    )
    assert retried == 0


def test_an_unresolvable_endpoint_from_the_environment_on_the_cli(tmp_path):
    r = fm_clean(
        tmp_path,
        "ls",
        "s3://some-bucket/x",
        env={
            "AWS_ENDPOINT_URL": BAD,
            "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
            "AWS_SECRET_ACCESS_KEY": "secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        },
    )
    assert r.returncode != 0
    assert BAD_HOST in r.stderr and "not retried" in r.stderr and "attempts" not in r.stderr
    assert r.stderr.count("error:") == 1


# ---- botocore's rules, no server ---------------------------------------------------------


@pytest.mark.parametrize(
    "options, want",
    [
        ({}, ("https://s3.us-west-2.amazonaws.com", False)),
        ({"addressing_style": "path"}, ("https://s3.us-west-2.amazonaws.com", True)),
        ({"endpoint_url": "http://10.0.0.1:9000"}, ("http://10.0.0.1:9000", True)),
        (
            {"endpoint_url": "http://minio.local:9000", "addressing_style": "virtual"},
            ("http://minio.local:9000", False),
        ),
    ],
)
def test_the_bucket_url_is_botocores(options, want, tmp_path, monkeypatch):
    from contextlib import AsyncExitStack

    from fmstore.stores.s3.client import create_client, resolve_bucket_url

    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    o = S3Options(region="us-west-2", access_key="AKIDEXAMPLE", secret_key="s", **options)

    async def resolve():
        async with AsyncExitStack() as stack:
            client = await create_client(o, stack)
            return await resolve_bucket_url(client, "my-bucket")

    endpoint, path_style, region = runtime.run(resolve())
    assert (endpoint, path_style) == want and region == "us-west-2"


def test_a_dead_endpoint_says_what_is_retried_after_the_first_failed_attempt(tmp_path):
    import socket

    from stage_data import fm

    with socket.socket() as dead:  # bound, never listening: every connection is refused
        dead.bind(("127.0.0.1", 0))
        port = dead.getsockname()[1]
        cfg = tmp_path / "fmstore.toml"
        cfg.write_text(
            f'[tiers.s3]\nurl = "s3://bucket/ds"\nendpoint_url = "http://127.0.0.1:{port}"\n'
            'region = "us-east-1"\nmax_attempts = 2\n'
        )
        env = {"FMSTORE_CONFIG": str(cfg), "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
        r = fm("ls", "s3:x", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    retry = [i for i, line in enumerate(lines) if "retrying, up to 2 attempts" in line]
    assert len(retry) == 1 and "tier s3" in lines[retry[0]], r.stderr
    assert "connection" in lines[retry[0]] and retry[0] < len(lines) - 1  # before the error
