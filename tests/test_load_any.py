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


# ---- what `ckpt convert` reads, fmstore.load and `ckpt inspect` read too ----------------


def _hf_dir(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    sd = _sd()
    path.mkdir()
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text("{}")
    return sd


def test_hugging_face_directories_and_safetensors_files_load_and_inspect(tmp_path):
    from safetensors.torch import save_file
    from stage_data import fm_here

    sd = _hf_dir(tmp_path / "hf")
    save_file(sd, str(tmp_path / "w.safetensors"))
    torch.save({"model": sd}, tmp_path / "plain.pt")
    for where in (tmp_path / "hf", str(tmp_path / "w.safetensors")):
        out = fmstore.load(where)
        assert out.keys() == sd.keys() and torch.equal(out["w"], sd["w"])
    assert list(fmstore.load(tmp_path / "hf", keys="b")) == ["b"]
    for where, word in (("hf", "hf"), ("w.safetensors", "safetensors"), ("plain.pt", "torch")):
        r = fm_here("ckpt", "inspect", str(tmp_path / where))
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"({word})" in r.stdout and "64x128" in r.stdout and "2 tensors" in r.stdout


@pytest.fixture
def s3_tier(s3_server, s3_bucket, tmp_path, monkeypatch):
    """fmstore's config and environment with an ``s3`` tier on the test server."""
    from stage_data import s3_env

    from fmstore import config as fm_config

    for k, v in s3_env(s3_server, s3_bucket, tmp_path)["env"].items():
        monkeypatch.setenv(k, v)
    fm_config.set_config(None)
    yield
    fm_config.set_config(None)


def _put(location: str, data: bytes) -> None:
    from fmstore import runtime
    from fmstore.stores import open_store

    head, name = location.rsplit("/", 1)
    store = open_store(head)
    runtime.run(store.put(name, data))
    runtime.run(store.close())


def test_files_on_s3_load_and_inspect_through_the_guards(tmp_path, s3_tier):
    import io as _io
    import json

    from safetensors.torch import save as st_save
    from stage_data import fm_here

    sd = _sd()
    buf = _io.BytesIO()
    torch.save({"model": sd, "step": 4}, buf)
    _put("s3:models/plain.pt", buf.getvalue())
    _put("s3:models/w.safetensors", st_save(sd))
    out = fmstore.load("s3:models/plain.pt")
    assert out["step"] == 4 and torch.equal(out["model"]["w"], sd["w"])
    assert torch.equal(fmstore.load("s3:models/w.safetensors")["b"], sd["b"])
    r = fm_here("ckpt", "inspect", "--json", "s3:models/plain.pt")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["format"] == "torch" and doc["tensor_count"] == 2
    r = fm_here("ckpt", "convert", "s3:models/w.safetensors", str(tmp_path / "conv"))
    assert r.returncode == 0, r.stderr
    assert torch.equal(fmstore.load(tmp_path / "conv")["w"], sd["w"])
    # Downloaded, then checked like a local file: a truncated archive is refused.
    _put("s3:models/bad.pt", buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(CorruptData, match="s3:models/bad.pt"):
        fmstore.load("s3:models/bad.pt")
    # A checkpoint saved under a file-like name on S3 is still a checkpoint.
    with pytest.warns(TorchSuffixWarning):
        fmstore.save(sd, "s3:ckpts/c.pt")
    assert torch.equal(fmstore.load("s3:ckpts/c.pt")["w"], sd["w"])
    # A Hugging Face directory on S3: one line saying what to do.
    _put("s3:models/hf/model.safetensors", st_save(sd))
    from fmstore.errors import NotSupported

    with pytest.raises(NotSupported, match="Hugging Face directory.*fmstore stage"):
        fmstore.load("s3:models/hf")
    r = fm_here("stage", "s3:models/hf", str(tmp_path / "llama"))  # what the error says
    assert r.returncode == 0, r.stderr
    assert torch.equal(fmstore.load(tmp_path / "llama")["w"], sd["w"])
