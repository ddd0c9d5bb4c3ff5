"""Trainer plugins (fmstore.integrations) with the real trainers on CPU: a Lightning
``Trainer`` saving through ``FmstoreCheckpointIO`` and resuming, a Hugging Face ``Trainer``
saving through ``FmstoreCallback`` into a ``CheckpointManager``."""

from __future__ import annotations

import os

import pytest
import torch

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


# ---- Hugging Face transformers ------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 16, length: int = 8, vocab: int = 50) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_trainer(out: str, callback, max_steps: int = 6):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=max_steps,
        save_steps=3,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
    )
    return transformers.Trainer(
        model=model, args=args, train_dataset=_Tokens(), callbacks=[callback]
    )


def test_hf_callback_saves_through_a_manager_and_restores(tmp_path):
    pytest.importorskip("transformers")
    # transformers' Trainer (even TrainingArguments) needs accelerate, which is not a dev
    # dependency yet; the test below drives the same callback protocol without it.
    pytest.importorskip("accelerate")
    from tiering_helpers import posix_config

    from fmstore import CheckpointManager
    from fmstore.integrations.hf import FmstoreCallback, restore

    config = posix_config(
        str(tmp_path / "tiers"), {"ladder": ["nvme", "lustre"]}, ("nvme", "lustre")
    )
    with CheckpointManager("runs/gpt", config=config, run_policies=False) as mgr:
        trainer = _hf_trainer(str(tmp_path / "out"), FmstoreCallback(mgr))
        trainer.train()
        assert mgr.steps() == [3, 6]
        final = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        opt = _cloned(trainer.optimizer.state_dict())

        state = mgr.restore(6)
        assert state["step"] == 6
        for k, v in final.items():
            assert torch.equal(state["model"][k], v), k

        # Into a fresh Trainer: weights, optimizer and scheduler state come back.
        fresh = _hf_trainer(str(tmp_path / "out2"), FmstoreCallback(mgr))
        assert restore(fresh, mgr) == 6
        for k, v in fresh.model.state_dict().items():
            assert torch.equal(v, final[k]), k
        assert fresh.state.global_step == 6
        got = fresh.optimizer.state_dict()
        for pid, st in opt["state"].items():
            for name, val in st.items():
                assert torch.equal(torch.as_tensor(got["state"][pid][name]), val)
        assert fresh.lr_scheduler.last_epoch == trainer.lr_scheduler.last_epoch


def _tiny_gpt2():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg)


def _run_like_the_trainer(model, callback, max_steps: int, opt=None, sched=None):  # type: ignore[no-untyped-def]
    """The callback protocol of ``Trainer._inner_training_loop`` (what Trainer calls when),
    with transformers' own CallbackHandler, TrainerState and DefaultFlowCallback: the Trainer
    itself cannot be built without accelerate."""
    import types

    from transformers import get_linear_schedule_with_warmup
    from transformers.trainer_callback import (
        CallbackHandler,
        DefaultFlowCallback,
        TrainerControl,
        TrainerState,
    )
    from transformers.trainer_utils import IntervalStrategy, SaveStrategy

    args = types.SimpleNamespace(
        save_strategy=SaveStrategy.STEPS,
        logging_strategy=IntervalStrategy.NO,
        eval_strategy=IntervalStrategy.NO,
        logging_first_step=False,
        eval_delay=0,
        save_steps=3,
        logging_steps=500,
        eval_steps=None,
        max_steps=max_steps,
    )
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = sched or get_linear_schedule_with_warmup(opt, 2, max_steps)
    handler = CallbackHandler([DefaultFlowCallback(), callback], model, None, opt, sched)
    state = TrainerState()
    state.max_steps = max_steps
    state.compute_steps(args, max_steps)
    control = handler.on_train_begin(args, state, TrainerControl())
    data = torch.utils.data.DataLoader(_Tokens(), batch_size=4)
    while not control.should_training_stop:
        for batch in data:
            model(**batch).loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            state.global_step += 1
            control = handler.on_step_end(args, state, control)
            if control.should_save:
                control = handler.on_save(args, state, control)
            if control.should_training_stop:
                break
    handler.on_train_end(args, state, control)
    return types.SimpleNamespace(
        model=model, optimizer=opt, lr_scheduler=sched, state=state, args=args
    )


def test_hf_callback_protocol_saves_and_resumes(tmp_path):
    pytest.importorskip("transformers")
    from tiering_helpers import posix_config

    from fmstore import CheckpointManager
    from fmstore.integrations.hf import FmstoreCallback, restore

    config = posix_config(
        str(tmp_path / "tiers"), {"ladder": ["nvme", "lustre"]}, ("nvme", "lustre")
    )
    with CheckpointManager("runs/gpt", config=config, run_policies=False) as mgr:
        first = FmstoreCallback(mgr)
        run = _run_like_the_trainer(_tiny_gpt2(), first, max_steps=6)
        assert run.state.global_step == 6
        first.prepared.result(timeout=60)  # staging prepared after the first step
        assert mgr.steps() == [3, 6]
        final = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
        opt = _cloned(run.optimizer.state_dict())
        state = mgr.restore(6)
        assert state["step"] == 6
        for k, v in final.items():
            assert torch.equal(state["model"][k], v), k

        # restore() into another trainer-like object with its own optimizer and scheduler.
        from transformers import get_linear_schedule_with_warmup

        model2 = _tiny_gpt2()
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        other = type(run)(
            model=model2,
            optimizer=opt2,
            lr_scheduler=get_linear_schedule_with_warmup(opt2, 2, 6),
            state=type(run.state)(),
            args=run.args,
        )
        assert restore(other, mgr) == 6
        for k, v in other.model.state_dict().items():
            assert torch.equal(v, final[k]), k
        assert other.state.global_step == 6
        got = other.optimizer.state_dict()
        for pid, st in opt["state"].items():
            for name, val in st.items():
                assert torch.equal(torch.as_tensor(got["state"][pid][name]), val)
        assert other.lr_scheduler.last_epoch == run.lr_scheduler.last_epoch == 6

        # resume=True: training continues from step 6 up to max_steps=9, saving step 9.
        cb = FmstoreCallback(mgr, resume=True)
        run2 = _run_like_the_trainer(_tiny_gpt2(), cb, max_steps=9)
        assert cb.restored_step == 6
        assert run2.state.global_step == 9
        assert mgr.steps() == [3, 6, 9]


def test_lightning_checkpoint_on_a_tier_url(tmp_path):
    from tiering_helpers import posix_config

    from fmstore.config import set_config
    from fmstore.integrations.lightning import FmstoreCheckpointIO

    set_config(posix_config(str(tmp_path), {}, ("nvme", "s3")))
    try:
        pl.seed_everything(2)
        io = FmstoreCheckpointIO()
        model = TinyModule()
        trainer = _trainer(1, str(tmp_path / "local"), io)
        trainer.fit(model, _loader())
        url = "nvme:runs/a/epoch=0.ckpt"
        trainer.save_checkpoint(url)
        io.wait()
        assert os.path.isfile(tmp_path / "nvme" / "runs" / "a" / "epoch=0.ckpt" / "manifest.json")

        resumed = TinyModule()
        t2 = _trainer(2, str(tmp_path / "local2"), FmstoreCheckpointIO())
        t2.fit(resumed, _loader(), ckpt_path=url)
        assert t2.global_step == 6

        io.remove_checkpoint(url)
        assert not os.path.exists(
            tmp_path / "nvme" / "runs" / "a" / "epoch=0.ckpt" / "manifest.json"
        )
        io.remove_checkpoint(url)  # nothing there: nothing done
    finally:
        set_config(None)


def test_lightning_pickled_values_need_opt_ins(tmp_path):
    import argparse

    from fmstore.integrations.lightning import FmstoreCheckpointIO

    state = {"state_dict": {"w": torch.ones(3)}, "hyper_parameters": argparse.Namespace(lr=0.1)}
    path = str(tmp_path / "x.ckpt")
    with pytest.raises(TypeError, match="hyper_parameters"):
        FmstoreCheckpointIO().save_checkpoint(state, path)
    io = FmstoreCheckpointIO(pickle=True)
    io.save_checkpoint(state, path)
    io.teardown()
    with pytest.raises(Exception, match="weights_only"):
        io.load_checkpoint(path)  # weights_only=True by default: pickles are refused
    assert io.load_checkpoint(path, weights_only=False)["hyper_parameters"].lr == 0.1
    assert (
        FmstoreCheckpointIO(weights_only=False).load_checkpoint(path)["hyper_parameters"].lr == 0.1
    )

    # A torch.save file (written before switching to fmstore) loads too, and is removed.
    old = str(tmp_path / "old.ckpt")
    torch.save({"state_dict": {"w": torch.zeros(2)}}, old)
    assert torch.equal(io.load_checkpoint(old)["state_dict"]["w"], torch.zeros(2))
    io.remove_checkpoint(old)
    io.remove_checkpoint(path)
    assert not os.path.exists(old) and not os.path.exists(path)
