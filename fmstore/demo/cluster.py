"""``python -m fmstore.demo.cluster`` (``make demo-cluster``): a job of two nodes x two ranks
on this machine, one node killed and replaced mid-run, resumed bit-exact.

1. starts SeaweedFS (S3) on loopback and two nodes (``torchrun`` agents on loopback, each
   with its own NVMe directory, ``scope = "node"``, its own state directory and its own
   ``fmstore daemon``; a Lustre directory and S3 shared: :mod:`fmstore.testing.cluster`);
2. trains the demo's tiny GPT sharded with FSDP2 over the four ranks
   (:mod:`fmstore.demo.cluster_train`), saving every ``--ckpt-every`` steps to each node's
   NVMe through ``ShardedCheckpointManager``; each node's daemon exports its own part of
   every 2nd save to Lustre and of every 4th to S3, where the copy commits once every
   node's part is there;
3. once a step is on Lustre, kills node ``n1`` (SIGKILL of its agent, its ranks and its
   daemon) at ``--kill-at``, wipes its NVMe and state (a replaced node), and relaunches
   the job: it restores the newest step every rank can read (n1's NVMe is empty: its part
   from the replica on n0's NVMe, or without replicas from Lustre or S3) and trains to the
   end;
4. runs the same job uninterrupted to the same step in a directory of its own, and
   compares every rank's final shards, model and optimizer, bit for bit;
5. prints a summary and writes ``cluster.png``: the step number against time (the
   training step, and per tier the newest step restorable from it), the stall of every
   save, and the loss; ``result.json`` holds the figures, ``steps_redone`` among them (the
   newest step restorable at the kill less the step restored).

With ``--replicas 1`` (the default) each node's part is also on its peer's NVMe: the
replaced node restores from its peer, and no checkpointed step is redone.  With
``--replicas 0`` the relaunch falls back to a shared tier; the newer steps still on n0's
NVMe are moved aside for their redo.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..checkpoint.layout import parse_step, step_name
from ..testing.cluster import Cluster, S3Tier
from ..testing.seaweed import SeaweedServer
from .cluster_train import read_events as events

console = Console()
NODES = ["n0", "n1"]
ROOT = "runs/cluster"


def policies(every: int) -> str:
    return f"""
[policies]
ladder = ["nvme", "lustre", "s3"]
write_tier = "nvme"
[[policies.export]]
to = "lustre"
every_steps = {2 * every}
[[policies.export]]
to = "s3"
every_steps = {4 * every}
# With a retention table, an export a newer commit makes moot is superseded: both nodes
# then export the same newest step while training outpaces the exports.
[policies.retention.lustre]
keep_latest = 3
[policies.retention.s3]
keep_latest = 2
[daemon]
interval = "0.5s"
# Not "idle" (the default) nor "low": here the ranks alone outnumber the two cores, and a
# daemon at SCHED_IDLE or nice 19 gets next to no CPU while they train (on a real node the
# ranks have their GPUs and the daemon the spare cores).
priority = "normal"
"""


def committed_steps(root: Path) -> int:
    """Checkpoints committed under ``root`` (a tier's directory of the run): manifests."""
    return len(list(root.glob("step_*/manifest.json"))) if root.is_dir() else 0


def newest_committed(root: Path) -> int | None:
    """The newest step committed under ``root`` (a shared tier's directory of the run)."""
    steps = [parse_step(p.parent.name) for p in root.glob("step_*/manifest.json")]
    return max((s for s in steps if s is not None), default=None)


def restorable_on_nvme(c: Cluster, lost: tuple[str, ...] = ()) -> int | None:
    """The newest step the nodes' NVMe restores without the nodes in ``lost``: every node's
    part is on its own NVMe (its manifest beside it) or a complete replica of it (the
    manifest and each of its ranks' records) is on another node's."""
    live = [n for n in NODES if n not in lost]
    steps: dict[int, Path] = {}
    for n in live:
        for where in (c.nvme(n) / ROOT, c.nvme(n) / ".replicas" / ROOT):
            for p in where.glob("step_*/manifest.json"):
                s = parse_step(p.parent.name)
                if s is not None:
                    steps.setdefault(s, p)
    for s in sorted(steps, reverse=True):
        try:
            m = json.loads(steps[s].read_text())
            gen, parts = m["generation"], m["parts"]
        except (OSError, ValueError, KeyError):  # being written or removed: not yet
            continue

        def held(node: str, ranks: list[int], s: int = s, gen: str = gen) -> bool:
            if node in live and (c.nvme(node) / ROOT / step_name(s) / "manifest.json").exists():
                return True
            return any(
                all(
                    (c.nvme(o) / ".replicas" / ROOT / step_name(s) / f"{gen}" / rec).exists()
                    for rec in (f"rank-{r:06d}.json" for r in ranks)
                )
                for o in live
                if o != node
            )

        if all(held(p["node"], p["ranks"]) for p in parts):
            return s
    return None


def parts_of(names: list[str], node: str) -> int:
    """Steps whose generation on a shared tier holds ``node``'s part record, from the
    keys below the run's root (``step_S/GEN/part-NODE.json``)."""
    return sum(1 for k in names if k.endswith(f"/part-{node}.json") and k.count("/") == 2)


class Sampler:
    """Every half second: each node's committed checkpoints on its NVMe, Lustre's, S3's."""

    def __init__(self, c: Cluster, s3: SeaweedServer, bucket: str) -> None:
        self.c, self.s3, self.bucket = c, s3, bucket
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def s3_keys(self) -> list[str]:
        client = self.s3.boto3_client()
        prefix = f"fm/{ROOT}/"
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"][len(prefix) :] for p in pages for o in p.get("Contents", [])]

    def sample(self) -> None:
        row: dict[str, Any] = {"t": time.time()}
        root = self.c.lustre / ROOT
        lustre = [str(p.relative_to(root)) for p in root.glob("step_*/*/part-*.json")]
        try:
            s3: list[str] | None = self.s3_keys()
        except Exception:  # a sample missed is a gap in the plot, nothing more
            s3 = None
        for n in NODES:
            row[f"nvme {n}"] = committed_steps(self.c.nvme(n) / ROOT)
            row[f"lustre {n}"] = parts_of(lustre, n)
            row[f"s3 {n}"] = None if s3 is None else parts_of(s3, n)
        row["lustre committed"] = committed_steps(root)
        s3_steps = [
            parse_step(k.split("/")[0])
            for k in s3 or []
            if k.endswith("/manifest.json") and k.count("/") == 1
        ]
        row["s3 committed"] = None if s3 is None else len(s3_steps)
        # per tier, the newest step restorable from it
        row["restorable"] = {
            "nvme": restorable_on_nvme(self.c),
            "lustre": newest_committed(root),
            "s3": max((x for x in s3_steps if x is not None), default=None),
        }
        self.rows.append(row)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.sample()

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.sample()


def train_args(c: Cluster, a: argparse.Namespace, steps: int) -> list[str]:
    return [
        "--out", str(c.out), "--root", ROOT, "--steps", str(steps),
        "--ckpt-every", str(a.ckpt_every), "--sentences", str(a.sentences),
    ]  # fmt: skip


def finals(out: Path, ranks: int) -> list[str]:
    return [json.loads((out / f"final-{r}.json").read_text())["hash"] for r in range(ranks)]


def run(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(a.workdir or tempfile.mkdtemp(prefix="fmstore-demo-cluster-")).resolve()
    if work.exists() and any(work.iterdir()):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]fmstore cluster demo[/bold] in {work}")
    # SeaweedFS's data in a temporary directory of its own: its unix sockets live there,
    # and a socket's path must stay short (108 bytes).
    with SeaweedServer() as s3:
        bucket = s3.create_bucket("demo-cluster")
        pol = policies(a.ckpt_every)
        tier = S3Tier(f"s3://{bucket}/fm", s3.endpoint_url, s3.env(), s3.region)
        # Seconds, not gloo's 30 minutes: n0 gives up soon after n1 dies.
        c = Cluster(work / "job", s3=tier, policies=pol, pg_timeout=20, replicas=a.replicas)
        with c, Sampler(c, s3, bucket) as sampler:
            for n in NODES:
                c.start_daemon(n)
            console.print(f"run 1: {len(NODES)} nodes x 2 ranks, n1 replaced at step {a.kill_at}")
            # Run 1 trains on until the kill (the first export can take a while).
            args1 = train_args(c, a, 1_000_000)
            procs = c.start("fmstore.demo.cluster_train", args1, NODES, module=True)
            deadline = time.monotonic() + 900
            while True:
                ev = events(c.out)
                on_lustre = committed_steps(c.lustre / ROOT) > 0  # the daemons' export
                top = max([e["step"] for e in ev if e["ev"] == "step"], default=0)
                # With replicas: a step at or past --kill-at that n0's NVMe restores without
                # n1 (n1's part replicated there), and no newer one half made.
                ready = restorable = restorable_on_nvme(c)
                if a.replicas:
                    ready = restorable_on_nvme(c, lost=("n1",))
                    ready = ready if ready == restorable else None
                if on_lustre and top >= a.kill_at and (not a.replicas or (ready or 0) >= a.kill_at):
                    break
                if all(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                    raise SystemExit("run 1 ended before the kill:\n" + c.logs("job", NODES))
                time.sleep(0.05)
            # the newest step restorable from any tier while every node was up
            shared = [
                newest_committed(c.lustre / ROOT),
                *[r["restorable"]["s3"] for r in sampler.rows[-1:]],
            ]
            best = max((x for x in [restorable, *shared] if x is not None), default=None)
            killed = {"t": time.time(), "step": top, "restorable": best}
            c.replace("n1")  # agent, ranks and daemon SIGKILLed; NVMe and state wiped
            console.print(f"  n1 killed at step {top} and replaced (its NVMe and state wiped)")
            c.start_daemon("n1")
            for p in procs:
                p.wait(timeout=300)  # n0 gives up at its process group's timeout
            console.print("run 2: the job relaunched on n0 and the new n1")
            c.pg_timeout = 300
            steps = max(a.steps, (top // a.ckpt_every + 2) * a.ckpt_every)
            rcs = c.run("fmstore.demo.cluster_train", train_args(c, a, steps), NODES, module=True)
            if rcs != [0, 0]:
                raise SystemExit(c.logs("job", NODES))
        # The uninterrupted run, the reference for the bit-for-bit check (its S3 copies
        # under a prefix of their own).
        tier = S3Tier(f"s3://{bucket}/reference", s3.endpoint_url, s3.env(), s3.region)
        with Cluster(work / "reference", s3=tier, policies=pol, pg_timeout=300) as ref:
            console.print(f"the same job uninterrupted to step {steps} (the reference) ...")
            t0 = time.perf_counter()
            args = train_args(ref, a, steps)
            rcs = ref.run("fmstore.demo.cluster_train", args, NODES, module=True)
            if rcs != [0, 0]:
                raise SystemExit(ref.logs("job", NODES))
            console.print(f"  done in {time.perf_counter() - t0:.0f} s")
        ev = events(c.out)
        restore = [e for e in ev if e["ev"] == "restore" and e["step"] is not None]
        same = finals(c.out, 4) == finals(ref.out, 4)
        last = restore[-1] if restore else None
        # Checkpointed steps trained again: the newest step some tier restored while every
        # node was up, less the step the relaunch restored (the steps trained since that
        # checkpoint are lost to any checkpointing: killed["step"] less it).
        redone = None
        if killed["restorable"] is not None:
            redone = max(0, killed["restorable"] - (last["step"] if last else 0))
        result = {
            "bit_identical": same,
            "kill": killed,
            "replicas": a.replicas,
            "restore": last,
            "steps_redone": redone,
            "saves": [e for e in ev if e["ev"] == "save"],
            "tiers": sampler.rows,
            "steps": steps,
            "workdir": str(work),
        }
        (work / "result.json").write_text(json.dumps(result, indent=1))
        summary(result)
        png = plot(work, ev, result)
        console.print(f"plot: {png}")
        return result


def summary(r: dict[str, Any]) -> None:
    t = Table(title="fmstore cluster demo")
    t.add_column("what")
    t.add_column("value")
    rest = r["restore"]
    t.add_row("node n1 killed and replaced at step", str(r["kill"]["step"]))
    if rest:
        t.add_row("restored step", f"{rest['step']} from {rest['tier']} ({rest['seconds']:.1f} s)")
        if rest.get("moved_aside"):
            t.add_row("newer steps moved aside to redo them", str(rest["moved_aside"]))
    t.add_row(
        "checkpointed steps redone",
        f"{r['steps_redone']} (newest restorable at the kill: {r['kill']['restorable']}; "
        f"replicas = {r['replicas']})",
    )
    for tier in ("nvme", "lustre", "s3"):
        stalls = [s["stall"] for s in r["saves"] if s["tier"] == tier]
        if stalls:
            t.add_row(
                f"save stall on {tier} (median, max)",
                f"{sorted(stalls)[len(stalls) // 2] * 1e3:.0f} ms, {max(stalls) * 1e3:.0f} ms"
                f" over {len(stalls)} saves",
            )
    last = r["tiers"][-1] if r["tiers"] else {}
    t.add_row(
        "checkpoints at the end",
        ", ".join(f"{k}: {v}" for k, v in last.items() if k not in ("t", "restorable")),
    )
    t.add_row(
        "final weights vs uninterrupted run", "bit-identical" if r["bit_identical"] else "DIFFER"
    )
    console.print(t)


def plot(work: Path, ev: list[dict[str, Any]], r: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min([e["t"] for e in ev] + [row["t"] for row in r["tiers"]])
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 11))
    # Step number against time: the training step, and per tier the newest step
    # restorable from it (a gap: not sampled, or nothing there yet).
    steps = [e for e in ev if e["ev"] == "step"]
    ax1.plot(
        [e["t"] - t0 for e in steps], [e["step"] for e in steps], ".", ms=2, color="black",
        label="training step",
    )  # fmt: skip
    for tier, color, ls in (("nvme", "C0", "-"), ("lustre", "C1", "--"), ("s3", "C2", ":")):
        pts = [
            (row["t"] - t0, row["restorable"][tier]) for row in r["tiers"] if "restorable" in row
        ]
        ax1.step(
            [p[0] for p in pts],
            [p[1] if p[1] is not None else float("nan") for p in pts],
            where="post", ls=ls, color=color, lw=2, label=f"newest step restorable from {tier}",
        )  # fmt: skip
    rest = r["restore"]
    if rest:
        ax1.plot([rest["t"] - t0], [rest["step"]], "o", color="C3", ms=8)
        ax1.annotate(
            f"  restored step {rest['step']} from {rest['tier']}; "
            f"{r['steps_redone']} checkpointed steps redone",
            (rest["t"] - t0, rest["step"]),
            fontsize=8,
        )
    ax1.set_ylabel("step")
    ax1.set_xlabel("seconds")
    replicas = "with replicas on the peer's NVMe" if r["replicas"] else "no replicas"
    ax1.set_title(f"training step and the newest step each tier restores ({replicas})")
    for ax in (ax1, ax3):
        ax.axvline(r["kill"]["t"] - t0, color="red", ls="--", label="n1 killed + replaced")
    ax1.legend(loc="upper left", fontsize=7)
    for tier, color in (("nvme", "C0"), ("lustre", "C1"), ("s3", "C2")):
        saves = [s for s in r["saves"] if s["tier"] == tier]
        if not saves:
            continue
        ax2.scatter(
            [s["step"] for s in saves], [s["stall"] * 1e3 for s in saves], color=color, label=tier
        )
    ax2.set_xlabel("step")
    ax2.set_ylabel("save stall (ms)")
    ax2.set_title("how long each save to the NVMe held training")
    ax2.legend(loc="upper left")
    ax3.plot([e["t"] - t0 for e in steps], [e["loss"] for e in steps], ".", ms=3)
    if rest:
        ax3.annotate(
            f"restored step {rest['step']} from {rest['tier']}",
            (rest["t"] - t0, max(e["loss"] for e in steps)),
        )
    ax3.set_xlabel("seconds")
    ax3.set_ylabel("training loss")
    ax3.set_title(
        "training; final weights "
        + ("bit-identical to" if r["bit_identical"] else "DIFFER from")
        + " an uninterrupted run"
    )
    fig.tight_layout()
    png = work / "cluster.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fmstore.demo.cluster", description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=35, help="kill n1 once this step is reached")
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument(
        "--replicas", type=int, default=1, help="each node's part also on its peer's NVMe (0: not)"
    )
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    r = run(a)
    if not r["bit_identical"]:
        raise SystemExit("the final weights differ from the uninterrupted run")


if __name__ == "__main__":
    main()
