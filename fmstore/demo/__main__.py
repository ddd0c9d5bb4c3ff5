"""``python -m fmstore.demo``: the command line of the demo (:mod:`fmstore.demo` says what
it does; ``--help`` prints that and every option)."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rich.console import Console

from ..testing.seaweed import SeaweedServer, free_ports
from . import report
from .corpus import make_text, tokenize

console = Console()


def toml(work: Path, s3: SeaweedServer, bucket: str, port: int) -> str:
    return f"""\
state_dir = "{work}/state"

[tiers.nvme]
url = "{work}/nvme"

[tiers.lustre]
url = "{work}/lustre"

[tiers.s3]
url = "s3://{bucket}/fmstore"

[s3]
endpoint_url = "{s3.endpoint_url}"
region = "{s3.region}"
addressing_style = "path"

[policies]
ladder = ["nvme", "lustre", "s3"]

[[policies.export]]
to = "lustre"
every_saves = 1

[[policies.export]]
to = "s3"
every_saves = 2

[policies.retention.nvme]
keep_latest = 3

[policies.retention.lustre]
keep_latest = 6

[daemon]
port = {port}
interval = "1s"
"""


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="fmstore-demo-")).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.log = self.work / "train.jsonl"
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, s3: SeaweedServer) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FMSTORE__")}
        env.update(s3.env())
        env["FMSTORE_CONFIG"] = str(self.work / "fmstore.toml")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def fm(self, *argv: str) -> None:
        console.print(f"[dim]$ fmstore {' '.join(argv)}[/dim]")
        subprocess.run([sys.executable, "-m", "fmstore", *argv], env=self._env, check=True)

    def train(self, root: str, kill_at: int = -1) -> int:
        a = self.args
        cmd = [
            sys.executable,
            "-m",
            "fmstore.demo.train",
            "--config",
            str(self.work / "fmstore.toml"),
            "--root",
            root,
            "--steps",
            str(a.steps),
            "--ckpt-every",
            str(a.ckpt_every),
            "--log",
            str(self.log),
            "--kill-at",
            str(kill_at),
        ]
        if a.no_daemon:
            cmd.append("--policies")
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, env=self._env).returncode
        console.print(
            f"  training {root}: exit {rc} after {time.perf_counter() - t0:.1f} s"
            + (" (SIGKILL, as planned)" if rc == -signal.SIGKILL else "")
        )
        return rc

    def start_daemon(self, port: int) -> None:
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fmstore",
                "daemon",
                "--config",
                str(self.work / "fmstore.toml"),
            ],
            env=self._env,
            stdout=open(self.work / "daemon.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(p)
        self.daemon_proc = p
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise SystemExit(
                    f"the daemon exited with {p.returncode}; see {self.work / 'daemon.log'}"
                )
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).read()
                console.print(f"daemon up: http://127.0.0.1:{port}/metrics")
                return
            except OSError:
                time.sleep(0.2)
        raise SystemExit("the daemon did not answer /healthz within 60 s")

    def drain(self, port: int) -> str:
        """Wait until the daemon has exported everything, then return its /metrics text."""
        deadline = time.monotonic() + 120
        text = ""
        while time.monotonic() < deadline:
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                .read()
                .decode()
            )
            if (
                report.metric(text, "fmstore_tier_queue_depth") == 0
                and report.metric(text, "fmstore_tier_export_lag_seconds") == 0
            ):
                break
            time.sleep(0.5)
        return text

    def wait_exported(self, root: str, tier: str, timeout: float = 120) -> None:
        """Until a checkpoint of ``root`` is committed on ``tier`` (its manifest, written
        last), as the tier itself shows it."""
        from fmstore import runtime
        from fmstore.config import load_config
        from fmstore.tiering.tiers import Tiers

        os.environ.update(self._env)  # the S3 server's credentials, as the runs have them
        tiers = Tiers(load_config(self.work / "fmstore.toml"))
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and not runtime.run(tiers.steps_on(tier, root)):
                time.sleep(0.2)
        finally:
            runtime.run(tiers.close())

    def watch_lag(self, port: int) -> None:
        """Sample the daemon's export lag while training runs (for the summary)."""
        import threading

        self.lags: list[float] = []
        self._stop_watch = threading.Event()

        def loop() -> None:
            while not self._stop_watch.wait(0.5):
                try:
                    text = (
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
                        .read()
                        .decode()
                    )
                except OSError:
                    continue
                self.lags.append(report.metric(text, "fmstore_tier_export_lag_seconds"))

        threading.Thread(target=loop, daemon=True).start()

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def run(self) -> int:
        console.rule("[bold]fmstore demo")
        console.print(f"working directory: {self.work}")
        bucket = "fmstore-demo"
        with SeaweedServer() as s3:
            s3.create_bucket(bucket)
            port = free_ports(1)[0]
            (self.work / "fmstore.toml").write_text(toml(self.work, s3, bucket, port))
            self._env = self.env(s3)
            console.print(f"S3 tier: SeaweedFS at {s3.endpoint_url} (bucket {bucket})")
            try:
                return self._run(port)
            finally:
                self.stop_all()

    def _run(self, port: int) -> int:
        a = self.args
        console.rule("dataset")
        tokens = tokenize(make_text(a.sentences, seed=7))
        import numpy as np

        np.save(self.work / "corpus.npy", tokens)
        console.print(f"corpus: {len(tokens):,} tokens")
        self.fm(
            "dataset",
            "write",
            str(self.work / "corpus.npy"),
            "nvme:datasets/corpus",
            "--shard-size",
            "256KiB",
        )
        self.fm("stage", "nvme:datasets/corpus", "s3:datasets/corpus", "--no-progress")
        self.lags = []
        if not a.no_daemon:
            console.rule("tiering daemon")
            self.start_daemon(port)
            self.watch_lag(port)
        console.rule(f"training: {a.steps} steps, checkpoint every {a.ckpt_every}")
        rc = self.train("runs/demo")
        if rc != 0:
            return rc
        metrics = self.drain(port) if not a.no_daemon else ""
        result: dict[str, object] = {"steps": a.steps}
        ok = True
        if a.crash:
            console.rule("crash and resume")
            kill_at = random.Random().randrange(a.steps // 2, a.steps - 1)
            console.print(f"run 2 is killed with SIGKILL after step {kill_at}")
            rc = self.train("runs/crash", kill_at=kill_at)
            if a.wipe_nvme or a.lose_lustre:
                if not a.no_daemon:
                    # A run killed within seconds of its first checkpoints may die before the
                    # daemon's next pass: the copies are lost once that pass exported one
                    # to the tier the restore must come from.
                    self.wait_exported("runs/crash", "s3" if a.lose_lustre else "lustre")
                    # No export in flight while the copies are lost (one that read its
                    # blobs from nvme before the wipe would commit them on lustre after),
                    # and no repair of lustre from S3 before the resumed run restores: the
                    # daemon is paused until that run is over.
                    self.drain(port)
                    os.kill(self.daemon_proc.pid, signal.SIGSTOP)
                shutil.rmtree(self.work / "nvme" / "runs" / "crash", ignore_errors=True)
                console.print("nvme copies of runs/crash wiped (a replaced node)")
            if a.lose_lustre:
                shutil.rmtree(self.work / "lustre" / "runs" / "crash", ignore_errors=True)
                console.print("lustre copies of runs/crash lost too: restore must come from S3")
            try:
                rc = self.train("runs/crash")
            finally:
                if not a.no_daemon and (a.wipe_nvme or a.lose_lustre):
                    os.kill(self.daemon_proc.pid, signal.SIGCONT)
            ok = rc == 0 and report.same_final(self.log, console)
            result.update(kill_at=kill_at, bit_identical=ok, restore=report.last_restore(self.log))
            if not a.no_daemon:
                metrics = self.drain(port)
        console.rule("summary")
        if not a.no_daemon:
            self._stop_watch.set()
        report.summarize(self.work, self.log, metrics, self.lags, console)
        png = report.plot(self.work, self.log, console)
        console.print(f"plot: {png}")
        (self.work / "result.json").write_text(json.dumps(result, indent=2))
        return 0 if ok else 1


def main(argv: list[str] | None = None) -> None:
    from . import __doc__ as what

    ap = argparse.ArgumentParser(
        prog="python -m fmstore.demo",
        description=" ".join((what or "").replace("``", "'").split()),
        epilog="Needs the SeaweedFS binary (make setup installs it) and a few minutes of CPU; "
        "the work directory keeps the tiers, logs, result.json and the plot. Guide: "
        "docs/demo.md.",
    )
    ap.add_argument(
        "--steps", type=int, default=300, help="training steps of each run (default: %(default)s)"
    )
    ap.add_argument(
        "--ckpt-every",
        type=int,
        default=25,
        help="save a checkpoint every N steps (default: %(default)s)",
    )
    ap.add_argument(
        "--sentences",
        type=int,
        default=20000,
        help="sentences in the generated corpus (default: %(default)s)",
    )
    ap.add_argument(
        "--crash", action="store_true", help="also kill a run with SIGKILL and check the resume"
    )
    ap.add_argument(
        "--wipe-nvme",
        action="store_true",
        help="with --crash: wipe its nvme copies before restarting",
    )
    ap.add_argument(
        "--lose-lustre",
        action="store_true",
        help="with --crash: also delete its lustre copies (and its nvme copies), so the only "
        "surviving copy is on S3",
    )
    ap.add_argument(
        "--no-daemon", action="store_true", help="run the policies in the training process instead"
    )
    ap.add_argument(
        "--workdir", default=None, help="where the tiers live (default: a new temp dir)"
    )
    args = ap.parse_args(argv)
    sys.exit(Demo(args).run())


if __name__ == "__main__":
    main()
