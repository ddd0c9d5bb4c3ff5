"""save / load round trips: every dtype and structure, ties, views, partial, lazy, mmap,
map_location, overwrite; on a POSIX directory and on fsspec's memory:// (store-agnostic).
A save's manifest shows as one short line."""

from __future__ import annotations

import math
import random
import uuid
from collections import OrderedDict

import numpy as np
import pytest
import torch

import fmstore
from fmstore.errors import AlreadyExists, NotFound
from fmstore.format.dtypes import ITEMSIZES, _torch_names, dtype_from_name, dtype_name

DTYPES = [dt for name, dt in _torch_names().items() if name not in ("complex32", "float8_e8m0fnu")]


def test_dtype_table_agrees_with_torch():
    """Manifests are checked against a plain table of names and element sizes (no torch
    needed); it must match torch's own dtypes, both ways."""
    names = _torch_names()
    assert names, "this torch has none of the format's dtypes"
    for name, dt in names.items():
        assert ITEMSIZES[name] == dt.itemsize, name
        assert dtype_name(dt) == name and dtype_from_name(name) is dt
    assert set(names) == {n for n in ITEMSIZES if isinstance(getattr(torch, n, None), torch.dtype)}
    with pytest.raises(KeyError):
        dtype_from_name("float7")


def _rand(dtype: torch.dtype, shape=(7, 33)) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(str(dtype)) % 1000)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe), dtype, shape and stride."""
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    if a.numel() == 0:
        return True
    ua = a.contiguous().view(torch.uint8) if a.dtype != torch.bool else a.to(torch.uint8)
    ub = b.contiguous().view(torch.uint8) if b.dtype != torch.bool else b.to(torch.uint8)
    return bool(torch.equal(ua, ub))


@pytest.fixture(params=["posix", "memory"])
def uri(request, tmp_path):
    if request.param == "posix":
        return str(tmp_path / "ckpt")
    return f"memory://fmstore-test-{uuid.uuid4().hex}/ckpt"


def _optimizer_state():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def test_every_dtype_round_trips_bit_exact(uri):
    state = {str(dt): _rand(dt) for dt in DTYPES}
    state["nan_inf"] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    fmstore.save(state, uri)
    out = fmstore.load(uri)
    assert set(out) == set(state)
    for k, v in state.items():
        assert _same(out[k], v), k


@pytest.mark.parametrize("compression", ["raw", "zstd", "bytegroup+zstd", "auto"])
def test_every_codec_round_trips(tmp_path, compression):
    state = {
        "bf16": torch.randn(300_000).to(torch.bfloat16),
        "f32": torch.randn(100_000),
        "zeros": torch.zeros(200_000, dtype=torch.int64),
        "f8": torch.randn(50_000).to(torch.float8_e5m2),
        "c64": torch.randn(10_000, dtype=torch.complex64),
    }
    m = fmstore.save(state, tmp_path / "c", compression=compression, chunk_size=1 << 16)
    out = fmstore.load(tmp_path / "c")
    for k, v in state.items():
        assert _same(out[k], v), k
    codecs = {c.codec for s in m.storages for c in s.chunks}
    if compression in ("raw", "auto"):  # auto: a local directory takes bytes faster than zstd
        assert codecs == {"raw"}
    else:
        assert codecs - {"raw"}, "something should have compressed"


def test_auto_compresses_only_where_it_pays():
    from fmstore.checkpoint.planner import auto_compresses
    from fmstore.format.codecs import choose_codec

    assert not auto_compresses("file:///data/ckpt")
    assert not auto_compresses("/data/ckpt")
    assert not auto_compresses("memory://bucket/ckpt")
    assert auto_compresses("s3://bucket/ckpt")
    assert choose_codec("auto", torch.bfloat16) == "bytegroup+zstd"
    assert choose_codec("auto", torch.float16) == "bytegroup+zstd"
    assert choose_codec("auto", torch.float32) == "raw"  # moments shrink only ~1.19x
    assert choose_codec("auto", torch.int64) == "zstd"


def test_structures_and_python_values_round_trip(uri):
    od = OrderedDict(a=torch.ones(2))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {
        "int": 3,
        "big": 2**100,
        "float": 0.1,
        "neg0": -0.0,
        "nan": float("nan"),
        "inf": float("inf"),
        "bool": True,
        "none": None,
        "str": "héllo",
        "bytes": b"\x00\xff",
        "complex": 1 + 2j,
        "tuple": (1, (2, "x"), []),
        "list": [torch.zeros(3), {"k": 1}],
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        7: "int key",
        (1, 2): "tuple key",
        "odict": od,
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(4.5),
        "np": np.arange(6, dtype=np.float32).reshape(2, 3),
        "npscalar": np.float64(2.5),
        "npint": np.int32(-4),
    }
    fmstore.save(state, uri)
    out = fmstore.load(uri)
    assert out["int"] == 3 and type(out["int"]) is int
    assert out["big"] == 2**100
    assert out["float"] == 0.1 and math.copysign(1, out["neg0"]) == -1
    assert math.isnan(out["nan"]) and out["inf"] == float("inf")
    assert out["bool"] is True and out["none"] is None and out["str"] == "héllo"
    assert out["bytes"] == b"\x00\xff" and out["complex"] == 1 + 2j
    assert out["tuple"] == (1, (2, "x"), [])
    assert isinstance(out["list"], list) and _same(out["list"][0], torch.zeros(3))
    assert out["size"] == torch.Size([2, 3]) and type(out["size"]) is torch.Size
    assert out["dtype"] is torch.bfloat16 and out["device"] == torch.device("cpu")
    assert out[7] == "int key" and out[(1, 2)] == "tuple key"
    assert type(out["odict"]) is OrderedDict and out["odict"]._metadata == {"": {"version": 1}}
    assert out["empty"].shape == (0, 5) and out["scalar"].item() == 4.5
    assert isinstance(out["np"], np.ndarray) and np.array_equal(out["np"], state["np"])
    assert type(out["npscalar"]) is np.float64 and type(out["npint"]) is np.int32


def test_ties_and_views_load_back_sharing_storage(uri):
    base = torch.randn(10, 20)
    state = {
        "emb": base,
        "head": base,  # tied weight
        "row": base[3],
        "col": base[:, 5],  # non-contiguous
        "t": base.t(),
        "slice": base[2:4, 1:7],
        "other": torch.randn(4),
    }
    fmstore.save(state, uri)
    out = fmstore.load(uri)
    for k in state:
        assert _same(out[k], state[k]), k
    ptr = out["emb"].untyped_storage().data_ptr()
    for k in ("head", "row", "col", "t", "slice"):
        assert out[k].untyped_storage().data_ptr() == ptr, k
    out["emb"][3, 0] = 123.0
    assert out["row"][0].item() == 123.0 and out["head"][3, 0].item() == 123.0


def test_view_of_a_large_storage_saves_only_its_span(tmp_path):
    big = torch.randn(1_000_000)
    m = fmstore.save({"x": big[10:20]}, tmp_path / "c", compression="raw")
    assert m.nbytes == 40
    assert _same(fmstore.load(tmp_path / "c")["x"], big[10:20].clone())


def test_optimizer_and_model_state_and_rng_round_trip(uri):
    model, opt = _optimizer_state()
    random.seed(5)
    np.random.seed(5)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "numpy_gen": np.random.default_rng(1).bit_generator.state,
        },
        "step": 10,
    }
    fmstore.save(state, uri)
    out = fmstore.load(uri)
    model2, opt2 = _optimizer_state()
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optim"])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    torch.set_rng_state(out["rng"]["torch"])
    random.setstate(out["rng"]["python"])
    np.random.set_state(out["rng"]["numpy"])
    x = (torch.rand(3), random.random(), np.random.rand())
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    assert torch.equal(x[0], torch.rand(3)) and x[1] == random.random() and x[2] == np.random.rand()
    g = np.random.default_rng()
    g.bit_generator.state = out["rng"]["numpy_gen"]
    assert g.random() == np.random.default_rng(1).random()


def test_parameters_and_requires_grad_survive(tmp_path):
    p = torch.nn.Parameter(torch.randn(3))
    fmstore.save({"p": p, "g": torch.ones(2, requires_grad=True)}, tmp_path / "c")
    out = fmstore.load(tmp_path / "c")
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad
    assert out["g"].requires_grad and torch.equal(out["p"].detach(), p.detach())


def test_unsupported_value_names_its_path(tmp_path):
    class Foo:
        pass

    state = {"optim": {"param_groups": [{"lr": 1, "foo": Foo()}]}}
    with pytest.raises(TypeError, match=r"state\['optim'\]\['param_groups'\]\[0\]\['foo'\]"):
        fmstore.save(state, tmp_path / "c")
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_pickle_opt_in_round_trips_and_needs_weights_only_false(tmp_path):
    state = {"obj": {1, 2, 3}, "w": torch.ones(2)}
    fmstore.save(state, tmp_path / "c", pickle=True)
    with pytest.raises(fmstore.CorruptData, match="weights_only=False"):
        fmstore.load(tmp_path / "c")
    out = fmstore.load(tmp_path / "c", weights_only=False)
    assert out["obj"] == {1, 2, 3}
    assert torch.equal(fmstore.load(tmp_path / "c", keys="w")["w"], torch.ones(2))


def test_partial_load_by_names_and_globs(uri):
    state = {
        "model": {
            "layers.0.weight": torch.ones(2),
            "layers.1.weight": torch.zeros(2),
            "head": torch.full((2,), 3.0),
        },
        "optim": {"state": {0: {"exp_avg": torch.ones(4)}}},
        "step": 5,
    }
    fmstore.save(state, uri)
    out = fmstore.load(uri, keys=["model.layers.*", "step"])
    assert set(out) == {"model", "step"} and set(out["model"]) == {
        "layers.0.weight",
        "layers.1.weight",
    }
    out = fmstore.load(uri, keys="optim")
    assert torch.equal(out["optim"]["state"][0]["exp_avg"], torch.ones(4))
    with pytest.raises(NotFound, match="nope"):
        fmstore.load(uri, keys=["nope"])


def test_partial_load_reads_only_the_chunks_it_needs(tmp_path):
    state = {f"t{i}": torch.randn(64 << 10) for i in range(8)}
    fmstore.save(state, tmp_path / "c", compression="raw", blob_size=1 << 18)
    # Destroy every blob but the one holding t3: the partial load must not touch them.
    from fmstore.format.manifest import Manifest

    m = Manifest.loads((tmp_path / "c" / "manifest.json").read_bytes())
    keep = m.storages[m.tensors[3].storage].chunks[0].blob
    for i, b in enumerate(m.blobs):
        if i != keep:
            (tmp_path / "c" / m.generation / b.name).unlink()
    out = fmstore.load(tmp_path / "c", keys="t3")
    assert torch.equal(out["t3"], state["t3"])


def test_lazy_load_fetches_on_access_and_keeps_ties(tmp_path):
    w = torch.randn(5, 5)
    state = {"model": {"a": w, "b": w, "c": torch.randn(3)}, "step": 7, "lst": [torch.ones(1)]}
    fmstore.save(state, tmp_path / "c")
    lz = fmstore.load(tmp_path / "c", lazy=True)
    assert isinstance(lz, fmstore.checkpoint.LazyDict)
    assert set(lz) == {"model", "step", "lst"} and len(lz) == 3
    assert lz["step"] == 7 and torch.equal(lz["lst"][0], torch.ones(1))
    model = lz["model"]
    a, b = model["a"], model["b"]
    assert torch.equal(a, w) and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    full = lz.materialize()
    assert torch.equal(full["model"]["c"], state["model"]["c"])
    lz.close()
    assert torch.equal(a, w)  # fetched tensors outlive the mapping's store


def test_mmap_load_maps_raw_chunks_copy_on_write(tmp_path):
    state = {"w": torch.randn(1000, 10), "z": torch.zeros(100)}
    fmstore.save(state, tmp_path / "c", compression="raw")
    out = fmstore.load(tmp_path / "c", mmap=True)
    assert torch.equal(out["w"], state["w"])
    out["w"][0, 0] = 42.0  # copy-on-write: the file keeps the saved value
    assert fmstore.load(tmp_path / "c")["w"][0, 0].item() == state["w"][0, 0].item()


@pytest.mark.parametrize(
    "map_location",
    ["cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, loc: storage],
    ids=["str", "device", "dict", "callable"],
)
def test_map_location_forms(tmp_path, map_location):
    w = torch.randn(4, 4)
    fmstore.save({"w": w, "v": w[1]}, tmp_path / "c")
    out = fmstore.load(tmp_path / "c", map_location=map_location)
    assert (
        torch.equal(out["w"], w)
        and out["v"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_save_and_load_with_map_location(tmp_path):
    w = torch.randn(1000, 100, device="cuda")
    fmstore.save({"w": w, "h": w}, tmp_path / "c")
    out = fmstore.load(tmp_path / "c")
    assert (
        out["w"].is_cuda and torch.equal(out["w"], w) and out["h"].data_ptr() == out["w"].data_ptr()
    )
    cpu = fmstore.load(tmp_path / "c", map_location="cpu")
    assert cpu["w"].device.type == "cpu" and torch.equal(cpu["w"], w.cpu())
    cu = fmstore.load(tmp_path / "c", map_location={"cuda:0": "cuda:0"})
    assert cu["w"].is_cuda


def test_existing_checkpoint_is_not_replaced_without_overwrite(uri):
    fmstore.save({"v": torch.ones(1)}, uri)
    with pytest.raises(AlreadyExists):
        fmstore.save({"v": torch.zeros(1)}, uri)
    assert fmstore.load(uri)["v"].item() == 1.0


def test_overwrite_replaces_and_removes_the_old_generation(tmp_path):
    root = tmp_path / "c"
    m1 = fmstore.save({"v": torch.ones(1000)}, root)
    m2 = fmstore.save({"v": torch.zeros(1000)}, root, overwrite=True)
    assert m1.generation != m2.generation
    assert torch.equal(fmstore.load(root)["v"], torch.zeros(1000))
    assert sorted(p.name for p in root.iterdir()) == sorted(["manifest.json", m2.generation])


def test_async_twins(tmp_path):
    import asyncio

    async def go():
        await fmstore.asave({"v": torch.arange(5)}, tmp_path / "c")
        return await fmstore.aload(tmp_path / "c")

    assert torch.equal(asyncio.run(go())["v"], torch.arange(5))


def test_many_small_tensors_share_blobs(tmp_path):
    state = {f"b{i}": torch.full((10,), float(i)) for i in range(500)}
    m = fmstore.save(state, tmp_path / "c")
    assert len(m.blobs) == 1
    out = fmstore.load(tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_large_tensor_spans_several_chunks_and_blobs(tmp_path):
    w = torch.randn(3_000_000)
    m = fmstore.save(
        {"w": w}, tmp_path / "c", chunk_size=1 << 20, blob_size=4 << 20, compression="raw"
    )
    assert len(m.storages[0].chunks) > 4 and len(m.blobs) > 1
    assert torch.equal(fmstore.load(tmp_path / "c")["w"], w)
    assert torch.equal(fmstore.load(tmp_path / "c", mmap=True)["w"], w)


def test_tier_paths_work_and_mmap_through_the_tier_prefix(tmp_path):
    from fmstore.config import from_dict, get_config, set_config

    old = get_config()
    set_config(from_dict({"tiers": {"nvme": {"url": str(tmp_path / "nvme")}}}))
    try:
        state = {"w": torch.randn(100, 10)}
        fmstore.save(state, "nvme:run/step-1", compression="raw")
        assert (tmp_path / "nvme" / "run" / "step-1" / "manifest.json").exists()
        out = fmstore.load("nvme:run/step-1", mmap=True)
        assert torch.equal(out["w"], state["w"])
        assert not out["w"].untyped_storage().resizable()  # a mapped buffer, not a fresh allocation
    finally:
        set_config(old)


def test_big_storage_loads_bit_exact_and_writable(tmp_path):
    # Above reader.HUGE_MIN the destination is advised into huge pages: still plain memory.
    w = torch.randn(3 << 20)  # 12 MiB, 3 chunks
    fmstore.save({"w": w}, tmp_path / "c", chunk_size=4 << 20)
    out = fmstore.load(tmp_path / "c")["w"]
    assert torch.equal(out, w)
    out.add_(1)
    assert torch.equal(out, w + 1)


def test_save_and_a_handles_result_show_a_one_line_manifest(tmp_path):
    state = {f"layer{i}": {"w": torch.zeros(64, 64), "b": torch.zeros(64)} for i in range(40)}
    m = fmstore.save(state, tmp_path / "a")
    assert len(m.tensors) == 80  # the entries are all there...
    text = repr(m)
    assert "\n" not in text and len(text) < 120, text  # ...and the repr is one short line
    assert text.startswith(f"<Manifest {m.generation}: 80 tensors, ") and "1 blob " in text
    r = fmstore.async_save({"w": torch.ones(3)}, tmp_path / "b").result()
    assert repr(r).startswith(f"<Manifest {r.generation}: 1 tensor, 12 B in 1 blob (")
