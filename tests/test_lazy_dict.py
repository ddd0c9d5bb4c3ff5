"""A lazy load is usable wherever a dict from torch.load is (optimizer and module
load_state_dict, torch.save, copy, deepcopy, pickle) and reads only what is touched."""

from __future__ import annotations

import copy
import io
import pickle
import shutil
from collections import OrderedDict
from pathlib import Path

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


# ---- a lazily restored state is a state: it saves again ------------------------------------


def _docs_policies() -> dict:
    """The ``[policies]`` example of docs/tiering.md, as written there."""
    import tomllib

    text = (Path(__file__).parent.parent / "docs" / "tiering.md").read_text()
    block = text.split("## Policies reference")[1].split("```toml\n")[1].split("```")[0]
    pol = tomllib.loads(block)["policies"]
    assert pol["restore"]["mode"] == "lazy"
    return pol


def _train(cfg, total_steps: int) -> None:
    """The training loop of docs/tiering.md (a save every step)."""
    with CheckpointManager("runs/llama-7b", config=cfg, run_policies="thread") as mgr:
        if mgr.latest_step() is not None:
            state = mgr.restore()
            start = mgr.restored_step + 1
        else:
            state, start = {"model": {"w": torch.zeros(1000), "b": torch.zeros(7)}, "step": 0}, 0
        for step in range(start, total_steps):
            state["step"] = step  # the model's tensors stay unread until the save
            if step % 2 == 0:
                state["model"]["b"] += 1
            mgr.save(step, state)
        assert mgr.wait_for_policies(60)


def test_the_docs_policies_with_a_lazy_restore_save_again_after_a_restart(tmp_path):
    cfg = posix_config(str(tmp_path), _docs_policies())
    _train(cfg, 2)
    _train(cfg, 4)  # restored lazily from nvme (step 1), then saved: steps 2 and 3
    # A new node: its NVMe and catalog are gone, the restore reads through from Lustre.
    shutil.rmtree(tmp_path / "nvme")
    shutil.rmtree(tmp_path / "state")
    _train(cfg, 5)
    got = fmstore.load(tmp_path / "nvme" / "runs/llama-7b" / "step_000000000004")
    assert got["step"] == 4 and torch.equal(got["model"]["b"], torch.full((7,), 3.0))
    assert torch.equal(got["model"]["w"], torch.zeros(1000))


def test_save_async_save_and_torch_save_take_a_lazy_load_as_the_state_it_stands_for(tmp_path):
    model, opt = trained()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}
    fmstore.save(sd, tmp_path / "a")
    lz = fmstore.load(tmp_path / "a", lazy=True)
    fmstore.save(lz, tmp_path / "b")
    fmstore.async_save(fmstore.load(tmp_path / "a", lazy=True), tmp_path / "c").result()
    torch.save(fmstore.load(tmp_path / "a", lazy=True), tmp_path / "d.pt")
    for back in (
        fmstore.load(tmp_path / "b"),
        fmstore.load(tmp_path / "c"),
        torch.load(tmp_path / "d.pt"),
    ):
        assert back["step"] == 3
        assert type(back["model"]) is OrderedDict  # a state_dict stays one (load_state_dict)
        assert back["model"]._metadata == model.state_dict()._metadata
        for k, v in model.state_dict().items():
            assert torch.equal(back["model"][k], v)
        assert back["optim"]["param_groups"] == opt.state_dict()["param_groups"]


def test_fmstore_objects_in_a_state_are_refused_without_advice_to_pickle(tmp_path):
    h = fmstore.async_save({"x": torch.ones(2)}, tmp_path / "a")
    h.result()
    with pytest.raises(TypeError, match=r"state\['handle'\] is a fmstore\.") as e:
        fmstore.save({"handle": h}, tmp_path / "b")
    assert "pickle" not in str(e.value) and "pass the state" in str(e.value)
    with pytest.raises(TypeError, match="pass pickle=True"):  # other types keep the advice
        fmstore.save({"x": object()}, tmp_path / "c")
