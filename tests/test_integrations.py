"""Trainer plugins (fmstore.integrations) with the real trainers on CPU: a Lightning
``Trainer`` saving through ``FmstoreCheckpointIO`` and resuming, a Hugging Face ``Trainer``
saving through ``FmstoreCallback`` into a ``CheckpointManager``."""

from __future__ import annotations

import os

import pytest
import torch
from peer_libs import prepare_trainer_libs

prepare_trainer_libs()  # before either library: the installed torchvision may not load

pl = pytest.importorskip("pytorch_lightning")


# ---- Lightning ----------------------------------------------------------------------------


class TinyModule(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, width: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def _loader(n: int = 24, width: int = 8):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=g)
    y = x.sum(dim=1, keepdim=True)
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=8)  # 3 steps an epoch


def _cloned(tree):  # type: ignore[no-untyped-def]
    """A copy of an optimizer's state dict (its tensors change in place while training)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_cloned(v) for v in tree]
    return tree


def _trainer(max_epochs: int, dirpath: str, io, **kw):  # type: ignore[no-untyped-def]
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=dirpath, save_top_k=-1, save_last=True)
    return pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        plugins=[io],
        callbacks=[ckpt],
        **kw,
    )


def test_lightning_saves_through_fmstore_and_resumes(tmp_path):
    import fmstore
    from fmstore.integrations.lightning import FmstoreCheckpointIO

    pl.seed_everything(1)
    dirpath = str(tmp_path / "ckpts")
    io = FmstoreCheckpointIO()
    model = TinyModule()
    trainer = _trainer(2, dirpath, io)
    trainer.fit(model, _loader())
    assert trainer.global_step == 6
    names = sorted(os.listdir(dirpath))
    assert names == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    for n in names:  # each one an fmstore checkpoint (a directory with its manifest)
        assert os.path.isfile(os.path.join(dirpath, n, "manifest.json"))

    raw = fmstore.load(os.path.join(dirpath, "epoch=1-step=6.ckpt"))
    assert raw["global_step"] == 6 and raw["epoch"] == 1
    assert raw["hyper_parameters"] == {"width": 8, "lr": 0.05}
    for k, v in model.state_dict().items():
        assert torch.equal(raw["state_dict"][k], v)
    opt_state = _cloned(trainer.optimizers[0].state_dict())

    # Resume from the step-6 checkpoint and train a third epoch.
    resumed = TinyModule()
    t2 = _trainer(3, dirpath, FmstoreCheckpointIO())
    seen = {}

    class Probe(pl.Callback):  # type: ignore[misc]
        def on_train_start(self, trainer, module):  # type: ignore[no-untyped-def]
            seen["step"] = trainer.global_step
            seen["weights"] = {k: v.clone() for k, v in module.state_dict().items()}
            seen["optim"] = _cloned(trainer.optimizers[0].state_dict())

    t2.callbacks.append(Probe())
    t2.fit(resumed, _loader(), ckpt_path=os.path.join(dirpath, "epoch=1-step=6.ckpt"))
    assert seen["step"] == 6
    for k, v in model.state_dict().items():
        assert torch.equal(seen["weights"][k], v)
    for pid, st in opt_state["state"].items():
        for name, val in st.items():
            assert torch.equal(torch.as_tensor(seen["optim"]["state"][pid][name]), val)
    assert t2.global_step == 9
    assert os.path.isdir(os.path.join(dirpath, "epoch=2-step=9.ckpt"))
