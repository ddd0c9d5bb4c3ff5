"""Rewriting a dataset: refused without overwrite; with it, no stale shard stays behind."""

from __future__ import annotations

import os

import pytest
from stage_data import fm_here

from fmstore.errors import AlreadyExists
from fmstore.loaders import StreamingDataset
from fmstore.loaders.writer import write_samples


def shards(root) -> list[str]:
    return sorted(k for k in os.listdir(root) if k.startswith("shard-"))


def test_a_second_write_is_refused_then_replaces_without_leftovers(tmp_path):
    dst = tmp_path / "ds"
    write_samples([b"x" * 100] * 50, str(dst), shard_size=1000)
    assert len(shards(dst)) == 5
    (dst / "NOTES.txt").write_text("kept")  # not the writer's: never removed
    with pytest.raises(AlreadyExists, match="already holds a dataset: pass --overwrite"):
        write_samples([b"y" * 100] * 10, str(dst), shard_size=1000)
    ds = StreamingDataset(str(dst), str(tmp_path / "c1"), shuffle=False)
    assert len(list(ds)) == 50  # untouched
    r = write_samples([b"y" * 100] * 10, str(dst), shard_size=1000, overwrite=True)
    assert r.shards == 1 and shards(dst) == ["shard-00000.fms"]
    assert (dst / "NOTES.txt").read_text() == "kept"
    got = list(StreamingDataset(str(dst), str(tmp_path / "c2"), shuffle=False))
    assert got == [b"y" * 100] * 10


def test_dataset_write_on_the_command_line(tmp_path):
    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    big.write_text("".join(f'{{"i": {i}, "pad": "{"p" * 50}"}}\n' for i in range(200)))
    small.write_text('{"i": 0}\n')
    dst = str(tmp_path / "ds")
    assert fm_here("dataset", "write", str(big), dst, "--shard-size", "2KiB").returncode == 0
    assert len(shards(dst)) > 3
    r = fm_here("dataset", "write", str(small), dst)
    assert r.returncode == 1 and "already holds a dataset: pass --overwrite" in r.stderr
    r = fm_here("dataset", "write", str(small), dst, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert shards(dst) == ["shard-00000.fms"]
