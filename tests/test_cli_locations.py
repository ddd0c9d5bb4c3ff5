"""How every command reads a location: a bare tier name is refused with the fix, reading,
listing or a dry run never creates anything, a missing location is an error."""

from __future__ import annotations

import pytest
import torch
from stage_data import fm_here

import fmstore
from fmstore.errors import ConfigError


@pytest.fixture
def here(tmp_path, monkeypatch, posix_cfg):
    """Working directory ``tmp_path/work`` holding a directory named like the nvme tier."""
    work = tmp_path / "work"
    (work / "nvme").mkdir(parents=True)
    (work / "nvme" / "keep").write_bytes(b"k")
    monkeypatch.chdir(work)
    monkeypatch.setenv("COLUMNS", "200")
    return work


@pytest.mark.parametrize(
    "args",
    [
        ("gc", "nvme", "--dry-run"),
        ("gc", "nvme"),
        ("ls", "nvme"),
        ("rm", "-r", "-y", "nvme"),
        ("stage", "nvme", "lustre:x"),
        ("ckpt", "gc", "nvme"),
    ],
    ids=lambda a: " ".join(a),
)
def test_a_bare_tier_name_is_refused_with_the_fix(here, args):
    r = fm_here(*args)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "'nvme' is the name of a configured tier: write 'nvme:'" in r.stderr
    assert "'./nvme'" in r.stderr and r.stderr.count("\n") == 1
    assert (here / "nvme" / "keep").read_bytes() == b"k"


def test_the_api_reads_a_bare_tier_name_alike(here):
    with pytest.raises(ConfigError, match="write 'nvme:'"):
        fmstore.save({"t": torch.ones(1)}, "nvme")
    fmstore.save({"t": torch.ones(1)}, "./nvme/c")  # the directory, said plainly
    assert torch.equal(fmstore.load("./nvme/c")["t"], torch.ones(1))
    assert not (here.parent / "nvme" / "c").exists()  # not on the tier
    r = fm_here("ls", "./nvme")
    assert r.returncode == 0 and "keep" in r.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("gc", "{}", "--dry-run"),
        ("gc", "{}"),
        ("ckpt", "gc", "{}", "--dry-run"),
        ("ckpt", "gc", "{}"),
        ("dataset", "inspect", "{}"),
        ("ls", "{}"),
        ("du", "{}"),
    ],
    ids=lambda a: " ".join(a).replace(" {}", ""),
)
def test_a_missing_location_is_an_error_and_is_never_created(here, tmp_path, args):
    missing = tmp_path / "does" / "not" / "exist"
    r = fm_here(*(a.format(missing) for a in args))
    assert r.returncode == 1 and "does not exist" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "does").exists()
