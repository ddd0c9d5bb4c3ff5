"""``make demo``: fmstore on the embedded default — local nvme and lustre directories plus a
SeaweedFS S3 server started here — round-tripping data through all three tiers.

Everything it starts it stops, by pid, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import zlib

from rich.console import Console
from rich.table import Table

from . import runtime
from .cli.util import human_bytes
from .stores import Store, open_store
from .testing.seaweed import SeaweedServer


async def _roundtrip(src: Store, dst: Store, keys: list[str]) -> float:
    t0 = time.perf_counter()

    async def one(k: str) -> None:
        await dst.put(k, await src.get(k))

    await asyncio.gather(*(one(k) for k in keys))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fmstore.demo", description=__doc__)
    ap.add_argument("--workdir", default=None, help="where the tiers live (default: a temp dir)")
    ap.add_argument("--mib", type=int, default=256, help="data to move through the tiers")
    args = ap.parse_args(argv)
    console = Console()
    work = args.workdir or tempfile.mkdtemp(prefix="fmstore-demo-")
    console.print(f"[bold]fmstore demo[/bold] — tiers under {work}")
    with SeaweedServer() as s3:
        s3.create_bucket("fmstore-demo")
        tiers = {
            "nvme": open_store(os.path.join(work, "nvme"), tier="nvme"),
            "lustre": open_store(os.path.join(work, "lustre"), tier="lustre"),
            "s3": open_store("s3://fmstore-demo/data", tier="s3", **s3.store_options()),
        }
        console.print(f"S3 (SeaweedFS) at {s3.endpoint_url}")
        blob = os.urandom(16 << 20)
        keys = [f"shard-{i:03d}.bin" for i in range(max(1, args.mib // 16))]
        total = len(keys) * len(blob)
        t0 = time.perf_counter()
        async def fill() -> None:
            await asyncio.gather(*(tiers["nvme"].put(k, blob) for k in keys))

        runtime.run(fill())
        rows = [("write", "nvme", time.perf_counter() - t0)]
        for a, b in (("nvme", "lustre"), ("lustre", "s3"), ("s3", "nvme")):
            rows.append((f"{a} → {b}", b, runtime.run(_roundtrip(tiers[a], tiers[b], keys))))
        crc = zlib.crc32(blob)
        ok = all(zlib.crc32(runtime.run(tiers["nvme"].get(k))) == crc for k in keys)
        table = Table(title=f"{len(keys)} objects, {human_bytes(total)}")
        table.add_column("step")
        table.add_column("seconds", justify="right")
        table.add_column("MB/s", justify="right")
        for step, _tier, dt in rows:
            table.add_row(step, f"{dt:.2f}", f"{total / dt / 1e6:.0f}")
        console.print(table)
        console.print("round trip verified" if ok else "[red]MISMATCH after round trip[/red]")
        for st in tiers.values():
            runtime.run(st.close())
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
