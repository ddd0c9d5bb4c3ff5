from __future__ import annotations

import uuid

import fsspec
import pytest

from fmstore.stores import open_store
from fmstore.testing.store_tests import Backdoor, StoreConformance


class MemoryBackdoor(Backdoor):
    def __init__(self, root: str) -> None:
        self.fs = fsspec.filesystem("memory")
        self.root = root

    def read(self, key: str) -> bytes | None:
        try:
            return self.fs.cat_file(f"{self.root}/{key}")
        except FileNotFoundError:
            return None

    def keys(self) -> list[str]:
        try:
            found = self.fs.find(self.root)
        except FileNotFoundError:
            return []
        return sorted(p.lstrip("/")[len(self.root.lstrip("/")) + 1 :] for p in found)


class TestMemoryConformance(StoreConformance):
    @pytest.fixture
    def root(self):
        root = f"/conf-{uuid.uuid4().hex}"
        yield root
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)

    @pytest.fixture
    def store(self, root):
        return open_store(f"memory://{root}")

    @pytest.fixture
    def backdoor(self, root):
        return MemoryBackdoor(root)

    @pytest.mark.skip(reason="fsspec's memory file system keeps no per-object user metadata")
    def test_metadata_roundtrip(self, store):
        pass
