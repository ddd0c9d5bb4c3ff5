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
from tiering_helpers import on_tier, posix_config, state, with_tier

import fmstore
from fmstore import CheckpointManager
from fmstore.errors import AlreadyExists, ConfigError, NotFound, TierFull
from fmstore.tiering.inventory import catalog as cat
from fmstore.tiering.policy.runner import LOCK_NAME

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


# ---- the redo of a step restore fell back from -----------------------------------------


def _damage(cfg, tier: str, root: str, step: int, how: str) -> None:
    """Damage the copy of ``step`` on ``tier`` through its store (a directory or a bucket):
    ``blob`` flips a byte of a data blob, ``torn`` truncates the manifest, ``uncommitted``
    removes it (what a kill mid-save leaves)."""
    from fmstore import runtime
    from fmstore.stores.base import PutOptions
    from fmstore.tiering.tiers import Tiers

    tiers = Tiers(cfg)
    store = tiers.checkpoint(tier, root, step)

    async def go() -> None:
        try:
            if how == "uncommitted":
                await store.delete("manifest.json")
            elif how == "torn":
                data = await store.get("manifest.json")
                await store.put("manifest.json", data[: len(data) // 2], PutOptions())
            else:
                key = next(k for k in await store.list_keys() if k.endswith(".bin"))
                data = bytearray(await store.get(key))
                data[len(data) // 2] ^= 0xFF
                await store.put(key, bytes(data), PutOptions())
        finally:
            await tiers.close()

    runtime.run(go())


def _s3_write_tier(tmp_path, s3_server, s3_bucket):
    cfg = posix_config(str(tmp_path), {}, tiers=("s3",))
    return with_tier(cfg, "s3", f"s3://{s3_bucket}/fm", **s3_server.store_options())


def _redo_after_fallback(cfg, tier: str, how: str) -> None:
    """Steps 10 and 15 saved, 15's only copy damaged (``how``); a new manager restores 10
    and the training loop's redo of 15 commits.  A damaged copy is cleared out of the
    redo's way; one never committed (no manifest) did not block it and is left alone."""
    moved = [] if how == "uncommitted" else [15]
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        mgr.save(10, state(10))
        mgr.save(15, state(15))
    _damage(cfg, tier, "r", 15, how)
    # A new process: the newest step's only copy is bad, the restore falls back ...
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        assert same(mgr.restore(), state(10)) and mgr.restored_step == 10
        assert mgr.moved_aside == moved
        # ... and the training loop's redo of step 15 commits (it raised AlreadyExists
        # in the background, from wait() and close(), against a damaged copy).
        mgr.save(15, state(15))
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        assert same(mgr.restore(), state(15)) and mgr.restored_step == 15
        assert mgr.moved_aside == []
    assert on_tier(cfg, tier, "r") == {10: True, 15: True}


@pytest.mark.parametrize("how", ["blob", "torn", "uncommitted"])
def test_the_redo_of_a_bad_newest_step_saves_after_restore_fell_back(tmp_path, caplog, how):
    cfg = posix_config(str(tmp_path), {}, tiers=("nvme",))
    with caplog.at_level("WARNING", logger="fmstore.checkpoint"):
        _redo_after_fallback(cfg, "nvme", how)
    said = [r for r in caplog.records if getattr(r, "event", None) == "steps_moved_aside"]
    assert len(said) == (0 if how == "uncommitted" else 1)
    aside = tmp_path / "nvme" / ".aside"
    if how == "uncommitted":
        assert not aside.exists()
        return
    # Moved aside (recoverable), not deleted: the orphan sweep removes it after its grace.
    (token,) = os.listdir(aside)
    assert os.listdir(aside / token / "r") == ["step_000000000015"]


@pytest.mark.parametrize("how", ["blob", "uncommitted"])
def test_the_redo_of_a_bad_newest_step_saves_on_an_s3_write_tier(
    tmp_path, s3_server, s3_bucket, how
):
    _redo_after_fallback(_s3_write_tier(tmp_path, s3_server, s3_bucket), "s3", how)


def test_a_redo_that_already_failed_once_against_the_leftover_saves_now(tmp_path):
    """The user's state after the failed run: the redo's failure left the catalog row
    ``deleted`` (save failed), so the next restore never looks at step 15 again; the
    leftover still has to go (its checksums are checked first)."""
    cfg = posix_config(str(tmp_path), {}, tiers=("nvme",))
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        mgr.save(10, state(10))
        mgr.save(15, state(15))
    _damage(cfg, "nvme", "r", 15, "blob")
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        mgr.catalog.set_copy("r", 15, "nvme", cat.DELETED, error=f"{cat.SAVE_FAILED}: x")
        assert mgr.restore()["step"] == 10 and mgr.moved_aside == [15]
        mgr.save(15, state(15))
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        assert same(mgr.restore(), state(15))


def test_a_valid_newer_step_the_restore_passed_over_is_never_moved(tmp_path):
    """A newer step committed and valid that the restore did not choose (here its row says
    corrupt, so it was no candidate) stays where it is, and its redo raises as before."""
    cfg = posix_config(str(tmp_path), {}, tiers=("nvme",))
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        mgr.save(10, state(10))
        mgr.save(15, state(15))
    with CheckpointManager("r", config=cfg, async_save=False, run_policies=False) as mgr:
        mgr.catalog.set_copy("r", 15, "nvme", cat.CORRUPT, error="a read that failed")
        assert mgr.restore()["step"] == 10 and mgr.moved_aside == []
        with pytest.raises(AlreadyExists):
            mgr.save(15, state(15))
    assert on_tier(cfg, "nvme", "r") == {10: True, 15: True}
    assert not os.path.exists(tmp_path / "nvme" / ".aside")


def test_an_explicit_step_restored_moves_nothing(tmp_path):
    cfg = posix_config(str(tmp_path), {}, tiers=("nvme",))
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        mgr.save(10, state(10))
        mgr.save(15, state(15))
    _damage(cfg, "nvme", "r", 15, "blob")
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        assert same(mgr.restore(10), state(10)) and mgr.moved_aside == []
    assert os.path.isdir(tmp_path / "nvme" / "r" / "step_000000000015")


def test_a_torn_newest_step_a_new_catalog_never_counted_is_moved_for_its_redo(tmp_path):
    """With the catalog lost, the rescan never counts step 15 (its manifest does not parse),
    so the restore chooses 10 without trying 15; the torn copy still blocked the redo."""
    import shutil

    cfg = posix_config(str(tmp_path), {}, tiers=("nvme",))
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        mgr.save(10, state(10))
        mgr.save(15, state(15))
    _damage(cfg, "nvme", "r", 15, "torn")
    shutil.rmtree(tmp_path / "state")
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        assert mgr.steps() == [10]
        assert same(mgr.restore(), state(10)) and mgr.moved_aside == [15]
        mgr.save(15, state(15))
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        assert same(mgr.restore(), state(15))
