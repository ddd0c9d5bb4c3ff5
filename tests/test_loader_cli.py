"""``fmstore dataset write`` and ``fmstore dataset inspect``."""

from __future__ import annotations

import json
import subprocess
import sys


def fm(*args: str):
    return subprocess.run(
        [sys.executable, "-m", "fmstore", *args], capture_output=True, text=True, timeout=120
    )


def test_write_then_inspect(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"i": i, "t": "x" * 50}) + "\n" for i in range(500)))
    dst = str(tmp_path / "ds")
    r = fm("dataset", "write", str(src), dst, "--shard-size", "8KiB", "--compression", "zstd")
    assert r.returncode == 0, r.stderr
    assert "500 samples" in r.stdout
    r = fm("dataset", "inspect", dst, "--json", "--shards")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["format"] == "fmstore" and info["samples"] == 500 and info["shards"] > 3
    assert info["bytes"] == sum(s["bytes"] for s in info["shard_list"])
    assert all(s["compression"] == "zstd" for s in info["shard_list"])
    r = fm("dataset", "inspect", dst)
    assert r.returncode == 0 and "samples" in r.stdout and "500" in r.stdout


def test_inspect_token_files_and_errors(tmp_path):
    import numpy as np

    (tmp_path / "tok").mkdir()
    np.arange(4097, dtype=np.uint16).tofile(tmp_path / "tok" / "train.bin")
    r = fm(
        "dataset",
        "inspect",
        str(tmp_path / "tok"),
        "--seq-len",
        "1024",
        "--dtype",
        "uint16",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["samples"] == 4
    r = fm("dataset", "inspect", str(tmp_path / "tok"))
    assert r.returncode == 1 and "seq_len" in r.stderr
    r = fm("dataset", "write", str(tmp_path / "missing.jsonl"), str(tmp_path / "out"))
    assert r.returncode == 1 and "does not exist" in r.stderr
