"""A lazy load is usable wherever a dict from torch.load is (optimizer and module
load_state_dict, torch.save, copy, deepcopy, pickle) and reads only what is touched."""

from __future__ import annotations

import copy
import io
import pickle
from collections import OrderedDict

import pytest
import torch
from tiering_helpers import posix_config

import fmstore
from fmstore import CheckpointManager, runtime
from fmstore.checkpoint import LazyDict
from fmstore.metrics import STORE_BYTES
from fmstore.stores import open_store


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    return model, opt


def test_a_lazy_restore_loads_into_a_module_and_an_optimizer_and_saves_with_torch(tmp_path):
    model, opt = trained()
    cfg = posix_config(str(tmp_path), {"restore": {"mode": "lazy"}}, tiers=("nvme",))
    with CheckpointManager("r", config=cfg, run_policies=False, async_save=False) as mgr:
        mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1})
        state = mgr.restore()
        assert isinstance(state, LazyDict) and isinstance(state, dict)
        model2, opt2 = trained()
        with torch.no_grad():
            for p in model2.parameters():
                p.zero_()
        model2.load_state_dict(state["model"])
        opt2.load_state_dict(state["optim"])
        for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
            assert torch.equal(a, b)
        assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
        for k, st in opt.state_dict()["state"].items():
            assert torch.equal(opt2.state_dict()["state"][k]["exp_avg"], st["exp_avg"])
        # The module's metadata (versions) survives, as from an OrderedDict of torch.load.
        assert state["model"]._metadata == model.state_dict()._metadata

        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        back = torch.load(buf)
        assert isinstance(back, OrderedDict) and isinstance(back["model"], OrderedDict)
        assert torch.equal(back["model"]["0.weight"], model.state_dict()["0.weight"])
        assert back["model"]._metadata == model.state_dict()._metadata

        deep = copy.deepcopy(state)
        assert type(deep) is dict and deep["step"] == 1
        w = deep["model"]["0.weight"]
        w.add_(1)  # a deep copy is independent of the restored state
        assert not torch.equal(w, state["model"]["0.weight"])
        assert pickle.loads(pickle.dumps(state))["optim"]["param_groups"][0]["lr"] == 0.01


def test_copies_of_a_lazy_dict_behave_like_dict_copies(tmp_path):
    fmstore.save({"a": torch.ones(3), "n": {"x": 1}, "l": [1, 2]}, tmp_path / "c")
    lz = fmstore.load(tmp_path / "c", lazy=True)
    c = lz.copy()
    c["extra"] = 5
    del c["l"]
    assert "extra" not in lz and "l" in lz and isinstance(c, LazyDict)
    assert set(dict(lz)) == {"a", "n", "l"} and {**lz}["l"] == [1, 2]
    assert lz.get("missing", 9) == 9 and lz.get("l") == [1, 2]
    assert dict(lz.items())["n"] == {"x": 1} and [1, 2] in list(lz.values())
    assert lz.pop("l") == [1, 2] and "l" not in lz
    assert (lz | {"z": 0})["z"] == 0 and "z" not in lz
    assert lz["n"] == {"x": 1} and lz["n"] != {"x": 2}
    assert lz.materialize()["n"] == {"x": 1}


@pytest.fixture
def metered_s3(s3_server, s3_bucket):
    """A store on S3 whose reads are counted under a tier label of its own."""
    tier = f"lazy-{s3_bucket}"
    store = open_store(f"s3://{s3_bucket}/ck", tier=tier, metered=True, **s3_server.store_options())
    yield store, lambda: STORE_BYTES.labels(tier, "get")._value.get()
    runtime.run(store.close(), timeout=30)


def test_a_lazy_dict_reads_only_what_is_touched_even_when_copied(metered_s3):
    store, read = metered_s3
    big = torch.randn(2 << 20)  # 8 MiB
    fmstore.save({"small": torch.ones(16), "big": big}, store, compression="raw")
    before = read()
    lz = fmstore.load(store, lazy=True)
    assert torch.equal(lz["small"], torch.ones(16))
    assert isinstance(lz.copy(), dict) and copy.copy(lz)["small"].sum() == 16
    assert read() - before < 1 << 20  # the manifest and one small chunk: never the big one
    assert torch.equal(copy.deepcopy(lz)["big"], big)
    assert read() - before >= big.nbytes
