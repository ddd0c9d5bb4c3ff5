"""A read that fails is no verdict (I2/I5 of docs/distributed.md): a committed copy whose
blob cannot be read (permission denied, an outage) is neither called bad nor deleted and
copied again; the error is raised and the caller retries later.  Only what is proven
(missing, wrong size, bad checksum) is bad."""

from __future__ import annotations

import os

import pytest
from parts_support import NODES, ROOT, save_parts

from fmstore import runtime
from fmstore.checkpoint.dcp.manifest import DcpManifest
from fmstore.checkpoint.dcp.nodes import NODE_ENV
from fmstore.checkpoint.layout import checkpoint_key
from fmstore.checkpoint.verify import verify_checkpoint
from fmstore.errors import PermissionDenied, StoreUnavailable
from fmstore.format.manifest import MANIFEST_KEY
from fmstore.protocol.env import Env
from fmstore.stores import open_store
from fmstore.stores.base import PrefixStore
from fmstore.tiering.exports.mover import CHECKPOINT_COPY
from fmstore.tiering.exports.parts import export_part


class FailReads(PrefixStore):
    """``inner`` under ``prefix``; a ranged read of ``key`` fails with ``error`` (what a
    POSIX tier answers for EACCES, an S3 one for AccessDenied or an outage)."""

    def __init__(self, inner, prefix: str, key: str, error: Exception) -> None:
        super().__init__(inner, prefix)
        self.key, self.error = key, error

    async def get_range(self, key, start, end=None):
        if key == self.key:
            raise self.error
        return await super().get_range(key, start, end)


def _committed(tmp_path, monkeypatch) -> DcpManifest:
    m = DcpManifest.loads(save_parts(tmp_path, 10))
    dst = open_store(str(tmp_path / "lustre" / checkpoint_key(ROOT, 10)))
    for node in NODES:
        monkeypatch.setenv(NODE_ENV, node)
        src = open_store(str(tmp_path / node / "nvme" / checkpoint_key(ROOT, 10)))
        runtime.run(export_part(src, dst, node, options=CHECKPOINT_COPY, env=Env()))
    return m


@pytest.mark.parametrize(
    "error",
    [
        PermissionDenied("permission denied", tier="lustre", key="b"),
        StoreUnavailable("I/O error: Input/output error", tier="lustre", key="b"),
    ],
    ids=["permission", "io-error"],
)
def test_an_unreadable_blob_of_a_committed_copy_is_never_deleted_nor_copied_again(
    tmp_path, monkeypatch, error
):
    m = _committed(tmp_path, monkeypatch)
    key = checkpoint_key(ROOT, 10)
    manifest = tmp_path / "lustre" / key / MANIFEST_KEY
    before = os.stat(manifest).st_ino
    blob = m.blob_key(0)  # rank 0, saved on n0
    dst = FailReads(open_store(str(tmp_path / "lustre")), key, blob, error)
    src = open_store(str(tmp_path / "n0" / "nvme" / key))
    monkeypatch.setenv(NODE_ENV, "n0")
    with pytest.raises(type(error)):
        runtime.run(export_part(src, dst, "n0", options=CHECKPOINT_COPY, env=Env()))
    with pytest.raises(type(error)):
        runtime.run(verify_checkpoint(dst))
    assert os.stat(manifest).st_ino == before  # the commit was never taken back
    assert runtime.run(verify_checkpoint(open_store(str(tmp_path / "lustre" / key)))).ok
