"""Longer crash-safety stress run (not collected by pytest): many SIGKILLs at random
moments of a process saving bigger states in a loop, each followed by the same checks as
tests/test_checkpoint_kill.py.

    python tests/stress/ckpt_kill_stress.py --trials 500 --scale 16
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ckpt_kill_support import check_after_kill  # noqa: E402

from fmstore.testing.ckpt_kill import save_forever  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--scale", type=int, default=8, help="state size multiplier")
    ap.add_argument("--max-delay", type=float, default=1.5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    ctx = mp.get_context("fork")
    committed = 0
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            root = os.path.join(tmp, f"t{trial}")
            os.makedirs(root)
            proc = ctx.Process(target=save_forever, args=(root, args.scale), daemon=True)
            proc.start()
            time.sleep(rng.uniform(0, args.max_delay))
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            committed += check_after_kill(root, args.scale)
            if (trial + 1) % 10 == 0:
                print(
                    f"{trial + 1} trials ok, {committed} checkpoints verified, {time.time() - t0:.0f} s",
                    flush=True,
                )
    print(f"all {args.trials} trials ok")


if __name__ == "__main__":
    main()
