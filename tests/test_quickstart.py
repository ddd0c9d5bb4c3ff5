"""The multi-node quickstart of docs/distributed.md runs as written: its config (paths moved
under the test's directory), its ``train.py``, and its launch block's ``export`` and
``torchrun`` lines with only the rendezvous endpoint, ``--nproc-per-node`` and the id
substituted, on two nodes (``torchrun`` agents on loopback) of one rank each, meeting at the
doc's own ``TCPStore`` one-liner ("the login node").

One sequence: a fresh launch saves steps 0 and 2; a relaunch with more steps restores step
2 and goes on; once step 100 is committed, node n1 is SIGKILLed (agent and rank) and the
doc's lines are run again for it: n0's agent, whose rank failed, rejoins the same
rendezvous with it, every rank restores the newest step and trains on until both ranks,
sent SIGTERM, save once more and exit 0."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fmstore.testing.seaweed import free_ports
from fmstore.testing.torchrun import descendants, kill_all, start

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

DOC = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"
#: The doc's torchrun line, token by token, with the three tokens this test substitutes.
TORCHRUN = [
    "torchrun", "--nnodes=2", "--nproc-per-node={nproc}", "--rdzv-backend=c10d",
    "--rdzv-endpoint={endpoint}", "--rdzv-conf=is_host=false", "--rdzv-id={id}",
    "--max-restarts=3", "train.py",
]  # fmt: skip
SUBSTITUTED = {
    "--nproc-per-node=8": "--nproc-per-node={nproc}",
    "--rdzv-endpoint=login1:29400": "--rdzv-endpoint={endpoint}",
    "--rdzv-id=$JOB_ID": "--rdzv-id={id}",
}
NODES = ("n0", "n1")


def blocks() -> tuple[str, str, str, str]:
    """The quickstart's config, its launch block, the store one-liner and train.py."""
    text = DOC.read_text()
    toml = re.search(r"## Quickstart.*?```toml\n(.*?)```", text, re.S)
    launch = re.search(r"<!-- quickstart: launch.*?-->\n```bash\n(.*?)```", text, re.S)
    store = re.search(r"the store the agents meet at:\n`python -c '(.*?)'`", text, re.S)
    script = re.search(r"<!-- quickstart: train.py.*?-->\n```python\n(.*?)```", text, re.S)
    assert toml and launch and store and script, "the quickstart's blocks are not in the doc"
    return toml.group(1), launch.group(1), store.group(1).replace("\n", " "), script.group(1)


def parse_launch(block: str) -> tuple[dict[str, str], list[str]]:
    """The variables the block exports (values as written) and its torchrun line."""
    exports: dict[str, str] = {}
    lines = [ln for ln in block.replace("\\\n", " ").splitlines() if not ln.startswith("#")]
    for ln in lines:
        if ln.startswith("export "):
            for word in shlex.split(ln)[1:]:
                k, _, v = word.partition("=")
                exports[k] = v
    (line,) = [ln for ln in lines if ln.startswith("torchrun ")]
    return exports, shlex.split(line)


def test_the_quickstart_trains_resumes_and_a_lost_node_relaunched_rejoins(tmp_path):
    toml, launch_block, store_py, script = blocks()
    exports, words = parse_launch(launch_block)
    # The doc's line keeps its shape: only the three substituted tokens differ.
    assert [SUBSTITUTED.get(w, w) for w in words] == TORCHRUN, words
    assert set(exports) == {
        "FMSTORE_CONFIG",
        "FMSTORE_NODE_ID",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    }
    assert exports["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"

    (tmp_path / "train.py").write_text(script)
    port = free_ports(1)[0]
    store = subprocess.Popen(
        [sys.executable, "-c", store_py.replace("29400", str(port)).replace("0.0.0.0", "127.0.0.1")]
    )

    def command(job: str) -> list[str]:
        values = {"nproc": "1", "endpoint": f"127.0.0.1:{port}", "id": job}
        cmd = [SUBSTITUTED[w].format_map(values) if w in SUBSTITUTED else w for w in words]
        return [sys.executable, "-m", "torch.distributed.run", *cmd[1:]]  # the venv's torchrun

    envs = {}
    for node in NODES:
        cfg = tmp_path / f"{node}.toml"
        cfg.write_text(
            toml.replace("/var/lib/fmstore", f"{tmp_path}/{node}/state")
            .replace("/local_nvme", f"{tmp_path}/{node}/nvme")
            .replace("/fsx", f"{tmp_path}/fsx")
        )
        values = {"FMSTORE_CONFIG": str(cfg), "FMSTORE_NODE_ID": node}
        envs[node] = {**os.environ, **{k: values.get(k, v) for k, v in exports.items()}}
    runs = {n: tmp_path / n / "nvme" / "fmstore" / "runs" / "quickstart" for n in NODES}

    def agent(node: str, steps: int, launch: str) -> subprocess.Popen[str]:
        log = open(tmp_path / f"{launch}-{node}.log", "w")  # noqa: SIM115 (the child holds it)
        env = {**envs[node], "STEPS": str(steps), "OMP_NUM_THREADS": "1"}
        # A launch of the whole job takes a new rendezvous id; a relaunched node, the same.
        p = start(command(launch), cwd=tmp_path, env=env, stdout=log)
        time.sleep(0.2)  # the rendezvous orders agents on one host by pid
        return p

    def logs(launch: str) -> str:
        return "\n".join((tmp_path / f"{launch}-{n}.log").read_text()[-3000:] for n in NODES)

    def committed(step: int) -> bool:
        return all((runs[n] / f"step_{step:012d}" / "manifest.json").is_file() for n in NODES)

    def wait(cond, procs, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert all(p.poll() is None for p in procs), f"a node exited before {what}"
            assert time.monotonic() < deadline, f"{what}: never happened"
            time.sleep(0.05)

    agents: list[subprocess.Popen[str]] = []
    try:
        # A fresh run: steps 0 (every=100) and 2 (the last).
        agents = [agent(n, 3, "fresh") for n in NODES]
        assert [p.wait(300) for p in agents] == [0, 0], logs("fresh")
        assert sorted(p.name for p in runs["n0"].iterdir()) == [
            "step_000000000000",
            "step_000000000002",
        ]
        # A relaunch with more steps restores step 2 (a fresh start would save step 0 again
        # and fail) and goes on.
        agents = [agent(n, 10**7, "long") for n in NODES]
        wait(lambda: committed(100), agents, "step 100's commit")
        kill_all(agents[1])  # node n1 lost: its agent and its rank
        agents[1].wait()
        newest = max(
            int(p.name[5:]) for p in runs["n1"].iterdir() if (p / "manifest.json").exists()
        )
        agents[1] = agent("n1", 10**7, "long")  # the same lines, on the replacement
        wait(lambda: committed(newest + 100), agents, "a save after the relaunch")
        # SIGTERM to both ranks: they agree on it, save once more and stop.
        ranks = [pid for a in agents for pid in descendants(a.pid)
                 if b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
                 and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
                 == str(a.pid)]  # fmt: skip
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        assert [p.wait(300) for p in agents] == [0, 0], logs("long")
    finally:
        for p in agents:
            kill_all(p)
        store.kill()
        store.wait()
    # n0's rank failed when n1 was lost, and its agent (exit 0) restarted it into the round
    # the relaunched n1 joined.
    assert "failed (exitcode: 1)" in (tmp_path / "long-n0.log").read_text(), logs("long")
    last = max(int(p.name[5:]) for p in runs["n0"].iterdir() if (p / "manifest.json").exists())
    assert last > newest + 100 and committed(last), last  # the save on SIGTERM
    for node in NODES:  # replicas = 1: each node holds the other's part of the newest step
        nvme = tmp_path / node / "nvme" / "fmstore"
        assert (nvme / ".replicas" / "runs" / "quickstart" / f"step_{last:012d}").is_dir()
