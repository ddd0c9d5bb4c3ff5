"""Lightning's own Trainer with fmstore's sharded strategy on 2 gloo ranks: save, SIGKILL,
resume from the other tier after the first is wiped, bit for bit and loss for loss."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

pl = pytest.importorskip("pytorch_lightning")
torch = pytest.importorskip("torch")

from stack_support import files, rank_env, same, wait_for  # noqa: E402

from fmstore.testing.torchrun import kill_all, launch  # noqa: E402

WORKER = str(Path(__file__).with_name("lightning_sharded_worker.py"))
ROOT = "runs/lit"
NATIVE = (".metadata", "meta.pt")


def _config(tmp: Path) -> Path:
    cfg = tmp / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp}/state"\n'
        f'[tiers.nvme]\nurl = "{tmp}/nvme"\n'
        f'[tiers.lustre]\nurl = "{tmp}/lustre"\n'
        '[policies]\nladder = ["nvme", "lustre"]\n'
    )
    return cfg


def _env(tmp: Path, cfg: Path) -> dict[str, str]:
    return rank_env(cfg)


def _wait_for(path: Path, p, timeout: float = 240) -> None:  # type: ignore[no-untyped-def]
    wait_for(path, p, timeout=timeout)


def _native_files(base: Path) -> list[str]:
    return files([base], lambda f: f.name in NATIVE or f.suffix == ".distcp"
                 or f.name.startswith("rng_state_"))  # fmt: skip


_same = same


def test_model_parallel_strategy_saves_kills_and_resumes_from_lustre(tmp_path):
    from fmstore import runtime
    from fmstore.checkpoint.layout import step_name
    from fmstore.config import load_config
    from fmstore.tiering.exports.mover import copy_checkpoint
    from fmstore.tiering.tiers import Tiers

    cfg = _config(tmp_path)
    env = _env(tmp_path, cfg)
    out = tmp_path / "out"
    out.mkdir()
    run = f"nvme:{ROOT}"
    nvme = tmp_path / "nvme" / ROOT

    # The killed launch: the uninterrupted reference fit, then a fit killed once step 4 is
    # committed (it waits after that save, so the kill cannot land anywhere else).
    p = launch(WORKER, ["kill", run, str(out)], nproc=2, env=env, cwd=str(tmp_path))
    try:
        _wait_for(nvme / step_name(4) / "manifest.json", p)
        _wait_for(out / "waiting_0", p)  # and past the removal that followed it
        kill_all(p)
    finally:
        kill_all(p)
        p.communicate()
    assert (out / "saved_0.pt").is_file() and (out / "saved_1.pt").is_file()
    # save_top_k=1: step 2 was removed once step 4 was saved (through the strategy);
    # the last and the top-k checkpoint of step 4 are one
    assert sorted(os.listdir(nvme)) == [step_name(4)]

    # The daemon's export, done here: step 4 to lustre; then the NVMe copy is lost.
    tiers = Tiers(load_config(str(cfg)))
    runtime.run(
        copy_checkpoint(tiers.checkpoint("nvme", ROOT, 4), tiers.checkpoint("lustre", ROOT, 4))
    )
    shutil.rmtree(tmp_path / "nvme")

    p = launch(WORKER, ["resume", run, str(out)], nproc=2, env=env, cwd=str(tmp_path))
    try:
        log, _ = p.communicate(timeout=240)
    finally:
        kill_all(p)
    assert p.returncode == 0, log

    # "last" found step 4 on lustre; every rank restored exactly what it saved
    for r in (0, 1):
        saved = torch.load(out / f"saved_{r}.pt", weights_only=True)
        restored = torch.load(out / f"restored_{r}.pt", weights_only=True)
        assert saved["step"] == restored["step"] == 4
        assert _same(saved["model"], restored["model"]), r
        assert _same(saved["optim"], restored["optim"]), r
    ref = json.loads((out / "losses_ref.json").read_text())
    resumed = json.loads((out / "losses_resume.json").read_text())
    assert sorted(resumed) == ["5", "6", "7"]
    assert [resumed[s] for s in ("5", "6", "7")] == [ref[s] for s in ("5", "6", "7")]

    # the resumed run saved step 6 on nvme through fmstore; nothing went around it
    assert (tmp_path / "nvme" / ROOT / step_name(6) / "manifest.json").is_file()
    assert (tmp_path / "lustre" / ROOT / step_name(4) / "manifest.json").is_file()
    assert _native_files(tmp_path) == []
    assert not (tmp_path / "nvme:runs").exists()


# ---- one rank, in this process (Lightning starts a 1-rank gloo group itself) -----------


class _Tiny(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(width, 1)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit_one_rank(strategy, callbacks, plugins=(), steps: int = 2, **fit):  # type: ignore[no-untyped-def]
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        plugins=list(plugins),
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = _Tiny()
    trainer.fit(model, loader, **fit)
    return trainer, model


@pytest.fixture
def one_rank(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """Lightning's 1-rank process group, gone after the test (it would outlive it); run in
    the test's directory, where Lightning writes what it writes by default (the working
    directory is left as it was)."""
    import torch.distributed as dist

    from fmstore.testing.seaweed import free_ports

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_ports(1)[0]))
    # Lightning's cluster environment writes RANK, WORLD_SIZE, LOCAL_RANK, NODE_RANK… into
    # os.environ: later tests (the loaders read their world from it) must not see them.
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)
    from fmstore.checkpoint.dcp import collective

    if dist.is_initialized():
        dist.destroy_process_group()
    collective._groups.clear()  # the checkpoint group of that world is gone with it


def test_one_checkpoint_holds_lightning_state_and_loads_weights_only(tmp_path, one_rank):
    from fmstore.checkpoint.dcp import inspect_checkpoint
    from fmstore.checkpoint.layout import step_name
    from fmstore.integrations.lightning import (
        FmstoreModelCheckpoint,
        FmstoreModelParallelStrategy,
    )

    run = tmp_path / "run"
    ckpt = FmstoreModelCheckpoint(
        dirpath=str(run), every_n_train_steps=1, save_top_k=-1, save_last=True
    )
    trainer, model = _fit_one_rank(FmstoreModelParallelStrategy(), [ckpt], steps=3)
    # every step kept, each once although it is also "last"
    assert sorted(os.listdir(run)) == [step_name(s) for s in (1, 2, 3)]
    m, rows = inspect_checkpoint(str(run / step_name(3)))
    fqns = {r.fqn for r in rows}
    assert "lightning" in fqns and any(f.startswith("state_dict.") for f in fqns)
    assert any(f.startswith("optimizer_0.") for f in fqns)
    assert _native_files(tmp_path) == []
    # Lightning's name is kept with the step it names
    assert ckpt.lightning_names[f"{run}/{step_name(3)}"] == ["epoch=0-step=3.ckpt", "last.ckpt"]

    # the Lightning part comes back with weights_only (no code runs) and resumes
    seen = {}

    class Probe(pl.Callback):  # type: ignore[misc]
        def on_train_start(self, trainer, module):  # type: ignore[no-untyped-def]
            seen["step"] = trainer.global_step
            seen["w"] = module.net.weight.to_local().clone()
            seen["hp"] = dict(module.hparams)

    t2, _ = _fit_one_rank(
        FmstoreModelParallelStrategy(), [Probe()], steps=4, ckpt_path=str(run / step_name(3))
    )
    assert seen["step"] == 3 and seen["hp"] == {"width": 4}
    assert torch.equal(seen["w"], model.net.weight.to_local())
    assert t2.global_step == 4


def test_stock_sharded_strategy_bypassing_the_plugin_is_said(tmp_path, one_rank):
    from fmstore.errors import NotSupported
    from fmstore.integrations.lightning import FmstoreBypassedWarning, FmstoreCheckpointIO

    io = FmstoreCheckpointIO()
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "run"), every_n_train_steps=1)
    with pytest.warns(FmstoreBypassedWarning, match="FmstoreModelParallelStrategy"):
        _fit_one_rank(pl.strategies.ModelParallelStrategy(), [ckpt], plugins=[io], steps=2)
    written = tmp_path / "run" / "epoch=0-step=2.ckpt"
    assert (written / "meta.pt").is_file()  # Lightning's own files: the plugin never ran
    with pytest.raises(NotSupported, match="bypassed"):
        io.load_checkpoint(str(written))


def test_the_plugin_does_not_warn_about_the_format_it_writes(tmp_path):
    import warnings

    from fmstore.integrations.lightning import FmstoreCheckpointIO

    io = FmstoreCheckpointIO(async_save=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        io.save_checkpoint({"a": torch.zeros(2)}, str(tmp_path / "x.ckpt"))
        io.save_checkpoint({"a": torch.ones(2)}, str(tmp_path / "x.ckpt"))
    assert torch.equal(io.load_checkpoint(str(tmp_path / "x.ckpt"))["a"], torch.ones(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP needs a non-CPU accelerator device")
def test_fsdp_strategy_sharded_saves_through_fmstore(tmp_path, one_rank):  # pragma: no cover
    from fmstore.checkpoint.dcp import inspect_checkpoint
    from fmstore.checkpoint.layout import step_name
    from fmstore.integrations.lightning import FmstoreFSDPStrategy, FmstoreModelCheckpoint

    class Plain(_Tiny):
        def configure_model(self) -> None:  # FSDP1 wraps the module itself
            pass

    def fit(steps: int, **kw):  # type: ignore[no-untyped-def]
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
        data = torch.utils.data.TensorDataset(x, x[:, :1])
        ckpt = FmstoreModelCheckpoint(dirpath=str(tmp_path / "run"), every_n_train_steps=1)
        t = pl.Trainer(
            accelerator="cuda",
            devices=1,
            strategy=FmstoreFSDPStrategy(),
            max_steps=steps,
            callbacks=[ckpt],
            logger=False,
            enable_progress_bar=False,
        )
        m = Plain()
        t.fit(m, torch.utils.data.DataLoader(data, batch_size=4), **kw)
        return t, m

    fit(2)
    path = tmp_path / "run" / step_name(2)
    fqns = {r.fqn for r in inspect_checkpoint(str(path))[1]}
    assert "lightning" in fqns and any(f.startswith("model.") for f in fqns)
    assert _native_files(tmp_path) == []
    t2, _ = fit(3, ckpt_path="last")
    assert t2.global_step == 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
