"""megatron-core's own ``dist_checkpointing.save/load`` with ``sharded_strategy=("fmstore",
1)`` on 2 gloo ranks (tensor parallel 2): save, SIGKILL, resume from Lustre after the NVMe
copy is wiped, bit for bit against an uninterrupted run, and loss for loss."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("megatron.core.dist_checkpointing")
torch = pytest.importorskip("torch")

from stack_support import rank_env, same, wait_for  # noqa: E402

from fmstore.testing.torchrun import kill_all, launch  # noqa: E402

WORKER = str(Path(__file__).with_name("megatron_worker.py"))
ROOT = "runs/meg"


def _config(tmp: Path) -> Path:
    cfg = tmp / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp}/state"\n'
        f'[tiers.nvme]\nurl = "{tmp}/nvme"\n'
        f'[tiers.lustre]\nurl = "{tmp}/lustre"\n'
        '[policies]\nladder = ["nvme", "lustre"]\n'
    )
    return cfg


def _env(cfg: Path) -> dict[str, str]:
    return rank_env(cfg, PYTHONWARNINGS="ignore")


def _wait_for(path: Path, p, timeout: float = 240) -> None:  # type: ignore[no-untyped-def]
    wait_for(path, p, timeout=timeout)


def _stray_files(base: Path) -> list[str]:
    """torch_dist's and megatron-core's own files anywhere; megatron-core's metadata.json
    only as its marker beside a committed fmstore manifest (it writes it itself after the
    strategy returns: docs/integrations.md)."""

    def stray(f: Path) -> bool:
        if f.name in (".metadata", "common.pt") or f.suffix == ".distcp":
            return True
        return f.name == "metadata.json" and not (f.parent / "manifest.json").is_file()

    return [str(f) for f in base.rglob("*") if stray(f)]


_same = same


def test_dist_checkpointing_saves_kills_and_resumes_from_lustre(tmp_path):
    from fmstore import runtime
    from fmstore.checkpoint.dcp.api import load_full_state_dict
    from fmstore.checkpoint.layout import step_name
    from fmstore.config import load_config
    from fmstore.tiering.exports.mover import copy_checkpoint
    from fmstore.tiering.tiers import Tiers

    cfg = _config(tmp_path)
    env = _env(cfg)
    out = tmp_path / "out"
    out.mkdir()
    nvme = tmp_path / "nvme" / ROOT
    step4 = nvme / step_name(4)

    # The uninterrupted reference (its own run root) beside the launch killed once step 4
    # is committed (it waits after that save, so the kill lands nowhere else).
    ref = launch(WORKER, ["ref", "nvme:runs/ref", str(out)], nproc=2, env=env, cwd=str(tmp_path))
    p = launch(WORKER, ["kill", f"nvme:{ROOT}", str(out)], nproc=2, env=env, cwd=str(tmp_path))
    try:
        _wait_for(out / "waiting_0", p)
        _wait_for(out / "waiting_1", p)
        assert (step4 / "manifest.json").is_file()
        # The daemon's export, done here while the job waits: step 4 to lustre.
        tiers = Tiers(load_config(str(cfg)))
        runtime.run(
            copy_checkpoint(tiers.checkpoint("nvme", ROOT, 4), tiers.checkpoint("lustre", ROOT, 4))
        )
        assert (tmp_path / "lustre" / ROOT / step_name(4) / "manifest.json").is_file()
    finally:
        kill_all(p)
        p.wait()
    log, _ = ref.communicate(timeout=240)
    assert ref.returncode == 0, log

    # One fmstore checkpoint: the shards, the ShardedObjects and megatron-core's common.pt
    # and metadata.json; megatron-core's own marker beside it holds what the checkpoint does.
    full = load_full_state_dict(str(step4))
    assert full["c.weight"].shape == (16, 8)  # the global tensor, from both ranks' shards
    assert {"rng_state/shard_0_2", "rng_state/shard_1_2"} <= set(full)
    common = torch.load(io.BytesIO(full["__megatron__.common.pt"]), weights_only=True)
    assert common["iteration"] == 4
    assert json.loads(full["__megatron__.metadata.json"]) == json.loads(
        (step4 / "metadata.json").read_text()
    )
    assert json.loads((step4 / "metadata.json").read_text())["sharded_backend"] == "fmstore"
    assert _stray_files(tmp_path) == []

    shutil.rmtree(tmp_path / "nvme" / ROOT)  # the NVMe copy is lost

    p = launch(WORKER, ["resume", f"nvme:{ROOT}", str(out)], nproc=2, env=env, cwd=str(tmp_path))
    try:
        log, _ = p.communicate(timeout=240)
    finally:
        kill_all(p)
    assert p.returncode == 0, log

    # Step 4 came back from lustre on every rank exactly as saved, and as the reference had it
    for r in (0, 1):
        saved = torch.load(out / f"kill_saved_{r}.pt", weights_only=True)
        refd = torch.load(out / f"ref_saved_{r}.pt", weights_only=True)
        restored = torch.load(out / f"restored_{r}.pt", weights_only=True)
        assert saved["iteration"] == restored["iteration"] == 4
        for k in ("model", "optim", "torch_rng", "random"):
            assert _same(saved[k], restored[k]), (r, k)
            assert _same(refd[k], restored[k]), (r, k)
    want = json.loads((out / "losses_ref.json").read_text())
    got = json.loads((out / "losses_resume.json").read_text())
    assert sorted(got) == ["5", "6", "7"]
    assert [got[s] for s in ("5", "6", "7")] == [want[s] for s in ("5", "6", "7")]

    # the resumed run saved step 6 through fmstore; nothing went around it
    assert (nvme / step_name(6) / "manifest.json").is_file()
    assert not (nvme / step_name(4)).exists()  # the files written back for the load are gone
    assert _stray_files(tmp_path) == []
    assert not any("nvme:" in f.name for f in tmp_path.rglob("*"))


def test_tier_urls_and_foreign_checkpoints_are_refused_before_anything_is_written(tmp_path):
    from fmstore.config import load_config
    from fmstore.errors import NotSupported
    from fmstore.integrations import megatron

    cfg = load_config(str(_config(tmp_path)))
    save = megatron.FmstoreSaveStrategy(config=cfg)
    with pytest.raises(NotSupported, match="tier URL"):
        save.save({}, "nvme:runs/meg/step_000000000002")
    assert not (tmp_path / "nvme:runs").exists() and not Path("nvme:runs").exists()
    # a tier URL's local directory is what megatron-core is given
    assert megatron.local_dir("nvme:runs/meg/step_000000000002", config=cfg) == str(
        tmp_path / "nvme" / "runs" / "meg" / "step_000000000002"
    )
    with pytest.raises(NotSupported, match="local directory"):
        megatron.local_dir("s3://bucket/runs/meg", config=cfg)
    with pytest.raises(NotSupported, match="'torch_dist' backend"):
        megatron.FmstoreLoadStrategy().check_backend_compatibility("torch_dist")
    # registered beside megatron-core's own, which its look-ups re-register
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction,
        get_default_strategy,
    )

    got = get_default_strategy(StrategyAction.SAVE_SHARDED, "fmstore", 1)
    assert isinstance(got, megatron.FmstoreSaveStrategy)
    assert type(get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1)).__name__ == (
        "TorchDistSaveShardedStrategy"
    )
