"""Moving aside the steps a restore fell back from waits for an export of them that is
under way on this node (it holds its journal), and only for that one."""

from __future__ import annotations

import os

import pytest

from fmstore import runtime
from fmstore.errors import FmstoreError
from fmstore.tiering.aside import wait_for_exports
from fmstore.tiering.journal import Journal


def test_moving_aside_waits_for_a_live_export_of_the_step_only(tmp_path):
    state = tmp_path / "state"
    os.makedirs(state / "transfers")
    step80 = "file:///lustre/run/step_000000000080"
    other = step80 + "0"  # its name begins with the step's

    async def holding(dest: str, then: object) -> None:
        j = await Journal.open(str(state / "transfers" / "ckpt-x.jsonl"), dest=dest)
        j.file_done("g/000000.bin", 3, None, 0, None)  # a copy writing: the journal held
        await j.flush()
        try:
            await then  # type: ignore[misc]
        finally:
            await j.close()

    # an export of another step (a prefix of the same characters) is not waited for
    runtime.run(holding(other, wait_for_exports(str(state), [step80], limit=0)))
    # one of the step is: past the limit, the error names it
    with pytest.raises(FmstoreError, match="step_000000000080"):
        runtime.run(holding(step80 + "/", wait_for_exports(str(state), [step80], limit=0)))
    # a journal left by an export that ended holds nobody back
    runtime.run(wait_for_exports(str(state), [step80], limit=0))
