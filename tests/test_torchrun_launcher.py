"""The one launcher of ranks (fmstore.testing.torchrun): a launch that hangs leaves no
process behind once it is stopped or its timeout fires, ranks (in sessions of their own)
included, and the failure says which timeout fired, with the log's tail."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from fmstore.testing import torchrun as launcher
from fmstore.testing.cluster import MARK_ENV, marked

# A rank that writes its pid, ignores SIGTERM (so only the SIGKILL after the grace ends it)
# and blocks on a pipe nobody ever writes.
RANK = """\
import os, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
r, w = os.pipe()
out = sys.argv[1]
print("rank", os.environ["RANK"], "blocking", flush=True)
with open(os.path.join(out, f"pid-{os.environ['RANK']}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(out, f"pid-{os.environ['RANK']}.tmp"), os.path.join(out, f"pid-{os.environ['RANK']}"))
os.read(r, 1)
"""


@pytest.fixture
def hang(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    out = tmp_path / "out"
    out.mkdir()
    mark = f"launchtest-{uuid.uuid4().hex}"
    env = {**os.environ, MARK_ENV: mark, "OMP_NUM_THREADS": "1"}
    return script, out, mark, env


def _gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in out.glob("pid-*") if not p.name.endswith(".tmp")]


def test_stop_of_a_hung_launch_leaves_no_rank_alive(hang):
    script, out, mark, env = hang
    p = launcher.launch(str(script), [str(out)], nproc=2, env=env)
    try:
        while len(_pids(out)) < 2:  # both ranks up and blocked
            assert p.poll() is None, p.communicate()[0]
            os.sched_yield()
        pids = _pids(out)
        assert all(launcher._alive(pid) for pid in pids)
    finally:
        launcher.stop(p, grace=0.5)
    assert p.returncode is not None
    _gone([p.pid, *pids])
    assert marked(mark) == []


def test_a_launch_past_its_timeout_is_stopped_and_says_so(hang, tmp_path):
    script, out, mark, env = hang
    cmd = launcher.command(str(script), [str(out)], nproc=2)
    log = tmp_path / "launch.log"
    with pytest.raises(launcher.LaunchTimeout) as e:
        launcher.run(cmd, timeout=8, log=log, env=env, grace=0.5)
    assert "timeout of 8 s fired" in str(e.value) and str(log) in str(e.value)
    assert "blocking" in str(e.value) or not _pids(out)  # the log's tail (ranks up: their line)
    _gone(_pids(out))  # whichever ranks started
    assert marked(mark) == []  # nothing of the launch is left, started or not


def test_torchrun_past_its_timeout_returns_minus_one_with_the_reason(hang):
    script, out, mark, env = hang
    rc, log = launcher.torchrun(str(script), [str(out)], nproc=1, timeout=8, env=env, grace=0.5)
    assert rc == -1 and "timeout of 8 s fired" in log
    _gone(_pids(out))
    assert marked(mark) == []
