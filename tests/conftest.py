"""Shared fixtures: stores on every backend, the SeaweedFS server and the fault proxy."""

from __future__ import annotations

import uuid

import pytest

from fmstore import runtime
from fmstore.testing.seaweed import SeaweedServer


@pytest.fixture
def posix_root(tmp_path):
    root = tmp_path / "tier"
    root.mkdir()
    return str(root)


@pytest.fixture(scope="session")
def seaweed_server():
    """One real SeaweedFS S3 server for the whole test session."""
    with SeaweedServer() as server:
        yield server


@pytest.fixture(scope="session")
def moto_server():
    """The second S3 implementation: moto's standalone ``moto_server`` on loopback."""
    from fmstore.testing.motoserver import MotoServer

    with MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server(seaweed_server):
    """The S3 server of most tests: SeaweedFS.  The S3 suites (store conformance, transport,
    the location matrix's S3 cells) override it to run on both servers
    (``tests/s3_servers.py``)."""
    return seaweed_server


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket per test; removed (with any pending uploads) afterwards."""
    name = s3_server.create_bucket(f"t-{uuid.uuid4().hex[:20]}")
    yield name
    s3_server.delete_bucket(name)


@pytest.fixture
def s3_store(s3_server, s3_bucket):
    """An fmstore store for ``s3://BUCKET/prefix`` on the test server."""
    from fmstore.stores import open_store

    store = open_store(f"s3://{s3_bucket}/prefix", **s3_server.store_options())
    yield store
    runtime.run(store.close(), timeout=30)


@pytest.fixture
def fault_proxy(s3_server):
    """A fault-injecting proxy in front of the test server (no faults until a plan is set)."""
    from fmstore.testing.faultproxy import FaultProxy

    with FaultProxy(s3_server.endpoint_url) as proxy:
        yield proxy


@pytest.fixture
def posix_cfg(tmp_path, monkeypatch):
    """A config file with two POSIX tiers (``nvme``, ``lustre``) under ``tmp_path``, found
    through $FMSTORE_CONFIG (by spawned workers too)."""
    from fmstore import config as fm_config

    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
        f'[tiers.lustre]\nurl = "{tmp_path / "lustre"}"\n'
    )
    monkeypatch.setenv("FMSTORE_CONFIG", str(cfg))
    fm_config.set_config(None)
    yield cfg
    fm_config.set_config(None)
