"""The SeaweedFS launcher that the tests, the benchmarks and the demo share."""

from __future__ import annotations

from fmstore.testing import seaweed


def test_aws_credentials_in_the_environment_do_not_replace_the_servers_keys(monkeypatch):
    # What a process has after pointing an AWS SDK at an earlier server (s3torchconnector
    # takes its credentials from the environment): the same access key, another secret.
    # SeaweedFS adopts such variables as an identity over its config's.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fmstore-admin")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-secret-of-an-earlier-server")
    with seaweed.SeaweedServer() as server:
        client = server.boto3_client()
        client.create_bucket(Bucket="launcher-env")
        client.put_object(Bucket="launcher-env", Key="k", Body=b"payload")
        assert client.get_object(Bucket="launcher-env", Key="k")["Body"].read() == b"payload"
        reader = server.boto3_client(readonly=True)
        assert reader.get_object(Bucket="launcher-env", Key="k")["Body"].read() == b"payload"
