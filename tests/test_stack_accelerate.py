"""Accelerate's own training loop on 2 ranks (torchrun, gloo, CPU) saving with
``accelerator.save_state`` through fmstore (``fmstore.integrations.accelerate.attach``):
the main process saves each step once, as one manager checkpoint, with every rank's RNG
states and data position; a launch SIGKILLed once step 8 is committed and exported resumes,
after the NVMe copy is wiped, from the Lustre copy on both ranks, bit-exact with an
uninterrupted run of the same script (another launch) at the same step, and the next 3
steps' losses match it exactly.  None of Accelerate's own files is written anywhere.
Then, in one process: the refusals (tier URLs Accelerate would make a local directory of,
FSDP, options fmstore would not honour)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from stack_support import assert_same, files, wait_for  # noqa: E402

from fmstore.testing.cluster import kill_tree  # noqa: E402
from fmstore.testing.torchrun import launch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "accelerate_rank_worker.py")
AT = 8  # the step the killed launch commits last (epoch 1, batch 2 of 6 on each rank)
ROOT = "runs/acc"
#: What Accelerate's save_state writes by itself: none may appear.
NATIVE = (
    "pytorch_model*.bin", "model*.safetensors", "optimizer*.bin", "scheduler*.bin",
    "sampler*.bin", "scaler.pt", "random_states_*.pkl", "custom_checkpoint_*.pkl",
    "dl_state_dict*.bin", "nvme:*", "lustre:*",
)  # fmt: skip


def _config(tmp: Path) -> Path:
    cfg = tmp / "fmstore.toml"
    cfg.write_text(
        f"""
state_dir = "{tmp}/state"
[tiers.nvme]
url = "{tmp}/nvme"
[tiers.lustre]
url = "{tmp}/lustre"
[policies]
[[policies.export]]
to = "lustre"
every_steps = 2
"""
    )
    return cfg


def _manifest(tmp: Path, tier: str, step: int) -> Path:
    return tmp / tier / ROOT / f"step_{step:012d}" / "manifest.json"


def _start(tmp: Path, mode: str, tiers: Path) -> Any:
    """A launch of ``mode`` with the tiers (and working directory) under ``tiers``."""
    work = tiers / "work"
    work.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "FMSTORE_CONFIG": str(tiers / "fmstore.toml"),
        "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)]),
        "OMP_NUM_THREADS": "1",
    }
    log = open(tmp / f"{mode}.log", "w")  # noqa: SIM115 (closed with the launch)
    p = launch(WORKER, [mode, str(tmp / "out"), str(AT)], nproc=2, env=env, cwd=str(work),
               stdout=log)  # fmt: skip
    p.log = log  # type: ignore[attr-defined]
    return p


def _finish(p: Any, tmp: Path, mode: str, timeout: float = 300) -> None:
    try:
        rc = p.wait(timeout=timeout)
    except Exception:
        kill_tree(p.pid)
        raise
    finally:
        p.log.close()
    assert rc == 0, (tmp / f"{mode}.log").read_text()[-6000:]


def _wait_for(path: Path, p: Any, tmp: Path, mode: str, timeout: float = 300) -> None:
    wait_for(path, p, log=tmp / f"{mode}.log", timeout=timeout)


_equal = assert_same


def _no_native_files(*dirs: Path) -> None:
    found = files(dirs, lambda f: any(f.match(pat) for pat in NATIVE))
    assert not found, f"fmstore was bypassed: {found}"


def test_accelerate_ddp_saves_once_and_resumes_bit_exact_from_lustre(tmp_path):
    import fmstore

    job, other = tmp_path / "job", tmp_path / "ref"
    for d in (job, other, tmp_path / "out"):
        d.mkdir()
        _config(d)
    t0 = time.monotonic()
    # The uninterrupted reference (tiers of its own) and the launch to be killed side by side.
    ref = _start(tmp_path, "ref", other)
    killed = _start(tmp_path, "kill", job)
    try:
        _wait_for(_manifest(job, "lustre", AT), killed, tmp_path, "kill")  # exported
    finally:
        kill_tree(killed.pid)
        killed.wait()
        killed.log.close()
    _finish(ref, tmp_path, "ref")

    # The NVMe copy is lost: the resume must come from Lustre.
    assert _manifest(job, "nvme", AT).exists()
    shutil.rmtree(job / "nvme" / ROOT)
    resumed = _start(tmp_path, "resume", job)
    _finish(resumed, tmp_path, "resume")
    took = time.monotonic() - t0

    out = tmp_path / "out"
    saved = fmstore.load(str(_manifest(job, "lustre", AT).parent))  # weights_only
    assert saved["step"] == AT and saved["world_size"] == 2
    assert set(saved["ranks"]) == {"0", "1"}
    assert saved["custom"] == [{"batches": AT}]
    assert not torch.equal(  # each rank's RNG, under its own key
        saved["ranks"]["0"]["rng"]["torch"], saved["ranks"]["1"]["rng"]["torch"]
    )
    for rank in (0, 1):
        want = torch.load(out / f"ref-state-{rank}.pt", weights_only=False)
        got = torch.load(out / f"resume-state-{rank}.pt", weights_only=False)
        assert want["step"] == got["step"] == AT
        for part in ("model", "optimizer", "scheduler", "rng"):
            _equal(want[part], got[part], f"rank {rank} {part}")
        for part in ("seen", "accelerator_step", "iteration", "sampler"):
            assert want[part] == got[part], (rank, part, want[part], got[part])
        assert got["iteration"] == 1 and got["sampler"] == (0, 1)  # epoch 1 of seed 0
        # Accelerate keeps (and saves) the model it was given, not its DDP wrapper.
        unwrapped = {k.removeprefix("module."): v for k, v in want["model"].items()}
        _equal(dict(saved["models"][0]), unwrapped, "saved model")
        _equal(saved["ranks"][str(rank)]["rng"]["torch"], want["rng"]["torch"], f"rank {rank}")
        ref_losses = json.loads((out / f"ref-losses-{rank}.json").read_text())
        res_losses = json.loads((out / f"resume-losses-{rank}.json").read_text())
        nxt = [str(s) for s in range(AT + 1, AT + 4)]
        assert [res_losses[s] for s in nxt] == [ref_losses[s] for s in nxt], rank
        assert min(int(s) for s in res_losses) == AT + 1  # trained from step 9 on

    # Saved once per step, by the main process only; nothing else written.
    assert _manifest(job, "nvme", 10).exists()  # the resumed run saves on
    for mode in ("kill", "resume", "ref"):
        assert "AlreadyExists" not in (tmp_path / f"{mode}.log").read_text(), mode
    _no_native_files(job, other)
    print(f"3 launches of 2 ranks: {took:.1f} s")


# ---- in one process: refusals -------------------------------------------------------------


@pytest.fixture
def one_process(tmp_path, monkeypatch):
    """An Accelerator of one CPU process with fmstore's tiers under ``tmp_path``; the
    working directory is ``tmp_path/work`` (nothing may appear there) and os.environ is
    given back as it was (Accelerate writes its variables there)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    _config(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("FMSTORE_CONFIG", str(tmp_path / "fmstore.toml"))
    from fmstore import config

    config.set_config(None)
    before = dict(os.environ)
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    yield acc, model, opt, tmp_path
    import fmstore.integrations.accelerate as fa

    fa.close(acc)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    os.environ.clear()
    os.environ.update(before)
    config.set_config(None)
    assert not list(work.iterdir()), list(work.iterdir())


def test_a_tier_url_never_becomes_a_local_directory(one_process):
    import fmstore.integrations.accelerate as fa
    from fmstore.errors import ConfigError

    acc, model, opt, tmp = one_process
    fa.attach(acc)
    with pytest.raises(ConfigError, match="step_N"):
        acc.save_state("nvme:runs/acc")  # no step to name the checkpoint by
    with pytest.raises(ConfigError, match="configured tiers|nosuch"):
        acc.save_state("nosuch:runs/acc/step_1")
    with pytest.raises(ConfigError, match="not a local directory"):
        fa.save_state(acc, "s3://bucket/runs/acc", 1)
    with pytest.raises(ConfigError, match="not a local directory"):
        fa.save_state(acc, str(tmp / "abs"), 1)
    assert not (tmp / "abs").exists()

    # Routed: the tier URL is a checkpoint of the run on that tier, named by its step.
    assert acc.save_state("nvme:runs/acc/step_3") == "nvme:runs/acc/step_3"
    fa.close(acc)
    assert _manifest(tmp, "nvme", 3).exists()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    assert acc.load_state("lustre:runs/acc") == 3  # the newest step, from any tier
    _equal(model.state_dict(), want, "model")
    assert fa.load_state(acc, "runs/acc", 3) == 3
    assert fa.load_state(acc, "runs/none") is None  # nothing to resume
    _no_native_files(tmp)


def test_what_it_would_not_save_faithfully_is_refused(one_process):
    import fmstore.integrations.accelerate as fa
    from fmstore.errors import FmstoreError, NotSupported

    acc, model, opt, tmp = one_process
    handle = acc.register_save_state_pre_hook(lambda models, weights, d: None)
    with pytest.raises(NotSupported, match="register_for_checkpointing"):
        fa.save_state(acc, "runs/acc", 1)
    handle.remove()
    acc.project_configuration.total_limit = 2
    with pytest.raises(NotSupported, match="retention"):
        fa.save_state(acc, "runs/acc", 1)
    acc.project_configuration.total_limit = None
    from accelerate.utils import DistributedType

    with pytest.MonkeyPatch.context() as mp:  # only this patch: the fixture's env stays
        mp.setattr(type(acc), "distributed_type", property(lambda self: DistributedType.FSDP))
        with pytest.raises(NotSupported, match="FSDP.*ShardedCheckpointManager"):
            fa.save_state(acc, "runs/acc", 1)
    assert os.environ["FMSTORE_CONFIG"] == str(tmp / "fmstore.toml")

    # A checkpoint of other objects is refused before anything is loaded.
    fa.save_state(acc, "runs/acc", 1).result()
    acc.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(opt.optimizer, 1))
    with torch.no_grad():
        model.weight.fill_(7.0)
    with pytest.raises(FmstoreError, match="registered objects"):
        fa.load_state(acc, "runs/acc")
    assert torch.all(model.weight == 7.0)
    assert not _manifest(tmp, "nvme", 2).exists()
