"""How every command reads a location: a bare tier name is refused with the fix, reading,
listing or a dry run never creates anything, a missing location is an error."""

from __future__ import annotations

import os

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


def test_reading_a_missing_location_from_python_creates_nothing(tmp_path):
    from fmstore.errors import NotFound
    from fmstore.loaders import StreamingDataset

    missing = tmp_path / "does" / "not" / "exist"
    with pytest.raises(NotFound, match="does not exist"):
        StreamingDataset(str(missing), local=str(tmp_path / "cache"))
    with pytest.raises(NotFound):
        fmstore.load(missing)
    assert not (tmp_path / "does").exists()


def test_rm_lists_the_tracked_checkpoints_it_deletes_and_keeps_the_catalog_true(posix_cfg):
    from fmstore import CheckpointManager
    from fmstore.config import load_config
    from fmstore.tiering.inventory import catalog as cat

    cfg = load_config(str(posix_cfg))
    with CheckpointManager("runs/a", config=cfg, run_policies=False, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.ones(4)})

    def states() -> dict[int, str]:
        with cat.Catalog.for_state_dir(cfg.state_dir) as c:
            return {x.step: x.state for x in c.copies("runs/a", tier="nvme")}

    r = fm_here("rm", "-r", "--dry-run", "nvme:")
    assert r.returncode == 0, r.stderr
    assert "3 checkpoint copies the catalog tracks" in r.stderr
    assert "runs/a step 1 on nvme (present; the only copy)" in r.stderr
    assert "nothing deleted" in r.stderr and set(states().values()) == {"present"}
    # One object of step 1: that copy is missing (repairable), not present.
    r = fm_here("rm", "-y", "nvme:runs/a/step_000000000001/manifest.json")
    assert r.returncode == 0 and "some of its objects" in r.stderr, r.stderr
    assert states() == {1: "missing", 2: "present", 3: "present"}
    # A path inside the tier's directory is that tier too.
    r = fm_here("rm", "-r", "-y", os.path.join(cfg.tier("nvme").url, "runs/a/step_000000000002"))
    assert r.returncode == 0 and "runs/a step 2 on nvme (present" in r.stderr, r.stderr
    assert states() == {1: "missing", 2: "deleted", 3: "present"}
    r = fm_here("rm", "-r", "-y", "nvme:")
    assert r.returncode == 0 and "runs/a step 3 on nvme (present" in r.stderr, r.stderr
    assert states() == {1: "missing", 2: "deleted", 3: "deleted"}
    r = fm_here("ckpt", "list", "--json")
    assert r.returncode == 0 and "present" not in r.stdout, r.stdout


def test_missing_buckets_prefixes_and_run_roots_exit_1_with_one_clear_line(
    tmp_path, s3_server, s3_bucket, monkeypatch
):
    from stage_data import fm_here, s3_env

    from fmstore import config as fm_config

    for k, v in s3_env(s3_server, s3_bucket, tmp_path)["env"].items():
        monkeypatch.setenv(k, v)
    fm_config.set_config(None)
    src = tmp_path / "a.bin"
    src.write_bytes(b"x" * 100)
    bad_bucket = f"s3://{s3_bucket}-missing/x/a.bin"
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    r = fm_here("cp", str(src), bad_bucket)
    assert r.returncode == 1 and "does not exist" in r.stderr, r.stdout + r.stderr
    r = fm_here("stage", str(tmp_path), f"s3://{s3_bucket}-missing/x/")
    assert r.returncode == 1, r.stdout + r.stderr  # the same exit as cp
    r = fm_here("du", "s3:no/such/prefix")
    assert r.returncode == 1 and "'s3:no/such/prefix' does not exist" in r.stderr, r.stderr
    r = fm_here("cp", str(src), "s3:some/a.bin")
    assert r.returncode == 0, r.stderr
    r = fm_here("du", "-b", "s3:some/a.bin")  # one object is measured
    assert r.returncode == 0 and "100" in r.stdout, r.stdout + r.stderr
    r = fm_here("ckpt", "list", "s3:runs/x")
    assert r.returncode == 1 and "fmstore ckpt list runs/x" in r.stderr, r.stdout + r.stderr
    r = fm_here("ckpt", "list", "runs/x")
    assert r.returncode == 1 and "no checkpoint of run root 'runs/x'" in r.stderr
    fm_config.set_config(None)
