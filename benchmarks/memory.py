"""What fresh memory costs on this machine: the floor under a first ``async_save``.

    python -m benchmarks.memory [--block 4GiB] [--blocks 4]

A first snapshot copies into memory nobody has touched yet, so it can go no faster than the
machine hands out fresh pages. This allocates ``--blocks`` blocks of ``--block`` bytes in
turn, in one process that keeps them (from a settled machine: page cache dropped), and
times touching each one's pages the first time and again. On a VM whose host backs only part
of the guest's memory, the later blocks come slower: a first save whose state, staging and
other processes' memory cross that line pays the host's rate, as DCP's does.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import print_table, save_json, settle
from fmstore.units import parse_size


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--block", default="4GiB", help="size of each block")
    ap.add_argument("--blocks", type=int, default=4, help="blocks allocated in turn, all kept")
    ap.add_argument("--quick", action="store_true", help="two 512 MiB blocks")
    args = ap.parse_args()
    block = parse_size("512MiB" if args.quick else args.block, "--block")
    count = 2 if args.quick else args.blocks
    settle()
    keep, rows = [], []
    for i in range(count):
        t0 = time.perf_counter()
        x = torch.empty(block, dtype=torch.uint8)
        x.fill_(1)  # first touch: a page fault per page (and the host's, where it has to)
        fresh = time.perf_counter() - t0
        t0 = time.perf_counter()
        x.fill_(2)
        warm = time.perf_counter() - t0
        keep.append(x)
        rows.append(
            {
                "block": i + 1,
                "resident GiB": block * (i + 1) / (1 << 30),
                "fresh s": fresh,
                "fresh GB/s": block / fresh / 1e9,
                "touched s": warm,
                "touched GB/s": block / warm / 1e9,
                "vs touched": warm / fresh,
            }
        )
    text = print_table(
        f"fresh memory: {count} blocks of {block >> 20} MiB, allocated in turn and kept",
        rows,
        list(rows[0]),
    )
    save_json("memory", {"rows": rows, "table": text})


if __name__ == "__main__":
    main()
