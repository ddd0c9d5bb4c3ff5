"""Commands that delete on a POSIX tier never follow a symbolic link out of it: another
user may plant ``TIER/x/link -> /elsewhere`` on a shared file system and wait for a
``fmstore rm -r`` or ``fmstore ckpt gc`` run as root."""

from __future__ import annotations

import os

import torch
from stage_data import fm

import fmstore


def _env(tmp_path) -> dict[str, str]:
    tier = tmp_path / "tier"
    tier.mkdir()
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(f'[tiers.lustre]\nurl = "{tier}"\n')
    return {"FMSTORE_CONFIG": str(cfg), "FMSTORE_HOME": str(tmp_path / "home")}


def test_rm_r_deletes_links_never_what_they_point_to(tmp_path):
    env = _env(tmp_path)
    tier = tmp_path / "tier"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    run = tier / "scratch" / "run7"
    run.mkdir(parents=True)
    (run / "a.bin").write_bytes(b"a")
    os.symlink(outside, run / "link")
    os.symlink(outside / "secret", run / "leak")
    os.symlink(outside, tier / "scratch" / "evil")

    r = fm("rm", "-r", "lustre:scratch/evil", "--yes", env=env)
    assert r.returncode != 0 and "symbolic link" in r.stderr
    assert os.listdir(outside) == ["secret"]

    r = fm("rm", "-r", "lustre:scratch/run7", "--yes", env=env)
    assert r.returncode == 0, r.stderr
    assert not (run / "a.bin").exists()
    assert os.listdir(outside) == ["secret"] and (outside / "secret").read_bytes() == b"s"


def test_ckpt_gc_never_follows_a_link_out_of_the_tier(tmp_path):
    env = _env(tmp_path)
    tier = tmp_path / "tier"
    outside = tmp_path / "outside"
    m = fmstore.save({"w": torch.zeros(8)}, outside / "crashed")
    (outside / "crashed" / "manifest.json").unlink()  # a leftover gc would remove
    leftover = outside / "crashed" / m.generation / m.blobs[0].name
    (tier / "runs").mkdir()
    os.symlink(outside, tier / "runs" / "link")
    fmstore.save({"w": torch.zeros(8)}, tier / "runs" / "good")

    r = fm("ckpt", "gc", "lustre:runs/link", "--older-than", "0", env=env)
    assert r.returncode != 0
    assert leftover.exists()
    r = fm("ckpt", "gc", "lustre:runs", "--older-than", "0", env=env)
    assert r.returncode == 0, r.stderr
    assert leftover.exists()
    assert (tier / "runs" / "good" / "manifest.json").exists()


def test_a_checkpoint_blob_swapped_for_a_link_is_never_read(tmp_path):
    """The reader reads blobs on a POSIX tier with ``pread`` (or maps them): a blob replaced
    by a link to a file outside the tier is refused, under a prefixed tier too."""
    from fmstore.errors import PermissionDenied

    tier = tmp_path / "tier"
    ckpt = tier / "runs" / "a"
    fmstore.save({"w": torch.arange(1000, dtype=torch.float32)}, str(ckpt), compression="none")
    (blob,) = [p for p in ckpt.rglob("*.bin")]
    outside = tmp_path / "outside.bin"
    outside.write_bytes(blob.read_bytes())  # the same bytes: only the link can refuse it
    blob.unlink()
    os.symlink(outside, blob)
    from fmstore.config import from_dict
    from fmstore.stores import open_store

    cfg = from_dict({"tiers": {"lustre": {"url": str(tier)}}})
    for uri in (str(ckpt), "lustre:runs/a"):
        store = open_store(uri, config=cfg)
        for mmap in (False, True):
            try:
                fmstore.load(store, mmap=mmap)
            except PermissionDenied as e:
                assert "symbolic link" in str(e)
            else:
                raise AssertionError(f"{uri} (mmap={mmap}) read a blob through a link")
