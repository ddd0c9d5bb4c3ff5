"""Shared fixtures: stores on every backend, the SeaweedFS server and the fault proxy."""

from __future__ import annotations

import pytest


@pytest.fixture
def posix_root(tmp_path):
    root = tmp_path / "tier"
    root.mkdir()
    return str(root)
