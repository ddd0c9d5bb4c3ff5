"""An export killed after its commit on the destination, before its catalog record, leaves
the row ``exporting`` over a committed copy: once the write tier's copy is lost, a restore
reads that copy (its manifest and checksums checked) and leaves the row to its export; a
row over no copy is a miss that changes nothing."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from tiering_helpers import posix_config, state

from fmstore.errors import NotFound
from fmstore.tiering.inventory import catalog as cat
from fmstore.tiering.managers.manager import CheckpointManager

ROOT = "runs/x"


def _step_dir(base: str, tier: str, step: int) -> str:
    return os.path.join(base, tier, ROOT, f"step_{step:012d}")


def test_a_committed_copy_behind_an_exporting_row_is_restored(tmp_path):
    base = str(tmp_path)
    config = posix_config(base, {"ladder": ["nvme", "lustre"]}, ("nvme", "lustre"))
    with CheckpointManager(ROOT, config=config, run_policies=False, async_save=False) as mgr:
        mgr.save(4, state(4))
        # The export's bytes and manifest landed on Lustre; its record did not.
        shutil.copytree(_step_dir(base, "nvme", 4), _step_dir(base, "lustre", 4))
        mgr.catalog.set_copy(ROOT, 4, "lustre", cat.EXPORTING)
    shutil.rmtree(_step_dir(base, "nvme", 4))

    with CheckpointManager(ROOT, config=config, run_policies=False) as mgr:
        got = mgr.restore()
        assert mgr.restored_step == 4 and mgr.restored_tier == "lustre"
        assert torch.equal(got["model"]["w"], state(4)["model"]["w"])
        assert mgr.catalog.copy(ROOT, 4, "lustre").state == cat.EXPORTING  # its export's
        assert mgr.catalog.copy(ROOT, 4, "nvme").state == cat.MISSING


def test_an_exporting_row_over_no_copy_is_a_miss_that_changes_nothing(tmp_path):
    base = str(tmp_path)
    config = posix_config(base, {"ladder": ["nvme", "lustre"]}, ("nvme", "lustre"))
    with CheckpointManager(ROOT, config=config, run_policies=False, async_save=False) as mgr:
        mgr.save(4, state(4))
        mgr.catalog.set_copy(ROOT, 4, "lustre", cat.EXPORTING)  # started, nothing committed
    shutil.rmtree(_step_dir(base, "nvme", 4))
    with CheckpointManager(ROOT, config=config, run_policies=False) as mgr:
        with pytest.raises(NotFound, match="step 4 on lustre"):
            mgr.restore()
        assert mgr.catalog.copy(ROOT, 4, "lustre").state == cat.EXPORTING
