"""``import fmstore`` is cheap: ``dir(fmstore)`` lists the names the package serves on first
use (``save``, ``load``, ``CheckpointManager``, ...) without importing torch for them."""

from __future__ import annotations

import subprocess
import sys


def test_dir_of_the_module_lists_the_names_served_on_first_use():
    code = "import fmstore, sys; print(sorted(set(dir(fmstore)) & {'save', 'load', 'CheckpointManager', 'async_save'})); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    listed, torch_loaded = out.stdout.splitlines()
    assert listed == str(["CheckpointManager", "async_save", "load", "save"])
    assert torch_loaded == "False"  # listing them does not import them
