"""Allocating and faulting in staging memory off the training loop: the DCP ``Stager``'s
``prepare``, ``CheckpointManager.prepare`` and the Lightning plugin's prepare callback."""

from __future__ import annotations

import pytest
import torch

from fmstore.checkpoint.dcp import Stager
from fmstore.checkpoint.snapshot import STAGING


def _sd() -> dict[str, object]:
    return {
        "model": {"w": torch.randn(256, 256), "b": torch.zeros(256)},
        "optim": {"state": {0: {"exp_avg": torch.zeros(256, 256)}}, "lr": 0.1},
    }


def test_stager_prepare_makes_every_buffer_the_first_stage_uses():
    sd = _sd()
    stager = Stager(pin_memory=False)
    want = sum(
        t.nbytes for t in (sd["model"]["w"], sd["model"]["b"], sd["optim"]["state"][0]["exp_avg"])
    )  # type: ignore[index]
    assert stager.prepare(sd).result(timeout=60) == want
    assert stager.staged_bytes == want
    before = {id(b): b.data_ptr() for b in stager._buffers.values()}
    staged = stager.stage(sd)
    assert stager.staged_bytes == want  # nothing new allocated
    ptrs = set(before.values())
    assert staged["model"]["w"].data_ptr() in ptrs
    assert staged["optim"]["state"][0]["exp_avg"].data_ptr() in ptrs
    assert torch.equal(staged["model"]["w"], sd["model"]["w"])  # type: ignore[index]
    assert staged["optim"]["lr"] == 0.1


def test_manager_prepare_discovers_and_reserves_staging_in_the_background(tmp_path):
    from tiering_helpers import posix_config

    from fmstore import CheckpointManager

    config = posix_config(str(tmp_path / "t"), {"ladder": ["nvme", "lustre"]}, ("nvme", "lustre"))
    sd = _sd()
    with CheckpointManager("runs/p", config=config, run_policies=False) as mgr:
        size = mgr.prepare(sd).result(timeout=60)
        assert mgr._discovered
        assert size >= 2 * 256 * 256 * 4 and STAGING.nbytes >= size
        mgr.save(1, sd).result()
        assert mgr.steps() == [1]


def test_lightning_prepare_callback_prepares_the_plugins_staging(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from fmstore.integrations.lightning import FmstoreCheckpointIO, prepare_callback

    class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(64, 64)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.layer(batch[0]).square().mean()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.Adam(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 64)), batch_size=8
    )
    cb = prepare_callback()
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        plugins=[FmstoreCheckpointIO()],
        callbacks=[cb, pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"))],
    )
    trainer.fit(Tiny(), data)
    assert cb.future is not None
    cb.future.result(timeout=60)  # 0 when the first save came first and took over
    assert STAGING.nbytes >= 3 * (64 * 64 + 64) * 4  # weights and Adam's two moments
