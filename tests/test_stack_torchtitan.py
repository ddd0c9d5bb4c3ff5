"""torchtitan 0.3.0's checkpointing through ``FmstoreCheckpointManager`` on 2 gloo ranks.

torchtitan's ``Trainer`` needs CUDA, so ``torchtitan_worker.py`` drives the manager the way
``Trainer.train`` does, with an FSDP2 model and torchtitan's own optimizer, LR scheduler and
dataloader containers; its config differs from stock torchtitan by the one documented line.
A launch saving asynchronously is SIGKILLed once step 4 is committed and the real ``fmstore
daemon`` has exported it to Lustre (and retained NVMe by ``[policies]``); the NVMe copy is
wiped; the resume (pinned-memory mode) restores step 4 from Lustre bit for bit against an
uninterrupted reference launch (synchronous saves) at the same step, and the next 3 losses
are the reference's.  No torch-native file (``.metadata``, ``*.distcp``) and no torchtitan
``step-N`` name appears anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan.components.checkpointer")
pytest.importorskip("torchtitan.components.optimizer")  # spmd_types
pytest.importorskip("torchtitan.components.dataloader")  # torchdata

from stack_support import files, rank_env, same, wait_for  # noqa: E402
from torchtitan.components.checkpointer import (  # noqa: E402
    BaseCheckpointManager,
    CheckpointManager,
)
from torchtitan.config import Configurable  # noqa: E402

from fmstore.testing.torchrun import kill_all, launch  # noqa: E402

WORKER = str(Path(__file__).with_name("torchtitan_worker.py"))
ROOT = "runs/titan"
AT = 4


def _config(tmp: Path) -> Path:
    cfg = tmp / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp}/state"\n'
        f'[tiers.nvme]\nurl = "{tmp}/nvme"\n'
        f'[tiers.lustre]\nurl = "{tmp}/lustre"\n'
        '[daemon]\ninterval = "0.2s"\n'
        '[policies]\nladder = ["nvme", "lustre"]\n'
        '[[policies.export]]\nto = "lustre"\nevery_steps = 2\n'
        "[policies.retention.nvme]\nkeep_latest = 1\n"
    )
    return cfg


def _env(cfg: Path) -> dict[str, str]:
    return rank_env(cfg)


def _manifest(tmp: Path, tier: str, root: str, step: int) -> Path:
    return tmp / tier / root / f"step_{step:012d}" / "manifest.json"


def _wait_for(path: Path, procs: list[Any], timeout: float = 240) -> None:
    wait_for(path, procs, timeout=timeout)


def _wait_for_gone(path: Path, procs: list[Any], timeout: float = 240) -> None:
    wait_for(path, procs, gone=True, timeout=timeout)


def _foreign(base: Path) -> list[str]:
    """torch's native DCP files and torchtitan's own step names, anywhere under ``base``."""
    return files([base], lambda f: f.name == ".metadata" or f.suffix == ".distcp"
                 or f.name.startswith("step-"))  # fmt: skip


_same = same


def test_torchtitan_manager_saves_kills_and_resumes_from_lustre(tmp_path):
    cfg = _config(tmp_path)
    env = _env(cfg)
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()  # every launch's working directory: nothing may land there either

    def start(mode: str, root: str, how: str) -> subprocess.Popen[str]:
        return launch(
            WORKER, [mode, f"nvme:{root}", str(out), how], nproc=2, env=env, cwd=str(work)
        )

    # the node's daemon, running throughout the first two launches
    daemon = subprocess.Popen(
        [sys.executable, "-m", "fmstore", "daemon", "--no-http"],
        env=env, cwd=str(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    ref = start("ref", "runs/ref", "disabled")  # uninterrupted, in parallel
    killed = start("kill", ROOT, "async")
    try:
        # step 4 committed and exported, step 2 exported and gone from NVMe by retention
        _wait_for(_manifest(tmp_path, "lustre", ROOT, AT), [killed, daemon])
        _wait_for(_manifest(tmp_path, "lustre", ROOT, 2), [killed, daemon])
        _wait_for_gone(_manifest(tmp_path, "nvme", ROOT, 2).parent, [killed, daemon])
        for r in (0, 1):
            _wait_for(out / f"waiting_{r}", [killed])
        kill_all(killed)
        rout, _ = ref.communicate(timeout=240)
        assert ref.returncode == 0, rout
    finally:
        for p in (ref, killed):
            kill_all(p)
        killed.communicate()
        daemon.terminate()  # before the resume, whose saves it would tier
        dout, _ = daemon.communicate(timeout=60)
    assert "step-" not in dout and '"not_counted": {}' in dout, dout

    nvme = tmp_path / "nvme" / ROOT
    lustre = tmp_path / "lustre" / ROOT
    # the daemon found torchtitan's steps by their names: exported both, and NVMe's
    # retention (keep_latest = 1, not torchtitan's keep_latest_k purge) kept only step 4
    assert sorted(os.listdir(lustre)) == ["step_000000000002", "step_000000000004"]
    assert sorted(os.listdir(nvme)) == ["step_000000000004"]
    shutil.rmtree(tmp_path / "nvme" / "runs" / "titan")  # the node's NVMe copy is lost

    p = start("resume", ROOT, "async_with_pinned_mem")
    try:
        log, _ = p.communicate(timeout=240)
    finally:
        kill_all(p)
    assert p.returncode == 0, log

    for r in (0, 1):
        assert (out / f"restored_from_{r}").read_text() == "lustre"
        saved = torch.load(out / f"kill_{r}.pt", weights_only=True)
        reference = torch.load(out / f"ref_{r}.pt", weights_only=True)
        restored = torch.load(out / f"restored_{r}.pt", weights_only=True)
        assert restored["step"] == AT and restored["data"] == {"i": AT * 4}
        assert _same(saved, reference), r  # the same script, killed or not
        assert _same(restored, saved), r  # model, optimizer, LR, dataloader, train_state
        ref_losses = json.loads((out / f"losses_ref_{r}.json").read_text())
        resumed = json.loads((out / f"losses_resume_{r}.json").read_text())
        assert sorted(resumed) == ["5", "6", "7"]
        assert [resumed[s] for s in ("5", "6", "7")] == [ref_losses[s] for s in ("5", "6", "7")]

    # the resume saved step 6 (pinned mode) and the final step 7 (model only) through fmstore
    assert _manifest(tmp_path, "nvme", ROOT, 6).is_file()
    assert _manifest(tmp_path, "nvme", ROOT, 7).is_file()
    assert _foreign(tmp_path) == []
    assert not any(f.name.startswith("nvme:") for f in tmp_path.rglob("*"))
    assert list(work.iterdir()) == []
    assert not (out / "dump").exists()  # torchtitan's dump_folder is not a checkpoint place


def test_config_refuses_what_would_bypass_fmstore():
    from fmstore.errors import ConfigError, NotSupported
    from fmstore.integrations.torchtitan import FmstoreCheckpointManager

    Config = FmstoreCheckpointManager.Config
    assert Config(folder="nvme:runs/a").keep_latest_k == 0
    with pytest.raises(NotSupported, match=r"keep_latest_k=5.*\[policies.retention"):
        Config(folder="nvme:runs/a", keep_latest_k=5)
    for name in ("last_save_in_hf", "initial_load_in_hf"):
        with pytest.raises(NotSupported, match=name):
            Config(folder="runs/a", **{name: True})
    with pytest.raises(NotSupported, match="initial_load_path"):
        Config(folder="runs/a", initial_load_path="/ckpt/step-10")
    for folder in ("/abs/ckpt", "./ckpt", "s3://b/ckpt", "fmstore://nvme/runs/a"):
        with pytest.raises(ConfigError, match="TIER:ROOT"):
            Config(folder=folder)
    with pytest.raises(ValueError, match="async_mode"):
        Config(folder="runs/a", async_mode="sometimes")  # type: ignore[arg-type]


def test_dataloader_pickle_with_objects_is_refused():
    import pickle

    from fmstore.errors import CorruptData
    from fmstore.integrations.torchtitan import _CheckedLoader

    class Loader:
        got: Any = None

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, s: dict[str, Any]) -> None:
            self.got = s

    plain = {"dp_rank_0": pickle.dumps({"a": [1, 2.5, "x", None, (3,)]}), "world_size": 2}
    loader = Loader()
    _CheckedLoader(loader, allow_pickle=False).load_state_dict(plain)
    assert loader.got == plain
    evil = {"dp_rank_0": pickle.dumps({"a": os.getcwd}), "world_size": 2}  # a callable
    loader = Loader()
    with pytest.raises(CorruptData, match="dataloader.dp_rank_0.*posix.getcwd"):
        _CheckedLoader(loader, allow_pickle=False).load_state_dict(evil)
    assert loader.got is None
    _CheckedLoader(loader, allow_pickle=True).load_state_dict(evil)  # the opt-in
    assert loader.got is evil


class _Job(Configurable):  # the shape of torchtitan's Trainer.Config
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)


def test_torchtitan_command_line_overrides_keep_the_fmstore_manager():
    """The one line in a config registry survives torchtitan's own CLI parsing (tyro), and
    ``--checkpoint.*`` overrides reach it."""
    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry

    from fmstore.integrations.torchtitan import FmstoreCheckpointManager

    ConfigManager()  # registers torchtitan's tyro rules
    registered = _Job.Config(checkpoint=FmstoreCheckpointManager.Config(folder="nvme:runs/a"))
    args = ["--checkpoint.interval", "7", "--checkpoint.async_mode", "async"]
    got = tyro.cli(_Job.Config, args=args, default=registered, registry=custom_registry)
    assert type(got.checkpoint) is FmstoreCheckpointManager.Config
    assert (got.checkpoint.interval, got.checkpoint.async_mode) == (7, "async")
    assert got.checkpoint.folder == "nvme:runs/a"
