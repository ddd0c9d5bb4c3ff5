"""Hostile resume journals of ``fmstore stage``: a malformed line is one error naming the
journal and the line; a journal's temp-file token cannot make a resume remove another
file's temp file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hostile_helpers import one_error_line
from stage_data import fm_here

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An isolated FMSTORE_HOME (state dir, default tiers) for in-process CLI runs."""
    from fmstore.config import set_config

    monkeypatch.setenv("FMSTORE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FMSTORE_CONFIG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    set_config(None)
    yield tmp_path / "home"
    set_config(None)


def _staged_once(tmp_path: Path, home: Path, size: int) -> tuple[Path, Path, Path]:
    """A source holding ``a.bin`` staged once; returns (source, destination, journal)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(size))
    r = fm_here("stage", str(src), str(dst), "--part-size", "1MiB", "--no-progress")
    assert r.returncode == 0, r.stderr
    (journal,) = (home / "state" / "transfers").glob("*.jsonl")
    return src, dst, journal


@pytest.mark.parametrize(
    "line",
    [
        "5",
        '{"p":"a.bin"}',
        '{"u":"a.bin","t":"x"}',
        '{"y":"zz"}',
        '{"f":["x"]}',
        '{"p":"a.bin","t":"x","i":-1,"c":"00000000","n":1}',
        '{"b":true}',
    ],
)
def test_a_bad_journal_line_is_one_error(tmp_path, home, line):
    src, dst, journal = _staged_once(tmp_path, home, 1000)
    journal.write_text('{"to":"x"}\n' + line + "\n")
    r = fm_here("stage", str(src), str(dst), "--no-progress")
    err = one_error_line(r)
    assert "resume journal" in err and "line 2" in err and str(journal) in err


def test_a_journal_token_cannot_remove_another_files_temp(tmp_path, home):
    src, dst, journal = _staged_once(tmp_path, home, 3 << 20)
    (dst / "a.bin").unlink()  # copied again, in parts, from the journal's pending write
    sibling = dst / f".fmstore-tmp.{'ab' * 16}.b.bin"
    sibling.write_bytes(b"another copy's bytes")
    rec = {"u": "a.bin", "t": sibling.name, "v": "other", "z": 1 << 20}
    journal.write_text(json.dumps(rec) + "\n")
    r = fm_here("stage", str(src), str(dst), "--part-size", "1MiB", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert sibling.read_bytes() == b"another copy's bytes"
    assert (dst / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
