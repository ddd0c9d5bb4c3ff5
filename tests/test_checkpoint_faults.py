"""Bad input and faults: corrupt chunks, bad manifests, newer versions, missing
checkpoints, a full disk mid-save."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
import torch

import fmstore
from fmstore.errors import CorruptData, NotFound, TierFull, VersionError
from fmstore.format.manifest import Manifest


def _save(path, **kw):
    state = {"model": {"w": torch.randn(50_000), "b": torch.randn(100)}, "step": 1}
    m = fmstore.save(state, path, **kw)
    return state, m


@pytest.mark.parametrize("compression", ["raw", "auto"])
def test_corrupt_chunk_names_tensor_blob_and_store(tmp_path, compression):
    _, m = _save(tmp_path / "c", compression=compression)
    w = m.tensors[[t.name for t in m.tensors].index("model.w")]
    chunk = m.storages[w.storage].chunks[0]
    blob = tmp_path / "c" / m.generation / m.blobs[chunk.blob].name
    data = bytearray(blob.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0x40
    blob.write_bytes(bytes(data))
    with pytest.raises(CorruptData) as ei:
        fmstore.load(tmp_path / "c")
    msg = str(ei.value)
    assert "model.w" in msg and m.blobs[chunk.blob].name in msg and "tier file" in msg
    with pytest.raises(CorruptData):
        fmstore.load(tmp_path / "c", mmap=True)
    # A partial load of an intact tensor in another chunk still works... if it is elsewhere.
    assert fmstore.load(tmp_path / "c", keys="step") == {"step": 1}


def test_truncated_blob_is_corrupt_data(tmp_path):
    _, m = _save(tmp_path / "c", compression="raw")
    blob = tmp_path / "c" / m.generation / m.blobs[0].name
    blob.write_bytes(blob.read_bytes()[:1000])
    with pytest.raises(CorruptData):
        fmstore.load(tmp_path / "c")


def test_truncated_manifest_is_not_a_valid_checkpoint(tmp_path):
    _save(tmp_path / "c")
    p = tmp_path / "c" / "manifest.json"
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    with pytest.raises(CorruptData, match="not a valid checkpoint"):
        fmstore.load(tmp_path / "c")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00\xffgarbage",
        b"[1, 2]",
        b'{"format": "something-else", "version": 1}',
        b'{"format": "fmstore-checkpoint", "version": 1, "tree": null}',
    ],
    ids=["empty", "binary", "json-list", "other-format", "missing-fields"],
)
def test_garbled_manifest_is_not_a_valid_checkpoint(tmp_path, content):
    _save(tmp_path / "c")
    (tmp_path / "c" / "manifest.json").write_bytes(content)
    with pytest.raises(CorruptData, match="not a valid checkpoint"):
        fmstore.load(tmp_path / "c")


def test_manifest_with_out_of_range_indices_is_rejected(tmp_path):
    _save(tmp_path / "c")
    p = tmp_path / "c" / "manifest.json"
    d = json.loads(p.read_bytes())
    d["tensors"][0]["storage"] = 99
    p.write_text(json.dumps(d))
    with pytest.raises(CorruptData, match="not a valid checkpoint"):
        fmstore.load(tmp_path / "c")


def test_newer_format_version_is_a_clear_version_error(tmp_path):
    _save(tmp_path / "c")
    p = tmp_path / "c" / "manifest.json"
    d = json.loads(p.read_bytes())
    d["version"] = 99
    p.write_text(json.dumps(d))
    with pytest.raises(VersionError, match="version 99.*upgrade fmstore"):
        fmstore.load(tmp_path / "c")


def test_uri_without_checkpoint_is_not_found_and_creates_nothing(tmp_path):
    with pytest.raises(NotFound, match="no checkpoint"):
        fmstore.load(tmp_path / "absent")
    assert not (tmp_path / "absent").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFound, match="no checkpoint"):
        fmstore.load(tmp_path / "empty")
    with pytest.raises(NotFound):
        fmstore.load(f"memory://nothing-{uuid.uuid4().hex}/x")


def test_blobs_without_manifest_are_not_a_checkpoint(tmp_path):
    _, m = _save(tmp_path / "c")
    (tmp_path / "c" / "manifest.json").unlink()
    with pytest.raises(NotFound):
        fmstore.load(tmp_path / "c")
    assert fmstore.checkpoint.find_checkpoints(str(tmp_path)) == []


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_mid_save_raises_and_leaves_nothing(tiny_tmpfs):
    state = {f"t{i}": torch.randn(256 << 10) for i in range(8)}  # 8 MiB into 4 MiB
    with pytest.raises(TierFull):
        fmstore.save(state, tiny_tmpfs / "c", compression="raw", blob_size=1 << 20)
    left = [os.path.join(d, f) for d, _, fs in os.walk(tiny_tmpfs) for f in fs]
    assert left == []
    with pytest.raises(NotFound):
        fmstore.load(tiny_tmpfs / "c")
    # The tier is usable again once there is room.
    fmstore.save({"t": torch.ones(10)}, tiny_tmpfs / "d")
    assert torch.equal(fmstore.load(tiny_tmpfs / "d")["t"], torch.ones(10))


def test_failed_save_keeps_the_previous_checkpoint(tiny_tmpfs):
    fmstore.save({"v": torch.ones(1000)}, tiny_tmpfs / "c")
    with pytest.raises(TierFull):
        fmstore.save(
            {"v": torch.randn(2 << 20)}, tiny_tmpfs / "c", overwrite=True, compression="raw"
        )
    assert torch.equal(fmstore.load(tiny_tmpfs / "c")["v"], torch.ones(1000))
    m = Manifest.loads((tiny_tmpfs / "c" / "manifest.json").read_bytes())
    assert sorted(os.listdir(tiny_tmpfs / "c")) == sorted(["manifest.json", m.generation])
