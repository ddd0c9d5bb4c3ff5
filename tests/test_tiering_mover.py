"""The checkpoint mover: verified copies committed last, corrupt sources never spread,
idempotent re-runs and deletions, POSIX and S3."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from tiering_helpers import state

import fmstore
from fmstore import runtime
from fmstore.checkpoint.layout import read_manifest_bytes
from fmstore.checkpoint.verify import blob_checksums, verify_checkpoint
from fmstore.errors import CorruptData, NotFound
from fmstore.format.manifest import MANIFEST_KEY
from fmstore.stores import open_store
from fmstore.tiering.exports.mover import (
    CHECKPOINT_COPY,
    copy_checkpoint,
    delete_checkpoint,
    has_checkpoint,
)


@pytest.fixture
def src(tmp_path):
    fmstore.save(state(1, n=200_000), str(tmp_path / "src"), chunk_size=1 << 18)
    s = open_store(str(tmp_path / "src"), tier="nvme")
    yield s
    runtime.run(s.close())


def flip_byte(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def blob_files(root) -> list[str]:
    return sorted(
        os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".bin")
    )


def test_copy_is_verified_and_commits_the_same_manifest(tmp_path, src):
    dst = open_store(str(tmp_path / "dst"), tier="lustre")
    res = runtime.run(copy_checkpoint(src, dst))
    assert not res.already_there and res.bytes_copied == res.manifest.stored_bytes
    a, _ = runtime.run(read_manifest_bytes(src))
    b, _ = runtime.run(read_manifest_bytes(dst))
    assert a == b
    assert runtime.run(verify_checkpoint(dst)).ok
    got = fmstore.load(str(tmp_path / "dst"))
    assert torch.equal(got["model"]["w"], state(1, n=200_000)["model"]["w"])


def test_a_copy_to_a_file_system_is_verified_by_the_checksum_of_the_bytes_written(tmp_path, src):
    dst = open_store(str(tmp_path / "dst"), tier="lustre")
    res = runtime.run(copy_checkpoint(src, dst))
    n = len(res.manifest.blobs)
    assert res.check is not None and res.check.ok
    assert res.check.by_written_checksum == n and res.check.read_back == 0
    # A copy found already there was not written by this run: it is read back.
    again = runtime.run(copy_checkpoint(src, dst))
    assert again.already_there and again.check is not None
    assert again.check.read_back == n and again.check.by_written_checksum == 0


def test_blob_checksums_combine_the_chunk_checksums(src):
    from fmstore.format.checksum import crc32c

    _, m = runtime.run(read_manifest_bytes(src))
    crcs = blob_checksums(m)
    for i, want in enumerate(crcs):
        assert want == crc32c(runtime.run(src.get(m.blob_key(i))))


def test_a_corrupt_source_is_never_committed_on_the_destination(tmp_path, src):
    flip_byte(blob_files(tmp_path / "src")[0], 1000)
    dst = open_store(str(tmp_path / "dst"), tier="lustre")
    with pytest.raises(CorruptData):
        runtime.run(copy_checkpoint(src, dst))
    assert not runtime.run(has_checkpoint(dst))
    res = runtime.run(verify_checkpoint(src))
    assert not res.ok and "fails its checksum" in res.problems[0]


def test_rerun_after_commit_is_a_no_op_and_a_damaged_destination_is_recopied(tmp_path, src):
    dst = open_store(str(tmp_path / "dst"), tier="lustre")
    runtime.run(copy_checkpoint(src, dst))
    again = runtime.run(copy_checkpoint(src, dst))
    assert again.already_there and again.bytes_copied == 0
    flip_byte(blob_files(tmp_path / "dst")[0], 5)
    fixed = runtime.run(
        copy_checkpoint(src, dst, options=dataclasses.replace(CHECKPOINT_COPY, concurrency=2))
    )
    assert not fixed.already_there
    assert runtime.run(verify_checkpoint(dst)).ok


def test_a_copy_without_its_manifest_is_not_a_checkpoint_and_resumes(tmp_path, src):
    dst = open_store(str(tmp_path / "dst"), tier="lustre")
    runtime.run(copy_checkpoint(src, dst))
    runtime.run(dst.delete(MANIFEST_KEY))  # as if killed just before the commit
    assert not runtime.run(has_checkpoint(dst))
    assert not runtime.run(verify_checkpoint(dst)).ok
    res = runtime.run(copy_checkpoint(src, dst, journal_path=str(tmp_path / "j.jsonl")))
    assert res.bytes_copied == 0  # every blob was recognised as already copied
    assert runtime.run(verify_checkpoint(dst)).ok


def test_delete_removes_the_manifest_first_and_is_idempotent(tmp_path, src):
    dst = open_store(str(tmp_path / "dst"), tier="lustre")
    runtime.run(copy_checkpoint(src, dst))
    assert runtime.run(delete_checkpoint(dst)) > 0
    assert runtime.run(delete_checkpoint(dst)) == 0
    assert not runtime.run(has_checkpoint(dst))
    assert blob_files(tmp_path / "dst") == []


def test_missing_source_is_not_found(tmp_path):
    empty = open_store(str(tmp_path / "nothing"), tier="nvme")
    with pytest.raises(NotFound, match="no checkpoint"):
        runtime.run(copy_checkpoint(empty, open_store(str(tmp_path / "d"))))


@pytest.mark.s3
def test_copy_to_s3_and_back(tmp_path, src, s3_store):
    up = s3_store.sub("ckpt")
    runtime.run(copy_checkpoint(src, up))
    assert runtime.run(verify_checkpoint(up)).ok
    back = open_store(str(tmp_path / "back"), tier="nvme")
    runtime.run(copy_checkpoint(up, back))
    got = fmstore.load(str(tmp_path / "back"))
    assert torch.equal(got["model"]["w"], state(1, n=200_000)["model"]["w"])
