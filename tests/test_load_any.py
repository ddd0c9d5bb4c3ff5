"""``fmstore.load`` opens every checkpoint a user has: an fmstore checkpoint, a DCP
checkpoint written by fmstore's Writer or by torch's FileSystemWriter (shards assembled
whole), and a plain ``torch.save`` file (through the zip guard, ``weights_only`` kept);
``fmstore.save`` to a ``.pt``-like name warns that the result is a directory."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fmstore
from fmstore.checkpoint.api import TorchSuffixWarning
from fmstore.checkpoint.dcp import Writer
from fmstore.checkpoint.devring import route_cpu
from fmstore.errors import CorruptData


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(64, 128, generator=g), "b": torch.arange(10, dtype=torch.int32)}


def _dcp_save(sd: dict[str, torch.Tensor], **kw: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, no_dist=True, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_checkpoint_of_fmstores_dcp_writer_loads_whole(tmp_path, compression):
    sd = _sd()
    uri = str(tmp_path / "dcp")
    _dcp_save(sd, storage_writer=Writer(uri, compression=compression, chunk_size=8 << 10))
    with route_cpu(slots=2, slot_bytes=8 << 10) as rec:
        out = fmstore.load(uri, map_location="cpu")
    assert out.keys() == sd.keys()
    for k in sd:
        assert torch.equal(out[k], sd[k])
    # Once through the ring: the Reader fills tensors allocated on map_location's device
    # (a load assembled on the host and then moved would pass twice).
    assert sum(n for _, n in rec.uses) == sum(v.nbytes for v in sd.values())


def test_native_dcp_directory_still_loads(tmp_path):
    sd = _sd()
    path = str(tmp_path / "native")
    _dcp_save(sd, storage_writer=dcp.FileSystemWriter(path))
    out = fmstore.load(path)
    for k in sd:
        assert torch.equal(out[k], sd[k])


def test_torch_save_file_loads_with_keys_and_keeps_ties(tmp_path):
    sd = _sd()
    state = {"model": sd, "view": sd["w"][3], "step": 7}
    path = tmp_path / "model.pt"
    torch.save(state, path)
    out = fmstore.load(str(path), map_location="cpu")
    assert out["step"] == 7 and torch.equal(out["model"]["w"], sd["w"])
    assert (
        out["view"].untyped_storage().data_ptr() == out["model"]["w"].untyped_storage().data_ptr()
    )
    part = fmstore.load(path, keys="model.b")
    assert list(part) == ["model"] and list(part["model"]) == ["b"]
    assert torch.equal(part["model"]["b"], sd["b"])
    with route_cpu(slots=2, slot_bytes=4 << 10) as rec:
        moved = fmstore.load(str(path), map_location="cpu")
    assert torch.equal(moved["model"]["w"], sd["w"])
    assert (
        moved["view"].untyped_storage().data_ptr()
        == moved["model"]["w"].untyped_storage().data_ptr()
    )
    assert sum(n for _, n in rec.uses) == sd["w"].nbytes + sd["b"].nbytes


class _Thing:
    pass


def test_torch_save_file_keeps_weights_only(tmp_path):
    path = tmp_path / "obj.pth"
    torch.save({"x": _Thing()}, path)
    with pytest.raises(CorruptData, match="weights_only=False"):
        fmstore.load(str(path))
    assert isinstance(fmstore.load(str(path), weights_only=False)["x"], _Thing)


def test_torch_save_file_goes_through_the_zip_guard(tmp_path):
    path = tmp_path / "bad.ckpt"
    torch.save(_sd(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated: no central directory
    with pytest.raises(CorruptData):
        fmstore.load(str(path))


def test_save_to_a_torch_file_name_warns(tmp_path):
    with pytest.warns(TorchSuffixWarning, match="ckpt convert"):
        fmstore.save(_sd(), str(tmp_path / "model.pt"))
    assert (tmp_path / "model.pt").is_dir()
    assert torch.equal(fmstore.load(str(tmp_path / "model.pt"))["w"], _sd()["w"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fmstore.save(_sd(), str(tmp_path / "plain"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dcp_and_torch_files_load_onto_the_gpu(tmp_path):
    sd = _sd()
    uri = str(tmp_path / "dcp")
    _dcp_save(sd, storage_writer=Writer(uri, compression="zstd"))
    native = str(tmp_path / "native")
    _dcp_save(sd, storage_writer=dcp.FileSystemWriter(native))
    torch.save({"model": sd}, tmp_path / "m.pt")
    for got in (
        fmstore.load(uri, map_location="cuda"),
        fmstore.load(native, map_location="cuda"),
        fmstore.load(str(tmp_path / "m.pt"), map_location="cuda")["model"],
    ):
        for k in sd:
            assert got[k].is_cuda and torch.equal(got[k].cpu(), sd[k])
