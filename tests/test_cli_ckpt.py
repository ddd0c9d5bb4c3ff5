"""``fmstore ckpt`` inspect / verify / gc / convert, through the console-script entry point
in-process (tests/test_cli.py covers starting the real command)."""

from __future__ import annotations

import pytest
import torch
from stage_data import fm_here

import fmstore
from fmstore.format.manifest import Manifest


@pytest.fixture
def fm(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    return fm_here


def _state():
    w = torch.randn(64, 32)
    return {"model": {"w": w.bfloat16(), "b": torch.zeros(32), "tied": w}, "w": w, "step": 3}


def test_inspect_shows_tensor_table_and_totals(tmp_path, fm):
    fmstore.save(_state(), tmp_path / "c", compression="bytegroup+zstd")
    r = fm("ckpt", "inspect", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    for word in (
        "model.w",
        "bfloat16",
        "64x32",
        "bytegroup+zstd",
        "shares storage",
        "4 tensors",
        "ratio",
    ):
        assert word in r.stdout, word


def test_verify_passes_then_fails_naming_the_bad_chunk(tmp_path, fm):
    m = fmstore.save(_state(), tmp_path / "c", compression="raw")
    r = fm("ckpt", "verify", str(tmp_path / "c"))
    assert r.returncode == 0 and "ok:" in r.stdout, r.stdout + r.stderr
    blob = tmp_path / "c" / m.generation / m.blobs[0].name
    data = bytearray(blob.read_bytes())
    data[10] ^= 1
    blob.write_bytes(bytes(data))
    r = fm("ckpt", "verify", str(tmp_path / "c"))
    assert r.returncode == 1
    assert "BAD" in r.stdout and "model.w" in r.stdout and m.blobs[0].name in r.stdout


def test_gc_removes_leftovers_and_dry_run_only_reports(tmp_path, fm):
    fmstore.save(_state(), tmp_path / "good")
    m = fmstore.save(_state(), tmp_path / "crashed")
    (tmp_path / "crashed" / "manifest.json").unlink()  # as if killed before the commit
    leftover = tmp_path / "crashed" / m.generation / m.blobs[0].name
    r = fm("ckpt", "gc", str(tmp_path), "--older-than", "0", "--dry-run")
    assert r.returncode == 0 and "would remove" in r.stdout and leftover.exists()
    r = fm("ckpt", "gc", str(tmp_path))  # default age limit: a fresh leftover is kept
    assert r.returncode == 0 and leftover.exists()
    r = fm("ckpt", "gc", str(tmp_path), "--older-than", "0")
    assert r.returncode == 0 and "1 committed checkpoint;" in r.stdout
    assert not leftover.exists()
    assert torch.equal(
        fmstore.load(tmp_path / "good")["w"], fmstore.load(tmp_path / "good")["model"]["tied"]
    )


def test_durations_are_read_alike_by_every_flag(tmp_path, fm, posix_cfg):
    m = fmstore.save(_state(), tmp_path / "crashed")
    (tmp_path / "crashed" / "manifest.json").unlink()
    leftover = tmp_path / "crashed" / m.generation / m.blobs[0].name
    r = fm("ckpt", "gc", str(tmp_path), "--older-than", "1h")
    assert r.returncode == 0 and leftover.exists(), r.stderr
    r = fm("ckpt", "gc", str(tmp_path), "--older-than", "an hour")
    assert r.returncode == 1 and "--older-than: 'an hour' is not a duration" in r.stderr
    r = fm("daemon", "--drain", "--timeout", "soon", "--no-http")
    assert r.returncode == 1 and "--timeout: 'soon' is not a duration" in r.stderr
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    dst = str(tmp_path / "dst")
    r = fm("stage", str(tmp_path / "src"), dst, "--no-progress", "--log-interval", "1m")
    assert r.returncode == 0 and (tmp_path / "dst" / "f").read_bytes() == b"x", r.stderr
    r = fm("stage", str(tmp_path / "src"), dst, "--log-interval", "0")
    assert r.returncode == 2 and "--log-interval" in r.stderr


def test_convert_between_fmstore_torch_and_safetensors(tmp_path, fm):
    st = _state()
    torch.save(st, tmp_path / "a.pt")
    assert fm("ckpt", "convert", str(tmp_path / "a.pt"), str(tmp_path / "c")).returncode == 0
    out = fmstore.load(tmp_path / "c")
    assert torch.equal(out["w"], st["w"]) and out["step"] == 3
    r = fm("ckpt", "convert", str(tmp_path / "c"), str(tmp_path / "b.safetensors"))
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    flat = load_file(tmp_path / "b.safetensors")
    assert torch.equal(flat["model.tied"], st["w"]) and torch.equal(
        flat["model.w"], st["model"]["w"]
    )
    assert (
        fm("ckpt", "convert", str(tmp_path / "b.safetensors"), str(tmp_path / "d.pt")).returncode
        == 0
    )
    back = torch.load(tmp_path / "d.pt", weights_only=True)
    assert torch.equal(back["w"], st["w"])
    Manifest.loads((tmp_path / "c" / "manifest.json").read_bytes())


def test_inspect_of_missing_checkpoint_is_one_clear_error(tmp_path, fm):
    r = fm("ckpt", "inspect", str(tmp_path / "nothing"))
    assert (
        r.returncode == 1
        and r.stderr.startswith("error: no checkpoint")
        and "Traceback" not in r.stderr
    )


def test_gc_dry_run_counts_the_temp_files_the_real_run_removes(tmp_path):
    import torch
    from stage_data import fm_here

    import fmstore

    fmstore.save({"w": torch.ones(4)}, tmp_path / "c")
    temp = tmp_path / "c" / ".fmstore-tmp.crashed-writer"
    temp.write_bytes(b"half a blob")
    r = fm_here("ckpt", "gc", str(tmp_path), "--older-than", "0", "--dry-run")
    assert r.returncode == 0 and "would remove" in r.stdout, r.stdout + r.stderr
    assert "1 temp file" in r.stdout and temp.exists()
    r = fm_here("ckpt", "gc", str(tmp_path), "--older-than", "0")
    assert r.returncode == 0 and "1 temp file" in r.stdout and not temp.exists()
