"""The multi-node quickstart of docs/distributed.md runs as written: its ``train.py`` on two
nodes of one rank each (gloo, CPU; processes the test spawns with the environment torchrun
gives), with its config (paths moved under the test's directory); a relaunch with more steps
restores the last step and goes on from the next one."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
from gloo_ranks import run

from fmstore.testing.seaweed import free_ports

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

DOC = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"


def blocks() -> tuple[str, str]:
    """The quickstart's config and its train.py."""
    text = DOC.read_text()
    toml = re.search(r"## Quickstart.*?```toml\n(.*?)```", text, re.S)
    script = re.search(r"<!-- quickstart: train.py.*?-->\n```python\n(.*?)```", text, re.S)
    assert toml and script, "the quickstart's blocks are not in docs/distributed.md"
    return toml.group(1), script.group(1)


def train(rank: int, script: str) -> int | None:
    return runpy.run_path(script, run_name="__main__")["done"]


def test_the_quickstart_trains_saves_and_resumes_on_two_nodes(tmp_path):
    toml, script = blocks()
    train_py = tmp_path / "train.py"
    train_py.write_text(script)
    envs = []
    for node in ("n0", "n1"):
        cfg = tmp_path / f"{node}.toml"
        cfg.write_text(
            toml.replace("/var/lib/fmstore", f"{tmp_path}/{node}/state")
            .replace("/local_nvme", f"{tmp_path}/{node}/nvme")
            .replace("/fsx", f"{tmp_path}/fsx")
        )
        envs.append({"FMSTORE_CONFIG": str(cfg), "FMSTORE_NODE_ID": node, "LOCAL_RANK": "0"})

    def launch(steps: int) -> list[int | None]:
        port = free_ports(1)[0]
        for r, env in enumerate(envs):
            env.update(
                RANK=str(r),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                STEPS=str(steps),
            )
        return run(train, envs, str(train_py), init=None)

    assert launch(3) == [None, None]  # a fresh run: steps 0 (every=100) and 2 (the last)
    runs = tmp_path / "n0" / "nvme" / "fmstore" / "runs" / "quickstart"
    assert sorted(p.name for p in runs.iterdir()) == [f"step_{s:012d}" for s in (0, 2)]
    assert launch(5) == [2, 2]  # restored step 2 on every rank, went on from step 3
    for node in ("n0", "n1"):
        nvme = tmp_path / node / "nvme" / "fmstore"
        assert (nvme / "runs" / "quickstart" / f"step_{4:012d}" / "manifest.json").is_file()
        # replicas = 1: this node holds the other node's part of the newest step
        assert (nvme / ".replicas" / "runs" / "quickstart" / f"step_{4:012d}").is_dir()
