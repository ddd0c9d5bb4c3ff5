"""transformers' ``Trainer`` under DDP on 2 ranks (torchrun, gloo, CPU) saving through
``FmstoreCallback``: world process zero saves each step once, with every rank's RNG states
and data position; a launch SIGKILLed once step 6 is committed and exported resumes, after
the NVMe copy is wiped, from the Lustre copy on both ranks, bit-exact with an uninterrupted
run of the same script (another launch) at the same step, and the next 3 steps' losses
match it exactly.  Nothing but fmstore checkpoints is written.

Under FSDP2 (the FSDP2 test, 2 ranks likewise) every rank saves its own shards, RNG states and data position in one
fmstore DCP checkpoint through a ``ShardedCheckpointManager``; ``fmstore daemon --once``
exports step 6 to Lustre while the job waits; the job is SIGKILLed, the NVMe copy wiped,
and a relaunch restores from Lustre on both ranks, bit-exact (each rank's shards and the
gathered full state) with an uninterrupted run of the same script at the same step, with
the same next 3 losses.  Nothing but fmstore checkpoints is written.

On CPU Accelerate never turns FSDP on (its state is ``MULTI_CPU``); the worker sets what it
sets on an accelerator (tests/hf_fsdp_worker.py: ``_fsdp_on_cpu``), and the rest of the
Trainer's FSDP2 path is the library's own."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from stack_support import assert_same, files, wait_for  # noqa: E402

from fmstore.testing.cluster import kill_tree  # noqa: E402
from fmstore.testing.torchrun import launch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "hf_rank_worker.py")
FSDP_WORKER = os.path.join(HERE, "hf_fsdp_worker.py")
AT = 6  # the step the killed launch commits last (epoch 1, batch 2 of 4 on each rank)
ROOT = "runs/hf"
#: What the Trainer writes when it saves by itself (and DCP, Lightning): none may appear.
NATIVE = (
    "pytorch_model.bin", "model.safetensors", "optimizer.pt", "scheduler.pt",
    "trainer_state.json", "rng_state*.pth", "checkpoint-*", ".metadata", "*.distcp", "meta.pt",
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
        "TOKENIZERS_PARALLELISM": "false",
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


def test_trainer_ddp_saves_once_and_resumes_bit_exact_from_lustre(tmp_path):
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
    saved = fmstore.load(str(_manifest(job, "lustre", AT).parent))
    assert saved["step"] == AT and saved["world_size"] == 2
    assert set(saved["ranks"]) == {"0", "1"}
    for rank in (0, 1):
        want = torch.load(out / f"ref-state-{rank}.pt", weights_only=False)
        got = torch.load(out / f"resume-state-{rank}.pt", weights_only=False)
        assert want["step"] == got["step"] == AT
        assert got["tier"] == ("lustre" if rank == 0 else None)
        for part in ("model", "optimizer", "scheduler", "rng"):
            _equal(want[part], got[part], f"rank {rank} {part}")
        assert got["epoch"] == pytest.approx(want["epoch"])
        _equal(saved["model"], want["model"], "saved model")
        # Each rank's RNG as that rank had it, under its own key (they differ).
        assert not torch.equal(
            saved["ranks"]["0"]["rng"]["torch"], saved["ranks"]["1"]["rng"]["torch"]
        )
        _equal(saved["ranks"][str(rank)]["rng"]["torch"], want["rng"]["torch"], f"rank {rank} rng")
        assert saved["ranks"][str(rank)]["data"] == {"epoch": 1, "batch": 2}
        ref_losses = json.loads((out / f"ref-losses-{rank}.json").read_text())
        res_losses = json.loads((out / f"resume-losses-{rank}.json").read_text())
        nxt = [str(s) for s in range(AT + 1, AT + 4)]
        assert [res_losses[s] for s in nxt] == [ref_losses[s] for s in nxt], rank
        assert min(int(s) for s in res_losses) == AT + 1  # trained from step 7 on

    # Saved once per step, by world process zero only; nothing else written.
    assert _manifest(job, "nvme", 8).exists()  # the resumed run saves on
    for mode in ("kill", "resume", "ref"):
        assert "AlreadyExists" not in (tmp_path / f"{mode}.log").read_text(), mode
    _no_native_files(job, other)
    print(f"3 launches of 2 ranks: {took:.1f} s")


# ---- in one process: the per-rank records, another world size ---------------------------


def test_rank_rng_states_round_trip_and_bad_ones_are_refused(tmp_path):
    import random

    import numpy as np

    import fmstore
    from fmstore.errors import CorruptData
    from fmstore.integrations import rank_state

    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    random.gauss(0, 1)  # a cached gauss value is part of the state
    fmstore.save({"rng": rank_state.rng_state()}, str(tmp_path / "c"))
    want = (random.random(), random.gauss(0, 1), float(np.random.rand()), torch.rand(3))
    back = fmstore.load(str(tmp_path / "c"))["rng"]  # weights_only
    rank_state.apply_rng(back)
    got = (random.random(), random.gauss(0, 1), float(np.random.rand()), torch.rand(3))
    assert got[:3] == want[:3] and torch.equal(got[3], want[3])

    # A checkpoint is outside input: a state that does not fit sets no RNG at all.
    before = (random.getstate(), torch.get_rng_state())
    bad_py = {**back, "python": {**back["python"], "state": torch.full((625,), 1 << 40)}}
    with pytest.raises(CorruptData, match="python.state"):
        rank_state.apply_rng(bad_py)
    with pytest.raises(CorruptData, match="rng"):
        rank_state.apply_rng({**back, "torch": torch.zeros(3, dtype=torch.uint8)})
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])


def _args(**kw: Any) -> Any:
    import types

    return types.SimpleNamespace(
        **{"world_size": 1, "gradient_accumulation_steps": 1, "fsdp": [], **kw}
    )


def test_resume_on_another_world_size_says_which_ranks_it_could_not_restore(tmp_path):
    from tiering_helpers import posix_config
    from transformers import TrainerControl, TrainerState

    from fmstore import CheckpointManager
    from fmstore.integrations import rank_state
    from fmstore.integrations.hf import FmstoreCallback, training_state

    config = posix_config(str(tmp_path / "t"), {"ladder": ["nvme", "lustre"]}, ("nvme", "lustre"))
    st = TrainerState()
    st.global_step = 5
    rec = {"rng": rank_state.rng_state(), "data": {"epoch": 1, "batch": 1}}
    with CheckpointManager("runs/ws", config=config, run_policies=False) as mgr:
        ckpt = training_state(torch.nn.Linear(3, 2), None, None, st, ranks={"0": rec, "1": rec})
        mgr.save(5, ckpt).result()
        cb = FmstoreCallback(mgr, resume=True)
        fresh = TrainerState()
        dl = torch.utils.data.DataLoader(list(range(8)), batch_size=2)  # 4 batches
        with pytest.warns(RuntimeWarning) as seen:
            cb.on_train_begin(_args(), fresh, TrainerControl(), model=torch.nn.Linear(3, 2),
                              train_dataloader=dl)  # fmt: skip
        text = str(seen[0].message)
        assert "saved on 2 rank(s) and resumes on 1" in text, text
        assert "rank(s) 0 are not restored" in text and "rank(s) 0-1 are not used" in text, text
        assert "epoch 1, batch 1" in text, text
        assert fresh.global_step == 5 and cb.restored_step == 5
        torch.manual_seed(9)
        seeded = torch.get_rng_state()
        cb.on_step_begin(_args(), fresh, TrainerControl())
        assert torch.equal(torch.get_rng_state(), seeded)  # no other world's RNG mixed in


# ---- FSDP2 -----------------------------------------------------------------------------


def _fsdp_env(tiers: Path) -> dict[str, str]:
    return {
        **os.environ,
        "FMSTORE_CONFIG": str(tiers / "fmstore.toml"),
        "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "FSDP_VERSION": "2",  # what `accelerate launch` sets for fsdp_version: 2
    }


def _fsdp_start(tmp: Path, mode: str, tiers: Path) -> Any:
    work = tiers / "work"
    work.mkdir(exist_ok=True)
    log = open(tmp / f"{mode}.log", "w")  # noqa: SIM115 (closed with the launch)
    p = launch(FSDP_WORKER, [mode, str(tmp / "out"), str(AT)], nproc=2, env=_fsdp_env(tiers),
               cwd=str(work), stdout=log)  # fmt: skip
    p.log = log  # type: ignore[attr-defined]
    return p


def test_trainer_fsdp2_saves_shards_on_every_rank_and_resumes_bit_exact_from_lustre(tmp_path):
    from fmstore.checkpoint.dcp.api import load_full_state_dict

    job, other, out = tmp_path / "job", tmp_path / "ref", tmp_path / "out"
    for d in (job, other, out):
        d.mkdir()
        _config(d)
    t0 = time.monotonic()
    ref = _fsdp_start(tmp_path, "ref", other)
    killed = _fsdp_start(tmp_path, "kill", job)
    try:
        for r in (0, 1):  # step AT committed and recorded; the job waits before step AT+1
            _wait_for(out / f"waiting-{r}", killed, tmp_path, "kill")
        daemon = subprocess.run(
            [sys.executable, "-m", "fmstore", "daemon", "--once", "--no-http"],
            env=_fsdp_env(job), cwd=str(job / "work"), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert daemon.returncode == 0, daemon.stderr[-4000:]
        assert _manifest(job, "lustre", AT).exists(), daemon.stderr[-4000:]  # exported
    finally:
        kill_tree(killed.pid)
        killed.wait()
        killed.log.close()
    _finish(ref, tmp_path, "ref")

    # The NVMe copy is lost: every rank must restore from Lustre.
    assert _manifest(job, "nvme", AT).exists()
    shutil.rmtree(job / "nvme" / ROOT)
    resumed = _fsdp_start(tmp_path, "resume", job)
    _finish(resumed, tmp_path, "resume")
    took = time.monotonic() - t0

    # One checkpoint: both ranks' shards, the Trainer's part once, each rank's own record.
    saved = load_full_state_dict(str(_manifest(job, "lustre", AT).parent))
    assert set(saved) == {"model", "optimizer", "trainer", "ranks"}
    assert set(saved["ranks"]) == {"0", "1"}
    recs = [torch.load(io.BytesIO(saved["ranks"][str(r)])) for r in (0, 1)]
    trainer = torch.load(io.BytesIO(saved["trainer"]))
    assert trainer["step"] == AT and trainer["world_size"] == 2
    assert [r["data"] for r in recs] == [{"epoch": 1, "batch": 2}] * 2
    assert not torch.equal(recs[0]["rng"]["torch"], recs[1]["rng"]["torch"])
    for rank in (0, 1):
        want = torch.load(out / f"ref-state-{rank}.pt", weights_only=False)
        got = torch.load(out / f"resume-state-{rank}.pt", weights_only=False)
        assert want["sharded"] and got["sharded"]  # FSDP2: every parameter a DTensor
        assert want["step"] == got["step"] == AT
        assert got["tier"] == "lustre"  # every rank read Lustre's copy
        for part in ("shards", "optimizer", "full_model", "full_optimizer", "scheduler", "rng"):
            _equal(want[part], got[part], f"rank {rank} {part}")
        assert got["epoch"] == pytest.approx(want["epoch"])
        _equal(saved["model"], want["full_model"], "the saved model, gathered")
        _equal(trainer["scheduler"], want["scheduler"], "the saved scheduler")
        ref_losses = json.loads((out / f"ref-losses-{rank}.json").read_text())
        res_losses = json.loads((out / f"resume-losses-{rank}.json").read_text())
        nxt = [str(s) for s in range(AT + 1, AT + 4)]
        assert [res_losses[s] for s in nxt] == [ref_losses[s] for s in nxt], rank
        assert min(int(s) for s in res_losses) == AT + 1

    assert _manifest(job, "nvme", 8).exists()  # the resumed run saves on
    _no_native_files(job, other)
    print(f"3 launches of 2 ranks and a daemon pass: {took:.1f} s")


# ---- in one process: what is refused, before anything is saved ---------------------------


@pytest.fixture
def one_rank(monkeypatch):  # type: ignore[no-untyped-def]
    """A 1-rank gloo group in this process, gone after the test."""
    import torch.distributed as dist

    from fmstore.checkpoint.dcp import collective
    from fmstore.testing.seaweed import free_ports

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_ports(1)[0]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        collective._groups.clear()  # the checkpoint group of that world is gone with it


def _fsdp_begin(cb: Any, model: Any) -> None:
    from transformers import TrainerControl, TrainerState

    cb.on_train_begin(_args(), TrainerState(), TrainerControl(), model=model)


def test_a_sharded_model_with_a_checkpoint_manager_or_fsdp1_is_refused(tmp_path, one_rank):
    from tiering_helpers import posix_config
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    from fmstore import CheckpointManager, ShardedCheckpointManager
    from fmstore.errors import FmstoreError
    from fmstore.integrations.hf import FmstoreCallback

    config = posix_config(str(tmp_path / "t"), {"ladder": ["nvme"]}, ("nvme",))
    sharded = fully_shard(torch.nn.Linear(3, 2))
    with CheckpointManager("runs/fsdp", config=config, run_policies=False) as mgr:
        # A CheckpointManager saves a full state dict from one process: never part of one.
        with pytest.raises(FmstoreError, match="give the root .* ShardedCheckpointManager"):
            _fsdp_begin(FmstoreCallback(mgr), sharded)
        assert mgr.steps() == []
    fsdp1 = FullyShardedDataParallel(torch.nn.Linear(3, 2), device_id=torch.device("cpu"))
    with pytest.raises(FmstoreError, match="FSDP2"):
        _fsdp_begin(FmstoreCallback("runs/fsdp1", config=config), fsdp1)
    # A ShardedCheckpointManager with a model DDP or one process trains is refused too.
    smgr = ShardedCheckpointManager("runs/s", config=config, handle_sigterm=False)
    with smgr, pytest.raises(FmstoreError, match="not sharded"):
        _fsdp_begin(FmstoreCallback(smgr), torch.nn.Linear(3, 2))
    assert not (tmp_path / "t" / "nvme" / "runs").exists()  # nothing saved anywhere


def test_a_rank_the_saved_run_did_not_have_reads_no_record_and_a_bad_part_is_refused(
    tmp_path, one_rank
):
    from tiering_helpers import posix_config
    from torch.distributed.fsdp import fully_shard

    from fmstore import ShardedCheckpointManager
    from fmstore.errors import CorruptData
    from fmstore.integrations import hf_sharded, rank_state

    config = posix_config(str(tmp_path / "t"), {"ladder": ["nvme"]}, ("nvme",))
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    part = {"step": 4, "world_size": 1, "scheduler": {"last_epoch": 4}}
    rec = rank_state.capture({"epoch": 0, "batch": 4})
    with ShardedCheckpointManager("runs/r", config=config, handle_sigterm=False) as mgr:
        mgr.save(4, hf_sharded.state(model, opt, part, rec)).result()
        want = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        step, got_part, got = hf_sharded.restore(mgr, model, opt, 0, True)  # type: ignore[misc]
        assert step == 4 and got_part == part and got["data"] == rec["data"]
        assert all(torch.equal(v.full_tensor(), want[k]) for k, v in model.state_dict().items())
        # rank 1 of a larger world: the saved run had no rank 1, so no record (no error)
        assert hf_sharded.restore(mgr, model, opt, 1, True)[2] is None  # type: ignore[index]
        # a Trainer's part that is not the step's is outside input: refused
        mgr.save(6, hf_sharded.state(model, opt, {**part, "step": 5}, rec)).result()
        with pytest.raises(CorruptData, match="step 6"):
            hf_sharded.restore(mgr, model, opt, 0, True)
