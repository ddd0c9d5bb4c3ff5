"""Background work keeps to idle CPU and I/O: a training process's policies run in a helper
process at SCHED_IDLE, nice 19 and the idle I/O class (the daemon's own threads are checked in
test_tiering_daemon); the helper goes when its trainer closes the manager or dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from tiering_helpers import posix_config, state

from fmstore.config import Config
from fmstore.errors import ConfigError
from fmstore.tiering import metrics as m
from fmstore.tiering.copy.transfer import TransferOptions
from fmstore.tiering.managers.manager import CheckpointManager
from fmstore.tiering.policy.policies import from_config
from fmstore.tiering.service import priority
from fmstore.tiering.service.helper import PolicyHelper, decode, encode

EXPORT = {"export": [{"to": "lustre", "every_saves": 1}]}


def copies_here() -> float:
    return sum(s.value for f in m.COPIES.collect() for s in f.samples if s.name.endswith("_total"))


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_policies_run_in_a_helper_process_at_idle_priority(tmp_path):
    cfg = posix_config(str(tmp_path), EXPORT)
    before = copies_here()
    with CheckpointManager("r", config=cfg, policy_interval=0.1) as mgr:
        helper = mgr._background
        assert isinstance(helper, PolicyHelper)
        for s in (1, 2, 3):
            mgr.save(s, state(s))
        assert mgr.wait_for_policies(120)
        assert mgr.steps("lustre") == [1, 2, 3]
        # every thread of the helper, the copying ones included, runs at background priority
        tids = [int(t) for t in os.listdir(f"/proc/{helper.pid}/task")]
        assert len(tids) > 1
        for tid in tids:
            assert priority.current(tid) == {"nice": 19, "idle_scheduler": True, "io_class": "idle"}
        # the copies were made by the helper: none in this process, no policy thread here
        assert copies_here() == before
        assert not [t for t in threading.enumerate() if t.name == "fmstore-policies"]
        assert priority.current()["nice"] == 0
        pid = helper.pid
    assert gone(pid)  # close() stopped it and reaped it


def test_priority_and_thread_mode_follow_the_settings(tmp_path):
    base = posix_config(str(tmp_path), EXPORT)
    cfg = Config(
        tiers=base.tiers,
        state_dir=base.state_dir,
        sections={**base.sections, "daemon": {"priority": "low"}},
    )
    with CheckpointManager("r", config=cfg, policy_interval=0.1) as mgr:
        mgr.save(1, state(1))
        assert mgr.wait_for_policies(120)
        assert priority.current(mgr._background.pid) == {
            "nice": 19,
            "idle_scheduler": False,
            "io_class": "best-effort",
        }
    with CheckpointManager("r2", config=cfg, policy_interval=0.1, run_policies="thread") as mgr:
        mgr.save(1, state(1))
        assert mgr.wait_for_policies(120)
        assert mgr.steps("lustre") == [1]
        assert [t for t in threading.enumerate() if t.name == "fmstore-policies"]
    with pytest.raises(ValueError, match="run_policies"):
        CheckpointManager("r3", config=cfg, run_policies="fork")  # type: ignore[arg-type]
    bad = Config(base.tiers, base.state_dir, {**base.sections, "daemon": {"priority": "high"}})
    with pytest.raises(ConfigError, match="priority must be one of idle, low, normal"):
        CheckpointManager("r4", config=bad)


TRAINER = r"""
import sys, time
from tiering_helpers import posix_config, state
from fmstore.tiering.managers.manager import CheckpointManager
mgr = CheckpointManager("r", config=posix_config(sys.argv[1], {"export": [{"to": "lustre", "every_saves": 1}]}), policy_interval=0.1)
mgr.save(1, state(1)).result()
print(mgr._background.pid, flush=True)
time.sleep(3600)
"""


def test_the_helper_exits_when_its_trainer_is_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert trainer.stdout is not None
        helper_pid = int(trainer.stdout.readline())
        assert not gone(helper_pid)
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    # its stdin reaches end of file: it finishes the copy in flight and exits
    assert wait_gone(helper_pid)


def test_settings_travel_as_plain_json_of_known_types_only(tmp_path):
    cfg = posix_config(str(tmp_path), {**EXPORT, "retention": {"nvme": {"keep_latest": 2}}})
    pol = from_config(cfg)
    topts = TransferOptions(concurrency=4, bwlimit=1e6)
    wire = json.dumps(encode({"config": cfg, "policies": pol, "transfer": topts}))
    back = decode(json.loads(wire))
    assert back == {"config": cfg, "policies": pol, "transfer": topts}
    with pytest.raises(ValueError, match="unknown type"):
        decode({"@": "Popen", "args": ["sh"]})
    with pytest.raises(TypeError, match="cannot be sent"):
        encode(object())
