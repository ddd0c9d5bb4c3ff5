"""Nodes of a multi-node job on one host, for tests, benchmarks and the demo.

Each node is a ``torchrun`` agent on loopback with its own environment: its own
``FMSTORE_CONFIG`` (its own ``nvme`` directory with ``scope = "node"`` and its own state
directory), ``FMSTORE_NODE_ID``, and optionally its own ``fmstore daemon``.  Every node
shares one ``lustre`` directory and, where given, one S3 endpoint (SeaweedFS, or a
:class:`~fmstore.testing.faultproxy.FaultProxy` in front of it).

Two things of ``torchrun`` on one host are handled here:

* the c10d rendezvous runs on a ``TCPStore`` the :class:`Cluster` owns and every agent
  joins with ``is_host=false``, so killing any node never takes the rendezvous with it
  (the training processes then give up at their process group's timeout, seconds rather
  than gloo's 30 minutes: ``FMSTORE_CLUSTER_PG_TIMEOUT`` in their environment);
* the rendezvous orders nodes by (host name, agent pid), so agents are started in the order
  of ``nodes`` a moment apart and the first node gets the lowest ranks.

Killing a node is SIGKILL of its agent and every process below it (ranks, their checkpoint
processes), and of its daemon; replacing a node is killing it and wiping its NVMe and state
directory.  Every process the harness starts carries a mark in its environment
(``FMSTORE_CLUSTER_PROC``: cluster, node, role), inherited by everything it starts, so a kill
finds a node's ranks even when they left the agent's tree (each rank runs in a session of its
own, and a rank whose agent died is reparented), and :meth:`Cluster.close` checks that no
process of the harness's is left.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .seaweed import free_ports
from .torchrun import descendants

__all__ = ["Cluster", "S3Tier", "kill_tree"]

#: The environment variable a training process reads its process groups' timeout from.
PG_TIMEOUT_ENV = "FMSTORE_CLUSTER_PG_TIMEOUT"
#: The mark of every process a :class:`Cluster` starts: ``CLUSTER:NODE:ROLE``.
MARK_ENV = "FMSTORE_CLUSTER_PROC"


def marked(prefix: str) -> list[int]:
    """Every live process whose mark starts with ``prefix`` (zombies have no environment,
    so they are not listed)."""
    want = f"{MARK_ENV}={prefix}".encode()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{d}/environ", "rb") as f:
            if any(v.startswith(want) for v in f.read().split(b"\0")):
                found.append(int(d))
    return found


def kill_marked(prefix: str, timeout: float = 30) -> None:
    """SIGKILL every process marked ``prefix`` until none is left (a process may start
    another while the first kills land)."""
    deadline = time.monotonic() + timeout
    while pids := marked(prefix):
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} ({prefix}) survived SIGKILL for {timeout} s")
        time.sleep(0.05)


class S3Tier:
    """The shared ``s3`` tier of every node: ``url`` (``s3://bucket/prefix``), the endpoint
    every node talks to (a fault proxy's, or the server's) and the credentials' environment."""

    def __init__(
        self, url: str, endpoint_url: str, env: Mapping[str, str], region: str, extra: str = ""
    ) -> None:
        self.url, self.endpoint_url, self.env, self.region = url, endpoint_url, dict(env), region
        #: more lines of the ``[s3]`` table (``max_attempts = 20``)
        self.extra = extra


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (listed before any is killed, so none is
    reparented away first).  torchrun starts each rank in a session of its own, so a
    process-group kill of the agent would leave its ranks running."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


class Cluster:
    """Node directories, the rendezvous store, ``torchrun`` agents and daemons.

    ``policies``: TOML appended to every node's config (``[policies]`` and the like).
    ``nproc``: ranks per node.  ``pg_timeout``: seconds, passed to the training processes.
    ``replicas``: ``[tiers.nvme] replicas`` (each node's part also on other nodes' NVMe).
    ``domains``: node -> its ``[tiers.nvme] failure_domain`` (nodes not named have none).
    ``node_toml``: node -> TOML appended to that node's config alone (after ``policies``),
    such as a ``[daemon] bwlimit`` that makes one node's exports slow.
    """

    def __init__(
        self,
        base: str | os.PathLike[str],
        *,
        nproc: int = 2,
        s3: S3Tier | None = None,
        policies: str = "",
        pg_timeout: float = 60,
        replicas: int = 0,
        domains: Mapping[str, str] | None = None,
        node_toml: Mapping[str, str] | None = None,
    ) -> None:
        import torch.distributed as dist

        self.base = Path(base)
        self.out = self.base / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.lustre = self.base / "lustre"
        self.lustre.mkdir(exist_ok=True)
        self.nproc, self.s3, self.policies, self.pg_timeout = nproc, s3, policies, pg_timeout
        self.replicas, self.domains = replicas, dict(domains or {})
        self.node_toml = dict(node_toml or {})
        self.port = free_ports(1)[0]
        self.store = dist.TCPStore(
            "127.0.0.1",
            self.port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=300),
        )
        self.launches = 0
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        #: the mark of this cluster's processes (see :data:`MARK_ENV`)
        self.id = uuid.uuid4().hex[:12]

    def mark(self, node: str, role: str) -> str:
        """The mark of ``node``'s processes of ``role`` ("job", "daemon", "cli")."""
        return f"{self.id}:{node}:{role}"

    def _prefix(self, node: str = "", role: str = "") -> str:
        return f"{self.id}:" + (f"{node}:{role}" if node else "")

    def live(self, node: str = "", role: str = "") -> list[int]:
        """The live processes of ``node`` (every node when empty) in ``role`` (any role
        when empty): a killed node has none."""
        return marked(self._prefix(node, role))

    # -- a node's directories and environment -------------------------------------------

    def home(self, node: str) -> Path:
        d = self.base / node
        d.mkdir(exist_ok=True)
        return d

    def nvme(self, node: str) -> Path:
        return self.home(node) / "nvme"

    def state(self, node: str) -> Path:
        return self.home(node) / "state"

    def config(self, node: str) -> Path:
        """The node's ``fmstore.toml`` (written on every call, so a replaced node gets one)."""
        cfg = self.home(node) / "fmstore.toml"
        text = (
            f'state_dir = "{self.state(node)}"\n'
            f'[tiers.nvme]\nurl = "{self.nvme(node)}"\nscope = "node"\n'
            f"replicas = {self.replicas}\n"
            + (f'failure_domain = "{self.domains[node]}"\n' if node in self.domains else "")
            + f'[tiers.lustre]\nurl = "{self.lustre}"\n'
        )
        if self.s3 is not None:
            text += (
                f'[tiers.s3]\nurl = "{self.s3.url}"\n'
                f'[s3]\nendpoint_url = "{self.s3.endpoint_url}"\n'
                f'region = "{self.s3.region}"\naddressing_style = "path"\n{self.s3.extra}\n'
            )
        cfg.write_text(text + self.policies + "\n" + self.node_toml.get(node, ""))
        return cfg

    def env(self, node: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FMSTORE__")}
        if self.s3 is not None:
            env.update(self.s3.env)
        env.update(
            {
                "FMSTORE_CONFIG": str(self.config(node)),
                "FMSTORE_NODE_ID": node,
                PG_TIMEOUT_ENV: str(self.pg_timeout),
            }
        )
        env.update(extra or {})
        return env

    def fmstore(
        self, node: str, *args: str, timeout: float = 300, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``fmstore ARGS`` run as on ``node`` (``env``: more environment)."""
        return subprocess.run(
            [sys.executable, "-m", "fmstore", *args],
            env=self.env(node, {"COLUMNS": "400", MARK_ENV: self.mark(node, "cli"), **(env or {})}),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    # -- training agents ----------------------------------------------------------------

    def start(
        self,
        script: str,
        args: Sequence[str],
        nodes: Sequence[str],
        *,
        name: str = "job",
        env: Mapping[str, str] | None = None,
        module: bool = False,
    ) -> list[subprocess.Popen[bytes]]:
        """One agent per node (in this order: the first node gets ranks 0..nproc-1) running
        ``script args`` (``module``: ``python -m script``); output in ``out/NAME-NODE.log``."""
        self.launches += 1
        procs = []
        for node in nodes:
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={len(nodes)}", f"--nproc-per-node={self.nproc}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
                f"--rdzv-id=launch{self.launches}", "--rdzv-conf=is_host=false",
                "--local-addr=127.0.0.1", "--max-restarts=0",
                *(["-m"] if module else []), script, *args,
            ]  # fmt: skip
            with open(self.log(name, node), "ab") as log:
                p = subprocess.Popen(
                    cmd,
                    env=self.env(node, {**(env or {}), MARK_ENV: self.mark(node, "job")}),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            self.agents[node] = p
            procs.append(p)
            # The rendezvous orders nodes by (host, pid): started in order, a moment apart.
            time.sleep(0.2)
        return procs

    def log(self, name: str, node: str) -> Path:
        return self.out / f"{name}-{node}.log"

    def logs(self, name: str, nodes: Sequence[str], tail: int = 4000) -> str:
        return "\n".join(
            f"--- {n}\n" + self.log(name, n).read_text(errors="replace")[-tail:] for n in nodes
        )

    def run(
        self,
        script: str,
        args: Sequence[str],
        nodes: Sequence[str],
        *,
        name: str = "job",
        timeout: float = 600,
        env: Mapping[str, str] | None = None,
        module: bool = False,
    ) -> list[int]:
        """Start the agents and wait for them; every exit status (-9 for those killed past
        ``timeout``)."""
        procs = self.start(script, args, nodes, name=name, env=env, module=module)
        deadline = time.monotonic() + timeout
        rcs = []
        for node, p in zip(nodes, procs, strict=True):
            try:
                rcs.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill(node)
                rcs.append(-9)
        return rcs

    # -- daemons ------------------------------------------------------------------------

    def start_daemon(self, node: str, *args: str) -> subprocess.Popen[bytes]:
        """``fmstore daemon --no-http ARGS`` of ``node`` (log: ``out/daemon-NODE.log``)."""
        self.kill_daemon(node)
        with open(self.log("daemon", node), "ab") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", "fmstore", "daemon", "--no-http", *args],
                env=self.env(node, {MARK_ENV: self.mark(node, "daemon")}),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.daemons[node] = p
        return p

    def kill_daemon(self, node: str) -> None:
        p = self.daemons.pop(node, None)
        if p is not None and p.poll() is None:
            kill_tree(p.pid)
        if p is not None:
            p.wait()
        kill_marked(self.mark(node, "daemon"))

    # -- failures -----------------------------------------------------------------------

    def kill(self, node: str) -> None:
        """SIGKILL of ``node``'s agent and every process of its job: its ranks, in sessions
        of their own, and whatever they started, also once reparented."""
        p = self.agents.pop(node, None)
        if p is not None:
            if p.poll() is None:
                kill_tree(p.pid)
            p.wait()
        kill_marked(self.mark(node, "job"))

    def replace(self, node: str) -> None:
        """Kill ``node`` (agent, ranks, daemon) and wipe its NVMe and state directory: the
        node that takes its place has none of its data."""
        self.kill(node)
        self.kill_daemon(node)
        shutil.rmtree(self.nvme(node), ignore_errors=True)
        shutil.rmtree(self.state(node), ignore_errors=True)

    def close(self) -> None:
        """Kill every agent, rank and daemon of the cluster, then check that no process
        of its own is left (an AssertionError names them)."""
        for node in list(self.agents):
            self.kill(node)
        for node in list(self.daemons):
            self.kill_daemon(node)
        kill_marked(self._prefix())
        left = self.live()
        assert not left, f"processes of the cluster left after close: {left}"

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pg_timeout() -> datetime.timedelta:
    """In a training process started by a :class:`Cluster`: its process groups' timeout."""
    return datetime.timedelta(seconds=float(os.environ.get(PG_TIMEOUT_ENV, "60")))
