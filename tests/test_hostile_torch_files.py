"""Hostile torch.save and safetensors files: zip archives whose members or central
directories disagree with what torch reads (listed twice, compressed, bytes around the
directory, a second directory), a FIFO or a link given as a file, and garbage given to
``ckpt convert``.  Each is built from a real file (written by torch or safetensors) and
refused with one fmstore error naming it, within a memory limit where the attack is an
allocation."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from hostile_helpers import LimitedCases, one_error_line
from stage_data import fm_here
from zip_support import deflated, inflating_bomb, listed_again, rezipped, torch_bytes

import fmstore
from fmstore.checkpoint.zipguard import check_torch_zip
from fmstore.errors import CorruptData

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


#: Hostile loads run under a memory limit, all of this module's in one fresh interpreter
#: (see ``hostile_helpers.LimitedCases``).
LIMITED = LimitedCases()


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """name -> (its directory, one result per ``report`` call) of every limited case."""
    return LIMITED.run(tmp_path_factory, inflating_bomb())


@pytest.fixture
def fm(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    return fm_here


def test_check_torch_zip_accepts_torch_save_output(tmp_path):
    data = torch_bytes({"a": torch.arange(10), "b": [1, "x"]})
    check_torch_zip(data, name="a.pt")
    (tmp_path / "a.pt").write_bytes(data)
    check_torch_zip(tmp_path / "a.pt", name="a.pt")
    with open(tmp_path / "a.pt", "rb") as f:
        f.seek(7)
        check_torch_zip(f, name="a.pt")
        assert f.tell() == 7


def test_check_torch_zip_refusals(tmp_path):
    good = torch_bytes(torch.arange(100))
    with pytest.raises(CorruptData, match="x.pt .*listed more than once"):
        check_torch_zip(listed_again(good, "data/0", 3), name="x.pt")
    with pytest.raises(CorruptData, match="compressed"):
        check_torch_zip(deflated(good), name="x.pt")
    with pytest.raises(CorruptData, match="not a zip archive"):
        check_torch_zip(pickle.dumps({"a": 1}), name="x.pt")
    with pytest.raises(CorruptData, match="no .*data.pkl"):
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            z.writestr("archive/other", b"x")
        check_torch_zip(out.getvalue(), name="x.pt")
    os.mkfifo(tmp_path / "fifo.pt")
    with pytest.raises(CorruptData, match="not a regular file"):
        check_torch_zip(tmp_path / "fifo.pt", name="fifo.pt")


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


@LIMITED.case
def _case_deflated_pt(d: Path, bomb: bytes) -> str:
    (d / "x.pt").write_bytes(bomb)
    return f"""
        from fmstore.checkpoint.convert import convert
        report(lambda: convert({str(d / "x.pt")!r}, {str(d / "y")!r}))
    """


def test_convert_of_a_deflated_pt_is_refused(limited):
    d, res = limited["deflated_pt"]
    assert res[0]["fmstore"] and res[0]["error"] == "CorruptData", res
    assert "x.pt" in res[0]["msg"] and "compressed" in res[0]["msg"]
    assert not (d / "y").exists()


def test_convert_of_garbage_files_is_one_error_line(tmp_path, fm):
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}")
    line = one_error_line(
        fm("ckpt", "convert", str(tmp_path / "bad.safetensors"), str(tmp_path / "out.pt"))
    )
    assert "bad.safetensors" in line
    (tmp_path / "bad.pt").write_bytes(pickle.dumps({"a": 1})[:-3])
    line = one_error_line(
        fm("ckpt", "convert", str(tmp_path / "bad.pt"), str(tmp_path / "out.safetensors"))
    )
    assert "bad.pt" in line
    # a zip archive that passes the member checks but whose pickle torch refuses
    arch = io.BytesIO()
    with zipfile.ZipFile(arch, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02cos\nsystem\nq\x00.")
    (tmp_path / "evil.pt").write_bytes(arch.getvalue())
    line = one_error_line(
        fm("ckpt", "convert", str(tmp_path / "evil.pt"), str(tmp_path / "out.safetensors"))
    )
    assert "evil.pt" in line
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "out.pt").exists()
