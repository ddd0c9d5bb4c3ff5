"""Hostile input, fourth round: zip archives with two central directories, unbounded
records, leases that never expire, replica manifests, node names, and peers' sizes.

Each test builds the hostile input from a real one (written by torch or fmstore itself)
and checks that fmstore refuses it with one fmstore error naming it.
"""

from __future__ import annotations

import io
import os
import zipfile

import pytest
import torch

import fmstore
from fmstore.checkpoint.zipguard import check_torch_zip
from fmstore.errors import CorruptData


def torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ---- 1. zip archives: the directory zipfile finds and the one torch reads ------------------


def rezipped(data: bytes) -> bytes:
    """The same archive written by Python's zipfile: stored members, no zip64 records."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return out.getvalue()


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("before", "two different directories"),
        ("before zip64", "no zip64 end record"),
        ("after", "64 bytes after its end record"),
    ],
)
def test_zip_with_bytes_around_its_directory_is_refused(tmp_path, where, why):
    good = torch_bytes({"w": torch.arange(100)})
    extra = b"PK\x03\x04" + bytes(60)
    if where == "before":
        data = extra + rezipped(good)
    else:
        data = extra + good if where == "before zip64" else good + extra
    # zipfile (the check's parser) reads either file, with the directory it finds at the end
    # record's position less its size; torch reads at the offset the end record declares
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.testzip() is None
    with pytest.raises(CorruptData, match=f"x.pt .*{why}"):
        check_torch_zip(data, name="x.pt")
    (tmp_path / "x.pt").write_bytes(data)
    with pytest.raises(CorruptData, match=why):
        fmstore.load(str(tmp_path / "x.pt"))


def test_torch_file_is_opened_once_without_following_a_link(tmp_path):
    (tmp_path / "real.pt").write_bytes(torch_bytes({"w": torch.arange(7)}))
    os.symlink(tmp_path / "real.pt", tmp_path / "link.pt")
    with pytest.raises(CorruptData, match="link.pt is a symbolic link"):
        fmstore.load(str(tmp_path / "link.pt"))
    out = fmstore.load(str(tmp_path / "real.pt"))
    assert torch.equal(out["w"], torch.arange(7))
