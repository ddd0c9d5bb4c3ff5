"""Crash safety: a process saving in a loop is SIGKILLed at random moments; afterwards the
newest committed checkpoint loads bit-exact and gc leaves only committed checkpoints."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

from ckpt_kill_support import check_after_kill

from fmstore.testing.ckpt_kill import save_forever

TRIALS = 30


def test_sigkill_during_saves_never_leaves_a_torn_checkpoint(tmp_path):
    ctx = mp.get_context("fork")
    rng = random.Random(1234)
    total = 0
    for trial in range(TRIALS):
        root = str(tmp_path / f"t{trial}")
        os.makedirs(root)
        proc = ctx.Process(target=save_forever, args=(root,), daemon=True)
        proc.start()
        time.sleep(rng.uniform(0.0, 0.4))  # the kill moment is what is random here
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        total += check_after_kill(root)
    # Both kinds of moment must have happened: before any commit and after several.
    assert total > TRIALS, "too few trials got as far as a committed checkpoint"
