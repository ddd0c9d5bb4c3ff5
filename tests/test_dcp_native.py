"""Checkpoints written by torch's own ``FileSystemWriter`` (``.metadata`` + ``.distcp``):
loaded, inspected, verified and converted by fmstore on every tier; fmstore checkpoints
converted to that layout load with torch's ``FileSystemReader``."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from stage_data import fm_here
from torch.distributed.checkpoint.api import CheckpointException

import fmstore
from fmstore import runtime
from fmstore.checkpoint.convert import convert
from fmstore.checkpoint.dcp import Reader
from fmstore.checkpoint.dcp.api import inspect_checkpoint, is_dcp_checkpoint
from fmstore.checkpoint.dcp.native import read_native
from fmstore.checkpoint.verify import verify_checkpoint
from fmstore.errors import CorruptData
from fmstore.stores import open_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def fm(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    return fm_here


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "h": torch.randn(16, 8, generator=g).bfloat16(),
            "idx": torch.arange(10, dtype=torch.int64),
            "mask": torch.rand(7, generator=g) > 0.5,
        },
        "optim": {"lr": torch.tensor(0.5, dtype=torch.float64)},
        "step": 42,
    }


def _blank() -> dict:
    s = _state()
    return {
        "model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
        "optim": {"lr": torch.zeros((), dtype=torch.float64)},
        "step": 0,
    }


def _same(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    for k, v in want["model"].items():
        g = got["model"][k]
        assert g.dtype == v.dtype and g.shape == v.shape, k
        assert torch.equal(g.view(torch.uint8), v.view(torch.uint8)), k  # bit-exact
    assert torch.equal(got["optim"]["lr"], want["optim"]["lr"])


def _torch_save(path) -> dict:
    st = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(st, storage_writer=dcp.FileSystemWriter(str(path)))
    return st


def test_native_dir_loads_with_fmstore_load_and_reader(tmp_path):
    want = _torch_save(tmp_path / "c")
    assert not (tmp_path / "c" / "manifest.json").exists()
    assert is_dcp_checkpoint(str(tmp_path / "c"))
    _same(fmstore.load(tmp_path / "c"), want)
    st = _blank()
    dcp.load(st, storage_reader=Reader(tmp_path / "c"), no_dist=True)
    _same(st, want)


def test_native_cli_inspect_verify_convert(tmp_path, fm):
    want = _torch_save(tmp_path / "c")
    r = fm("ckpt", "inspect", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    for word in ("native", "torch DCP", "model.w", "bfloat16", "64x32", "torch.save", "step"):
        assert word in r.stdout, word
    r = fm("ckpt", "verify", str(tmp_path / "c"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: 6 chunks" in r.stdout
    r = fm("ckpt", "convert", str(tmp_path / "c"), str(tmp_path / "fm"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "fm" / "manifest.json").exists()
    _same(fmstore.load(tmp_path / "fm"), want)
    r = fm("ckpt", "convert", str(tmp_path / "c"), str(tmp_path / "w.safetensors"))
    assert r.returncode == 0, r.stderr


def test_convert_to_dcp_loads_with_torch_filesystem_reader(tmp_path, fm):
    want = _state()
    fmstore.save(want, tmp_path / "fm")
    r = fm("ckpt", "convert", "--to", "dcp", str(tmp_path / "fm"), str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "d" / ".metadata").exists()
    st = _blank()
    dcp.load(st, storage_reader=dcp.FileSystemReader(str(tmp_path / "d")), no_dist=True)
    _same(st, want)
    # an existing destination needs --overwrite
    r = fm("ckpt", "convert", "--to", "dcp", str(tmp_path / "fm"), str(tmp_path / "d"))
    assert r.returncode != 0
    assert "--overwrite" in (r.stdout + r.stderr)
    assert convert(str(tmp_path / "fm"), str(tmp_path / "d"), to="dcp", overwrite=True) == 5


def _flip(path, at: int) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0xFF
    path.write_bytes(bytes(b))


def _item_of(path, fqn: str):
    store = open_store(str(path))
    try:
        ck = runtime.run(read_native(store))
    finally:
        runtime.run(store.close())
    return next(i for i in ck.items if i.fqn == fqn)


def test_corrupt_distcp_is_corrupt_data(tmp_path, fm):
    want = _torch_save(tmp_path / "c")
    it = _item_of(tmp_path / "c", "model.w")
    data = (tmp_path / "c" / it.path).read_bytes()
    # flip one byte of the tensor's bytes (torch.load itself would not notice)
    at = data.index(want["model"]["w"].numpy().tobytes()[:64], it.start)
    _flip(tmp_path / "c" / it.path, at + 5)
    with pytest.raises(CorruptData, match="model.w.*CRC32"):
        fmstore.load(tmp_path / "c")
    r = fm("ckpt", "verify", str(tmp_path / "c"))
    assert r.returncode == 1
    assert "model.w" in r.stdout and "Traceback" not in r.stdout + r.stderr


def test_truncated_distcp_is_refused(tmp_path, fm):
    _torch_save(tmp_path / "c")
    it = _item_of(tmp_path / "c", "model.w")
    f = tmp_path / "c" / it.path
    os.truncate(f, it.start + it.length - 10)
    with pytest.raises(CorruptData, match="model.w.*past|model.w.*which has"):
        fmstore.load(tmp_path / "c")
    r = fm("ckpt", "verify", str(tmp_path / "c"))
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    assert "model.w" in r.stdout + r.stderr
    r = fm("ckpt", "inspect", str(tmp_path / "c"))
    assert r.returncode != 0 and "error" in (r.stdout + r.stderr).lower()


def _rewrite_metadata(path, change) -> None:
    # The file torch wrote in this test (trusted), changed here into a hostile one.
    md = pickle.loads((path / ".metadata").read_bytes())
    change(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def test_metadata_offset_past_end_is_refused(tmp_path):
    _torch_save(tmp_path / "c")
    size = os.path.getsize(tmp_path / "c" / "__0_0.distcp")

    def far(md):
        for idx, info in md.storage_data.items():
            if idx.fqn == "model.w":
                info.offset = size + (1 << 40)

    _rewrite_metadata(tmp_path / "c", far)
    with pytest.raises(CorruptData, match="model.w.*declares bytes"):
        fmstore.load(tmp_path / "c")
    with pytest.raises(CheckpointException) as e:  # DCP wraps our CorruptData for its ranks
        dcp.load(_blank(), storage_reader=Reader(tmp_path / "c"), no_dist=True)
    assert "declares bytes" in str(e.value.failures)
    res = runtime.run(verify_checkpoint(open_store(str(tmp_path / "c"))))
    assert not res.ok and "declares bytes" in res.problems[0]


def test_metadata_huge_tensor_size_is_refused(tmp_path):
    _torch_save(tmp_path / "c")

    def huge(md):
        md.state_dict_metadata["model.w"].size = torch.Size([1 << 30, 1 << 20])

    _rewrite_metadata(tmp_path / "c", huge)
    with pytest.raises(CorruptData, match="model.w"):
        fmstore.load(tmp_path / "c")


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/fmstore-dcp-native-pwned",))


def test_metadata_with_other_globals_is_not_unpickled(tmp_path):
    _torch_save(tmp_path / "c")
    marker = "/tmp/fmstore-dcp-native-pwned"
    if os.path.exists(marker):
        os.unlink(marker)

    def evil(md):
        md.planner_data = {"x": Boom()}

    _rewrite_metadata(tmp_path / "c", evil)
    with pytest.raises(CorruptData, match="allow_pickle=True"):
        fmstore.load(tmp_path / "c")
    with pytest.raises(CorruptData, match="allow_pickle=True"):
        inspect_checkpoint(str(tmp_path / "c"))
    assert not os.path.exists(marker)


def test_garbled_metadata_is_corrupt_data(tmp_path, fm):
    _torch_save(tmp_path / "c")
    (tmp_path / "c" / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CorruptData, match="not a valid checkpoint"):
        fmstore.load(tmp_path / "c")
    r = fm("ckpt", "verify", str(tmp_path / "c"))
    assert r.returncode != 0 and "Traceback" not in r.stdout + r.stderr


@pytest.mark.s3
def test_native_dir_staged_to_s3(tmp_path, s3_server, s3_bucket, s3_store):
    want = _torch_save(tmp_path / "c")
    for name in sorted(os.listdir(tmp_path / "c"), key=lambda n: n == ".metadata"):
        runtime.run(s3_store.put(name, (tmp_path / "c" / name).read_bytes()))
    _same(fmstore.load(s3_store), want)
    uri = f"s3://{s3_bucket}/prefix"
    opts = s3_server.store_options()
    st = _blank()
    dcp.load(st, storage_reader=Reader(uri, store_options=opts), no_dist=True)
    _same(st, want)
    _, rows = inspect_checkpoint(uri, **opts)
    assert {r.fqn for r in rows} >= {"model.w", "model.h", "step"}
    res = runtime.run(verify_checkpoint(s3_store))
    assert res.ok and res.chunks == 6, res.problems
    convert_dst = tmp_path / "fm"
    from fmstore.checkpoint.dcp.api import load_full_state_dict

    fmstore.save(load_full_state_dict(uri, **opts), convert_dst)
    _same(fmstore.load(convert_dst), want)
