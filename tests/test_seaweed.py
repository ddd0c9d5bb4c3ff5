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


def test_the_server_holds_more_live_buckets_than_its_disk_has_gigabytes():
    # Its volume slots once came from the free disk (1 GiB each) and every bucket that
    # receives data takes 7: a disk with 80 GB free held 11 buckets (20 need 140 GB), and every put after
    # that failed with HTTP 500 (a whole test run's S3 tests, once).
    with seaweed.SeaweedServer() as server:
        client = server.boto3_client()
        names = [server.create_bucket(f"live-{i:02d}") for i in range(20)]
        for name in names:
            client.put_object(Bucket=name, Key="k", Body=b"x")
        for name in names:
            assert client.get_object(Bucket=name, Key="k")["Body"].read() == b"x"
