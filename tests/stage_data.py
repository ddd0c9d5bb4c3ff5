"""The staging tests' dataset and helpers (the sizes of the staging issue)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from fmstore.stores.crc import crc32c
from fmstore.testing.faultproxy import FaultProxy, Rule

SMALL_N, SMALL_SIZE = 10_000, 4096
BIG_N, BIG_SIZE = 3, 300 << 20


def fm(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """Run the fmstore CLI in a subprocess (text output, 5 minutes at most)."""
    return subprocess.run(
        [sys.executable, "-m", "fmstore", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        **kw,
    )


def fm_here(*args: str) -> subprocess.CompletedProcess:
    """Run the fmstore CLI in this process, through the console script's entry point, so
    it shares the test's config and ``memory://`` stores; the same fields as :func:`fm`."""
    from fmstore.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return subprocess.CompletedProcess(["fmstore", *args], code, out.getvalue(), err.getvalue())


def kill9_when(
    args: list[str], ready: Callable[[], bool], *, env: dict | None = None, timeout: float = 120
) -> None:
    """Run ``fmstore *args`` and ``kill -9`` it once ``ready()`` holds; the run ending
    first, or the time running out, fails the test.

    Runs from S3 are held by a fault proxy that stalls every request after the first N
    (``tests/test_stage_s3.py``), so they cannot finish first.  A local copy cannot be held
    that way: its callers set a bandwidth limit that leaves over ten seconds between
    ``ready()`` and the end of the run, far beyond any scheduling delay seen here."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fmstore", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "not ready in time"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def file_crcs(root: str) -> dict[str, int]:
    """CRC32C of every file under ``root`` (fmstore's own hidden files left out)."""
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            if f.startswith(".fmstore"):
                continue
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = crc32c(fh.read())
    return out


def make_dataset(
    root: Path, *, small_dirs: int = 50, big_n: int = BIG_N, big_size: int = BIG_SIZE
) -> dict:
    """10,000 × 4 KiB files in 50 directories and 3 × 300 MiB files, all distinct
    (``small_dirs`` < 50 generates only the small files of the first directories;
    ``big_n`` × ``big_size`` bytes, whole MiB, instead of the big files' default)."""
    small = root / "small"
    for i in range(SMALL_N):
        if i % 50 >= small_dirs:
            continue
        d = small / f"d{i % 50:02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:05d}.bin").write_bytes(i.to_bytes(4, "little") * (SMALL_SIZE // 4))
    big = root / "big"
    big.mkdir()
    block = os.urandom(1 << 20)
    for i in range(big_n):
        with open(big / f"shard-{i}.bin", "wb") as f:
            for j in range(big_size >> 20):
                f.write(j.to_bytes(8, "little") + bytes([i]) + block[9:])
    os.chmod(big / "shard-1.bin", 0o640)
    return {
        "small": str(small),
        "big": str(big),
        "small_crcs": file_crcs(str(small)),
        "big_crcs": file_crcs(str(big)),
    }


def write_s3_config(path, endpoint: str, bucket: str, extra: str = "") -> None:
    path.write_text(
        f"""
[tiers.s3]
url = "s3://{bucket}/ds"
endpoint_url = "{endpoint}"
addressing_style = "path"
region = "us-east-1"
{extra}
[tiers.proxied]
url = "s3://{bucket}/ds"
endpoint_url = "PROXY"
addressing_style = "path"
region = "us-east-1"
max_attempts = 20
"""
    )


def s3_env(s3_server, bucket: str, tmp_path: Path) -> dict:
    """Environment for CLI runs: a config whose ``s3`` tier is ``bucket`` (and whose
    ``proxied`` tier goes through a fault proxy, see :func:`proxied`)."""
    cfg = tmp_path / "fmstore.toml"
    write_s3_config(cfg, s3_server.endpoint_url, bucket)
    env = {
        "FMSTORE_CONFIG": str(cfg),
        "FMSTORE_HOME": str(tmp_path / "home"),
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
    }
    for var in ("SLURM_PROCID", "SLURM_NTASKS", "RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    return {"env": env, "bucket": bucket, "cfg": cfg, "home": str(tmp_path / "home")}


def kill9_after_parts(args: list[str], s3env: dict, parts: int) -> None:
    """Run ``fmstore *args`` and ``kill -9`` it once its journal holds ``parts`` parts."""
    kill9_when(args, lambda: len(journal_parts(s3env["home"])) >= parts, env=s3env["env"])


def journal_parts(home: str) -> list[dict]:
    d = os.path.join(home, "state", "transfers")
    out = []
    for f in os.listdir(d) if os.path.isdir(d) else []:
        with open(os.path.join(d, f), "rb") as fh:
            for line in fh.read().split(b"\n"):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if "p" in rec:
                    out.append(rec)
    return out


def pass_then_hold(n: int, method: str, path: str) -> list[Rule]:
    """A fault plan: the first ``n`` matching requests go through whole, every later one
    stalls (its response never comes).  A run interrupted once it has journaled ``n``
    parts cannot have finished, however fast or slow the machine is."""
    return [Rule("stall", method=method, path=path, skip=n)]


@contextlib.contextmanager
def proxied(s3env: dict, s3_server, plan: list[Rule]) -> Iterator[FaultProxy]:
    """A fault proxy with ``plan`` in front of the server, as the ``proxied`` tier."""
    cfg = s3env["cfg"]
    text = cfg.read_text()
    with FaultProxy(s3_server.endpoint_url) as proxy:
        proxy.set_plan(plan)
        cfg.write_text(text.replace("PROXY", proxy.endpoint_url))
        try:
            yield proxy
        finally:
            cfg.write_text(text)
