"""CheckpointManager: saves on the write tier, policies in a background thread, restore from
the fastest tier with fallbacks, a full write tier, preemption."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from tiering_helpers import on_tier, posix_config, state

import fmstore
from fmstore import CheckpointManager
from fmstore.errors import AlreadyExists, ConfigError, NotFound, TierFull
from fmstore.tiering import catalog as cat
from fmstore.tiering.runner import LOCK_NAME

EXPORT_ALL = {
    "export": [{"to": "lustre", "every_saves": 1}, {"to": "s3", "every_saves": 2}],
    "retention": {"nvme": {"keep_latest": 1}},
}


def same(a, b) -> bool:
    return torch.equal(a["model"]["w"], b["model"]["w"]) and a["step"] == b["step"]


def test_saves_are_exported_and_retained_by_policy_in_the_background(tmp_path):
    cfg = posix_config(str(tmp_path), EXPORT_ALL)
    with CheckpointManager("runs/a", config=cfg, policy_interval=0.1) as mgr:
        for s in (10, 20, 30, 40):
            mgr.save(s, state(s))
        assert mgr.wait_for_policies(60)
        assert mgr.steps() == [10, 20, 30, 40]
        assert mgr.steps("nvme") == [40]
        assert mgr.steps("lustre") == [10, 20, 30, 40]
        assert mgr.steps("s3") == [20, 40]
        assert mgr.latest_step() == 40
        assert same(mgr.restore(), state(40)) and mgr.restored_step == 40
        assert same(mgr.restore(10), state(10)) and mgr.restored_step == 10
    # What the tiers hold, checked on the tiers themselves: committed and verified.
    assert on_tier(cfg, "lustre", "runs/a") == {10: True, 20: True, 30: True, 40: True}
    assert on_tier(cfg, "s3", "runs/a") == {20: True, 40: True}
    assert on_tier(cfg, "nvme", "runs/a") == {40: True}


def test_policies_done_are_seen_at_once_not_an_interval_later(tmp_path):
    """After a step that moved data the background thread looks again at once (the plan
    changed while it acted), as the daemon does: ``wait_for_policies`` returns when the
    work is done, not a ``policy_interval`` later (it took 5 s, the default, per wait)."""
    cfg = posix_config(str(tmp_path), EXPORT_ALL)
    with CheckpointManager("runs/a", config=cfg, policy_interval=3600) as mgr:
        for s in (10, 20):
            mgr.save(s, state(s))
            # Far below the interval, far above the work (two small copies, one delete).
            assert mgr.wait_for_policies(120), s
        assert mgr.steps("lustre") == [10, 20] and mgr.steps("nvme") == [20]


def test_sync_save_and_duplicate_step(tmp_path):
    cfg = posix_config(str(tmp_path), {})
    with CheckpointManager("r", config=cfg, async_save=False, run_policies=False) as mgr:
        h = mgr.save(1, state(1))
        assert h.done() and mgr.steps("nvme") == [1]
        with pytest.raises(AlreadyExists):
            mgr.save(1, state(1))
        mgr.save(1, state(2), overwrite=True)
        assert torch.equal(mgr.restore(1)["model"]["w"], state(2)["model"]["w"])


def test_restore_on_an_empty_root_is_not_found(tmp_path):
    with CheckpointManager("r", config=posix_config(str(tmp_path), {}), run_policies=False) as m:
        assert m.latest_step() is None
        with pytest.raises(NotFound, match="no checkpoint"):
            m.restore()


def test_bad_policies_fail_before_anything_is_written(tmp_path):
    cfg = posix_config(str(tmp_path), {})
    bad = {**cfg.sections, "policies": {"export": [{"to": "glacier", "every_saves": 1}]}}
    from fmstore.config import Config

    with pytest.raises(ConfigError, match="'glacier', which is not configured"):
        CheckpointManager("r", config=Config(cfg.tiers, cfg.state_dir, bad))
    assert not os.path.exists(tmp_path / "nvme") and not os.path.exists(tmp_path / "state")


def _corrupt_one_blob(root: str) -> str:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            if f.endswith(".bin"):
                p = os.path.join(dirpath, f)
                with open(p, "r+b") as fh:
                    fh.seek(100)
                    b = fh.read(1)
                    fh.seek(100)
                    fh.write(bytes([b[0] ^ 0xFF]))
                return p
    raise AssertionError("no blob found")


def test_corrupt_copy_on_the_fast_tier_falls_back_to_the_next_tier(tmp_path):
    cfg = posix_config(str(tmp_path), {"export": [{"to": "lustre", "every_saves": 1}]})
    with CheckpointManager("r", config=cfg, policy_interval=0.1) as mgr:
        mgr.save(5, state(5))
        assert mgr.wait_for_policies(60)
        _corrupt_one_blob(str(tmp_path / "nvme" / "r"))
        got = mgr.restore()
        assert same(got, state(5))
        assert mgr.catalog.copy("r", 5, "nvme").state == cat.CORRUPT
        assert mgr.tiers_of(5) == ["lustre"]


def test_restore_falls_back_to_an_older_step_when_every_copy_of_the_newest_is_bad(tmp_path):
    cfg = posix_config(str(tmp_path), {})
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
        mgr.wait()
        os.remove(tmp_path / "nvme" / "r" / "step_000000000002" / "manifest.json")
        assert same(mgr.restore(), state(1)) and mgr.restored_step == 1
        with pytest.raises(NotFound, match="step 2"):
            mgr.restore(2)


def test_a_new_node_finds_checkpoints_on_the_tiers_without_a_catalog(tmp_path):
    cfg = posix_config(str(tmp_path), {"export": [{"to": "s3", "every_saves": 1}]})
    with CheckpointManager("r", config=cfg, policy_interval=0.1) as mgr:
        mgr.save(3, state(3))
        assert mgr.wait_for_policies(60)
    # Lose the node: its NVMe and its catalog.
    import shutil

    shutil.rmtree(tmp_path / "nvme")
    shutil.rmtree(tmp_path / "state")
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        assert mgr.steps() == [3] and mgr.tiers_of(3) == ["s3"]
        assert same(mgr.restore(), state(3))


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_restore_from_a_slow_tier_keeps_a_copy_on_the_cache_tier(tmp_path, mode):
    pol = {
        "export": [{"to": "s3", "every_saves": 1}],
        "release": {"nvme": {"after": 0.001}},
        "restore": {"mode": mode, "cache_tier": "nvme"},
    }
    cfg = posix_config(str(tmp_path), pol)
    with CheckpointManager("r", config=cfg, policy_interval=0.1) as mgr:
        mgr.save(7, state(7, n=50_000))
        assert mgr.wait_for_policies(60)
        assert mgr.catalog.copy("r", 7, "nvme").state == cat.RELEASED
        assert mgr.tiers_of(7) == ["s3"]
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        got = mgr.restore()
        assert torch.equal(got["model"]["w"], state(7, n=50_000)["model"]["w"])
        assert got["step"] == 7
        assert mgr.tiers_of(7) == ["nvme", "s3"]
    assert on_tier(cfg, "nvme", "r") == {7: True}


def test_a_daemon_holding_the_runner_lock_keeps_the_training_process_from_moving_data(tmp_path):
    cfg = posix_config(str(tmp_path), {"export": [{"to": "lustre", "every_saves": 1}]})
    os.makedirs(cfg.state_dir, exist_ok=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import filelock, sys; l = filelock.FileLock(sys.argv[1]); l.acquire(); "
            "print('held', flush=True); sys.stdin.read()",
            os.path.join(cfg.state_dir, LOCK_NAME),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
    try:
        with CheckpointManager("r", config=cfg, policy_interval=0.05) as mgr:
            mgr.save(1, state(1))
            mgr.wait()
            assert not mgr.wait_for_policies(0.5)  # never idle: it cannot take the lock
            assert mgr.steps("lustre") == []
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    with CheckpointManager("r", config=cfg, policy_interval=0.05) as mgr:
        assert mgr.wait_for_policies(60)
        assert mgr.steps("lustre") == [1]


# ---- a full write tier ---------------------------------------------------------------------


@pytest.fixture
def small_nvme(tmp_path):
    """A 2 MiB tmpfs as the nvme tier (needs root); skipped where mounting is not allowed."""
    d = tmp_path / "nvme"
    d.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield str(d)
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_full_nvme_with_on_full_fail_raises_a_clear_error_and_keeps_what_was_committed(
    tmp_path, small_nvme
):
    cfg = posix_config(str(tmp_path), {"on_full": "fail"})
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        mgr.save(1, state(1, n=1000))
        mgr.wait()
        with pytest.raises(TierFull, match="on_full = 'fallback'") as e:
            mgr.save(2, state(2, n=1_000_000))  # 4 MB of floats: cannot fit
        assert e.value.tier == "nvme"
        assert mgr.steps() == [1]
        assert same(mgr.restore(), state(1, n=1000))


def test_full_nvme_with_on_full_fallback_writes_to_the_next_tier(tmp_path, small_nvme):
    cfg = posix_config(str(tmp_path), {"on_full": "fallback"})
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        mgr.save(1, state(1, n=1000))
        h = mgr.save(2, state(2, n=1_000_000))
        mgr.wait()
        assert h.tier == "lustre"
        assert mgr.tiers_of(1) == ["nvme"] and mgr.tiers_of(2) == ["lustre"]
        assert same(mgr.restore(), state(2, n=1_000_000))


def test_a_write_tier_that_fills_during_a_sync_save_falls_back_and_leaves_nothing_behind(
    tmp_path, small_nvme
):
    # Compression is off and the estimate is fooled by a state that is mostly one shared
    # storage viewed twice... simpler: fill the tier after the check by writing a file.
    cfg = posix_config(str(tmp_path), {"on_full": "fallback"})
    with CheckpointManager(
        "r", config=cfg, run_policies=False, async_save=False, save_options={"compression": "raw"}
    ) as mgr:
        big = state(3, n=400_000)  # 1.6 MB
        # Leave ~1.7 MB free so the pre-check passes, then take most of it.
        filler = os.path.join(small_nvme, "filler")
        h = None
        with open(filler, "wb") as f:
            f.write(b"\0" * (1 << 20))
        try:
            import shutil

            if shutil.disk_usage(small_nvme).free < 1_700_000:
                h = mgr.save(3, big)
        finally:
            os.remove(filler)
        if h is None:
            pytest.skip("tmpfs too large for this scenario")
        assert h.tier == "lustre"
        assert mgr.tiers_of(3) == ["lustre"]
        leftovers = [f for _, _, fs in os.walk(small_nvme) for f in fs]
        assert leftovers == []


# ---- preemption ------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from fmstore import CheckpointManager
    from fmstore.config import from_dict
    base = sys.argv[1]
    cfg = from_dict({"tiers": {"nvme": {"url": base + "/nvme"}, "lustre": {"url": base + "/lustre"}},
                     "state_dir": base + "/state"})
    st = {"w": torch.zeros(100), "step": 0}
    mgr = CheckpointManager("r", config=cfg, run_policies=False,
                            save_on_sigterm=lambda: (st["step"], st))
    for i in range(1, 10**9):
        st["w"] += 1
        st["step"] = i
        if i == 5:
            print("ready", flush=True)
        time.sleep(0.01)
    """
)


def test_sigterm_saves_the_current_state_before_the_process_ends(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"ready"
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == -signal.SIGTERM  # the default action still ends the process
    cfg = posix_config(str(tmp_path), {}, tiers=("nvme", "lustre"))
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        step = mgr.latest_step()
        assert step is not None and step >= 5
        got = mgr.restore()
        assert got["step"] == step and float(got["w"][0]) == step
    assert fmstore.CheckpointManager is CheckpointManager
