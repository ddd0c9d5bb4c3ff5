"""The drain a job's close asks for, run from another directory (real processes).

A trainer in its project directory (``fmstore.toml`` found by the walk) closes with an
export pending and no daemon; its warning names the drain command with ``-c`` and the
config file it used.  Run from ``/`` without ``-c``, ``daemon --drain`` (and ``--check``)
would find the embedded default that no run used: it exits 2 saying so and creates
nothing; the command the warning gave, run from ``/``, drains the export."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

TRAIN = """
import logging, sys
import torch
import fmstore
logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
mgr = fmstore.CheckpointManager("runs/x", run_policies=False)
mgr.save(3, {"w": torch.arange(8)})
mgr.close()
"""


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FMSTORE_")}
    env["HOME"] = str(home)
    return env


def _fmstore(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "fmstore")
    return subprocess.run([exe, *args], cwd="/", env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_close_names_the_config_and_a_drain_from_elsewhere_says_it_found_none(tmp_path):
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    home.mkdir()
    (project / "fmstore.toml").write_text(
        textwrap.dedent(
            """
            state_dir = "state"
            [tiers.nvme]
            url = "nvme"
            [tiers.lustre]
            url = "lustre"
            [[policies.export]]
            to = "lustre"
            every_steps = 1
            """
        )
    )
    env = _env(home)
    r = subprocess.run([sys.executable, "-c", TRAIN], cwd=project, env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"run `(fmstore -c [^`]+ daemon --drain)` on this node", r.stderr)
    assert m, r.stderr[-3000:]
    hinted = shlex.split(m.group(1))
    assert hinted[2] == str(project / "fmstore.toml"), hinted

    for flag in ("--drain", "--check"):
        d = _fmstore(["daemon", flag, "--no-http"], env)
        assert d.returncode == 2, d.stdout + d.stderr
        assert "no catalog under the embedded default config" in d.stderr, d.stderr
        assert f"fmstore -c PATH daemon {flag}" in d.stderr, d.stderr
    assert not (home / ".fmstore").exists()  # nothing created under the default
    assert not (project / "lustre" / "runs/x/step_000000000003/manifest.json").exists()

    d = _fmstore([*hinted[1:], "--no-http", "--timeout", "60"], env)
    assert d.returncode == 0, d.stdout + d.stderr
    assert (project / "lustre" / "runs/x/step_000000000003/manifest.json").is_file()
