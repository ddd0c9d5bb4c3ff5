"""A step is committed when its manifest validates, whatever the catalog says: a save killed
between its commit and its catalog record (the record blocked on a catalog lock held here,
then SIGKILL) is found by a restarted manager in every ``run_policies`` mode, restored, and
the job goes on saving; ``latest_step()`` right after an async save is that step."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import torch
from tiering_helpers import posix_config, state

from fmstore import runtime
from fmstore.tiering.inventory import catalog as cat
from fmstore.tiering.managers.manager import CheckpointManager

ROOT = "runs/x"
STEP = 5

# The save pickles the gate once its catalog row says ``writing`` (pickle=True is how a
# state holds an object the format does not): the gate hands control to the test there.
SAVER = """
import sys, torch
from fmstore.config import from_dict
from fmstore.tiering.managers.manager import CheckpointManager

class Gate:
    def __reduce__(self):
        print("writing", flush=True)
        sys.stdin.readline()
        return (int, (0,))

base, root, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = from_dict({"tiers": {t: {"url": f"{base}/{t}"} for t in ("nvme", "lustre", "s3")},
                 "state_dir": f"{base}/state", "policies": {}})
mgr = CheckpointManager(root, config=cfg, run_policies=False, async_save=False,
                        save_options={"pickle": True})
mgr.save(step, {"w": torch.arange(1000.0), "gate": Gate()})
print("recorded", flush=True)
"""


def row(base: str) -> str | None:
    db = sqlite3.connect(os.path.join(base, "state", cat.DB_NAME))
    try:
        got = db.execute(
            "SELECT state FROM copies WHERE root = ? AND step = ? AND tier = 'nvme'", (ROOT, STEP)
        ).fetchone()
    finally:
        db.close()
    return got[0] if got else None


def kill_between_commit_and_record(base: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVER, base, ROOT, str(STEP)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "writing\n"
        assert row(base) == cat.WRITING
        lock = sqlite3.connect(os.path.join(base, "state", cat.DB_NAME), isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # every catalog write waits for it (busy_timeout)
        try:
            proc.stdin.write("\n")
            proc.stdin.flush()
            step_dir = os.path.join(base, "nvme", ROOT, f"step_{STEP:012d}")
            manifest = os.path.join(step_dir, "manifest.json")
            deadline = time.monotonic() + 60
            while not os.path.exists(manifest):  # the commit: the event waited for
                assert proc.poll() is None, "the saving process exited before its commit"
                assert time.monotonic() < deadline, "the save never committed"
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(60) == -signal.SIGKILL
        finally:
            lock.execute("ROLLBACK")
            lock.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert row(base) == cat.WRITING  # committed on the tier, never recorded


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> str:
    """What one save killed between its commit and its record left (each mode a copy)."""
    base = str(tmp_path_factory.mktemp("killed"))
    kill_between_commit_and_record(base)
    return base


@pytest.mark.parametrize("mode", [True, "thread", False], ids=["process", "thread", "off"])
def test_a_step_committed_but_recorded_as_writing_is_found_by_a_restarted_manager(
    killed, tmp_path, mode
):
    here = str(tmp_path / "node")
    shutil.copytree(killed, here)
    with CheckpointManager(ROOT, config=posix_config(here, {}), run_policies=mode) as mgr:
        assert mgr.latest_step() == STEP  # the docs' loop: restore, then go on from there
        state = mgr.restore(weights_only=False)
        assert mgr.restored_step == STEP
        assert torch.equal(state["w"], torch.arange(1000.0))
        assert mgr.catalog.copy(ROOT, STEP, "nvme").state == cat.PRESENT
        mgr.save(mgr.restored_step + 1, state).result()
        assert mgr.steps() == [STEP, STEP + 1]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process
def test_the_sharded_manager_counts_a_step_only_when_its_manifest_validates(tmp_path):
    from fmstore import ShardedCheckpointManager

    base = str(tmp_path)
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{base}/state"\n'
        f'[tiers.nvme]\nurl = "{base}/nvme"\nscope = "node"\n'
        f'[tiers.lustre]\nurl = "{base}/lustre"\n'
    )
    with ShardedCheckpointManager("run", config=str(cfg), handle_sigterm=False) as mgr:
        mgr.save(10, {"w": torch.arange(10.0)})
        mgr.wait()
        assert mgr.latest_step() == 10
        ten = tmp_path / "nvme" / "run" / f"step_{10:012d}" / "manifest.json"
        # a file named manifest.json that is no manifest, and step 10's manifest without
        # its blobs: neither is a commit
        for tier, step, data in (
            ("nvme", 20, b""),
            ("lustre", 30, ten.read_bytes()),
        ):
            d = tmp_path / tier / "run" / f"step_{step:012d}"
            d.mkdir(parents=True)
            (d / "manifest.json").write_bytes(data)
        assert mgr.latest_step() == 10


def test_latest_step_right_after_an_async_save_is_that_step(tmp_path, monkeypatch):
    import types

    from fmstore.tiering.managers import manager

    cfg = posix_config(str(tmp_path), {}, tiers=("nvme",))
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        assert mgr.latest_step() is None  # the tiers are scanned now, not under the block
        started, release = threading.Event(), threading.Event()

        async def hold_the_loop() -> None:
            started.set()
            release.wait()  # blocks fmstore's loop: the save cannot commit meanwhile

        # The save is held until latest_step() either waits for it or has read the catalog.
        def wait(*a, **kw):
            release.set()
            return cf.wait(*a, **kw)

        def copies(*a, _orig=mgr.catalog.copies, **kw):
            out = _orig(*a, **kw)
            release.set()
            return out

        import concurrent.futures as cf

        monkeypatch.setattr(manager, "cf", types.SimpleNamespace(**{**vars(cf), "wait": wait}))
        monkeypatch.setattr(mgr.catalog, "copies", copies)
        held = runtime.submit(hold_the_loop())
        started.wait()
        mgr.save(1, state(1))
        assert mgr.latest_step() == 1
        held.result(60)
        monkeypatch.undo()
