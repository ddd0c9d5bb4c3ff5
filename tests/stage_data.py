"""The staging tests' dataset and helpers (the sizes of the staging issue)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fmstore.tiering.crc import crc32c

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


def make_dataset(root: Path, *, small_dirs: int = 50) -> dict:
    """10,000 × 4 KiB files in 50 directories and 3 × 300 MiB files, all distinct
    (``small_dirs`` < 50 generates only the small files of the first directories)."""
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
    for i in range(BIG_N):
        with open(big / f"shard-{i}.bin", "wb") as f:
            for j in range(BIG_SIZE >> 20):
                f.write(j.to_bytes(8, "little") + bytes([i]) + block[9:])
    os.chmod(big / "shard-1.bin", 0o640)
    return {
        "small": str(small),
        "big": str(big),
        "small_crcs": file_crcs(str(small)),
        "big_crcs": file_crcs(str(big)),
    }
