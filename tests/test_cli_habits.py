"""CLI habits users bring from s5cmd, rclone and the aws cli: Slurm sharding only inside an
srun step, ``--json`` on every command that prints results, ``ls`` of objects and globs,
``rm`` of prefixes, verbosity options, help and output polish, ``py.typed``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from stage_data import fm

ROOT = Path(__file__).resolve().parent.parent
_SHARD_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "RANK", "WORLD_SIZE")


@pytest.fixture
def no_shard_env(monkeypatch):
    for var in _SHARD_VARS:
        monkeypatch.delenv(var, raising=False)


def _tree(root: Path, n: int = 40) -> Path:
    root.mkdir()
    for i in range(n):
        (root / f"f{i:02d}.fms").write_bytes(os.urandom(100))
    return root


# ---- 1. Slurm: shards only inside an srun step ---------------------------------------------


def test_batch_script_with_ntasks_stages_everything(tmp_path, no_shard_env):
    """A batch script run once with --ntasks=4 sees SLURM_NTASKS=4 and SLURM_PROCID=0 but no
    step: it must copy all the data, and say so."""
    src = _tree(tmp_path / "src")
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "FMSTORE_HOME": str(tmp_path / "h")}
    r = fm("stage", str(src), str(tmp_path / "d"), "--json", "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["files_copied"] == 40 and out["shard"] == "all"
    assert "shard all" in r.stderr and "not inside an srun step" in r.stderr
    assert len(os.listdir(tmp_path / "d")) == 40


def test_srun_step_tasks_stage_their_shard_and_say_which(tmp_path, no_shard_env):
    src = _tree(tmp_path / "src")
    copied = 0
    for k in range(4):
        env = {
            "SLURM_PROCID": str(k),
            "SLURM_NTASKS": "4",
            "SLURM_STEP_ID": "0",
            "FMSTORE_HOME": str(tmp_path / "h"),
        }
        r = fm("stage", str(src), str(tmp_path / "d"), "--json", "--no-progress", env=env)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["shard"] == f"{k}/4" and f"shard {k}/4" in r.stderr.splitlines()[-1]
        copied += out["files_copied"]
    assert copied == 40


def test_dry_run_plan_says_which_shard(tmp_path, no_shard_env):
    src = _tree(tmp_path / "src", 3)
    r = fm("stage", str(src), str(tmp_path / "d"), "-n", "--shard", "1/2", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["shard"] == "1/2", r.stderr
    r = fm("stage", str(src), str(tmp_path / "d"), "-n")
    assert r.returncode == 0 and "shard all" in r.stdout, r.stderr


# ---- 6. py.typed ---------------------------------------------------------------------------


def test_py_typed_ships_in_the_wheel(tmp_path):
    """PEP 561: the marker exists, pyproject declares it, and a built wheel holds it."""
    import shutil
    import subprocess
    import sys
    import zipfile

    assert (ROOT / "fmstore" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(
        r'\[tool\.setuptools\.package-data\]\s*fmstore = \[[^]]*"py\.typed"', pyproject
    )
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "fmstore", src / "fmstore", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "dist")],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = tmp_path / "dist" / r.stdout.strip().splitlines()[-1]
    assert "fmstore/py.typed" in zipfile.ZipFile(wheel).namelist()


# ---- 3. ls of objects and globs, missing prefixes, rm of prefixes --------------------------


def _ds(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    for name in ("a.fms", "b.fms", "c.json", "sub/d.fms"):
        (root / name).write_bytes(b"x" * 10)
    return root


def test_ls_of_an_object_and_of_a_glob_on_posix(tmp_path):
    ds = _ds(tmp_path / "ds")
    r = fm("ls", str(ds / "a.fms"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["a.fms", "1 object, 10 B"]
    r = fm("ls", str(ds / "*.fms"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["a.fms", "b.fms", "2 objects, 20 B"]
    r = fm("ls", "-r", "--json", str(ds / "*.fms"))
    assert r.returncode == 0, r.stderr
    assert [e["key"] for e in json.loads(r.stdout)["entries"]] == ["a.fms", "b.fms", "sub/d.fms"]
    r = fm("ls", str(ds / "*.zip"))
    assert r.returncode == 1 and "no objects match" in r.stderr


def test_rm_of_a_directory_without_r_says_use_r_and_rm_r_removes_the_directories(tmp_path):
    ds = _ds(tmp_path / "ds")
    r = fm("rm", "-y", str(ds))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "rm -r" in r.stderr and (ds / "a.fms").exists()
    r = fm("rm", "-r", "-y", str(ds))
    assert r.returncode == 0, r.stderr
    assert "deleted 4 objects" in r.stderr
    assert not ds.exists() and tmp_path.exists()


def test_du_and_ls_json(tmp_path):
    ds = _ds(tmp_path / "ds")
    r = fm("du", "--json", str(ds))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["bytes"] == 40 and doc["files"] == 4
    assert {"prefix": "sub/", "bytes": 10, "files": 1} in doc["groups"]
    r = fm("du", str(ds))
    assert "1 file " in r.stdout and "4 files" in r.stdout and "1 files" not in r.stdout
    r = fm("ls", "--json", str(ds))
    doc = json.loads(r.stdout)
    assert (doc["files"], doc["dirs"], doc["bytes"]) == (3, 1, 30)
    assert {"key": "sub/", "is_dir": True, "lazy": False}.items() <= doc["entries"][-1].items()


@pytest.mark.s3
def test_ls_rm_on_s3_as_on_posix(tmp_path, s3_server, s3_bucket, no_shard_env):
    from stage_data import s3_env

    s3 = s3_env(s3_server, s3_bucket, tmp_path)
    env = s3["env"]
    ds = _ds(tmp_path / "ds")
    r = fm("stage", str(ds), "s3:d1", "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    r = fm("ls", "s3:d1/a.fms", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["a.fms", "1 object, 10 B"]
    r = fm("ls", "s3:d1/*.fms", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["a.fms", "b.fms", "2 objects, 20 B"]
    # A missing prefix: the same exit code (1) and kind of message as on a file system.
    r_s3 = fm("ls", "s3:nothing/here", env=env)
    r_posix = fm("ls", str(tmp_path / "nothing"))
    assert r_s3.returncode == r_posix.returncode == 1, r_s3.stdout
    assert "does not exist" in r_s3.stderr and "does not exist" in r_posix.stderr
    r = fm("ls", "s3:", env=env)  # a tier's root is listed, even when nearly empty
    assert r.returncode == 0 and "d1/" in r.stdout, r.stderr
    r = fm("rm", "-y", "s3:d1", env=env)
    assert r.returncode == 1 and "rm -r" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # an S3 folder marker below ("Create folder" in the AWS console) goes with rm -r too
    client = s3_server.boto3_client()
    client.put_object(Bucket=s3_bucket, Key="ds/d1/empty/", Body=b"")
    r = fm("rm", "-r", "-y", "s3:d1", env=env)
    assert r.returncode == 0 and "deleted 4 objects" in r.stderr, r.stderr
    assert "Contents" not in client.list_objects_v2(Bucket=s3_bucket, Prefix="ds/d1/")


# ---- 2. --json on every command that prints results ----------------------------------------


def test_every_result_printing_command_has_json():
    from typer.main import get_command

    from fmstore.cli import main as cli

    cli._register(["--help"])
    root = get_command(cli.app)
    for path in (
        ["ls"],
        ["du"],
        ["stage"],
        ["hydrate"],
        ["release"],
        ["gc"],
        ["ckpt", "inspect"],
        ["ckpt", "verify"],
        ["ckpt", "list"],
        ["dataset", "inspect"],
    ):
        cmd = root
        for name in path:
            cmd = cmd.get_command(None, name)  # type: ignore[attr-defined]
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        assert "--json" in opts, f"fmstore {' '.join(path)} has no --json"


def test_ckpt_inspect_and_verify_json(tmp_path):
    import torch
    from stage_data import fm_here

    import fmstore

    m = fmstore.save({"w": torch.randn(16, 8), "b": torch.zeros(8)}, tmp_path / "c")
    r = fm_here("ckpt", "inspect", "--json", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["format"] == "fmstore" and doc["tensor_count"] == 2
    assert {t["name"]: t["shape"] for t in doc["tensors"]} == {"w": [16, 8], "b": [8]}
    assert doc["bytes"] == (16 * 8 + 8) * 4
    r = fm_here("ckpt", "verify", "--json", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["problems"] == [] and doc["chunks"] >= 1
    blob = tmp_path / "c" / m.generation / m.blobs[0].name
    data = bytearray(blob.read_bytes())
    data[10] ^= 1
    blob.write_bytes(bytes(data))
    r = fm_here("ckpt", "verify", "--json", str(tmp_path / "c"))
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["problems"]


# ---- 4. verbosity: -v / -q / FMSTORE_LOG_LEVEL ---------------------------------------------


def test_verbosity_options_and_env_configure_the_fmstore_loggers(tmp_path, no_shard_env):
    src = _tree(tmp_path / "src", 2)
    env = {"FMSTORE_HOME": str(tmp_path / "h")}
    dst = str(tmp_path / "d")
    quiet = fm("stage", str(src), dst, "--no-progress", env=env)
    assert quiet.returncode == 0 and "DEBUG" not in quiet.stderr, quiet.stderr
    debug_lines = []
    for args, extra in (
        (["-vv"], {}),
        ([], {"FMSTORE_LOG_LEVEL": "DEBUG"}),
        ([], {"FMSTORE_LOG_LEVEL": "debug"}),
    ):
        r = fm(*args, "stage", str(src), dst, "--no-progress", env={**env, **extra})
        assert r.returncode == 0, r.stderr
        lines = [line for line in r.stderr.splitlines() if line.startswith("DEBUG ")]
        assert any(line.startswith("DEBUG fmstore.tiering.staging.stage: plan ") for line in lines)
        assert any(line.startswith("DEBUG fmstore.stores: opening ") for line in lines)
        assert len(lines) == len(set(lines)), "one handler: no line twice"
        debug_lines.append(len(lines))
    assert len(set(debug_lines)) == 1
    r = fm("-v", "stage", str(src), dst, "--no-progress", env=env)
    assert r.returncode == 0 and "DEBUG" not in r.stderr
    r = fm("-q", "stage", str(src), dst, "--no-progress", env={**env, "FMSTORE_LOG_LEVEL": "DEBUG"})
    assert r.returncode == 0 and "DEBUG" not in r.stderr
    r = fm("ls", str(src), env={"FMSTORE_LOG_LEVEL": "chatty"})
    assert r.returncode == 2 and "FMSTORE_LOG_LEVEL" in r.stderr


def test_daemon_keeps_its_json_log_lines_under_verbose(tmp_path):
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f"""
state_dir = "{tmp_path}/state"
[tiers.nvme]
url = "{tmp_path}/nvme"
[tiers.lustre]
url = "{tmp_path}/lustre"
[policies]
[[policies.export]]
to = "lustre"
every_saves = 1
"""
    )
    for args, extra in ((["-vv"], {}), ([], {"FMSTORE_LOG_LEVEL": "DEBUG"})):
        r = fm(*args, "daemon", "--config", str(cfg), "--once", "--no-http", env=extra)
        assert r.returncode == 0, r.stderr
        events = [json.loads(line) for line in r.stderr.splitlines()]  # every line is JSON
        assert events and any(e.get("level", "").lower() == "debug" for e in events), events


# ---- 5. help and output polish ---------------------------------------------------------------


def test_help_keeps_bracketed_config_sections_and_starts_without_a_blank_line():
    env = {"COLUMNS": "200", "TERM": "dumb"}
    r = fm("daemon", "--help", env=env)
    assert r.returncode == 0 and "(overrides [daemon] port)" in r.stdout, r.stdout
    r = fm("stage", "--help", env=env)
    assert r.returncode == 0 and "[stage] preserve_owner" in " ".join(r.stdout.split())
    for args in (["--help"], ["stage", "--help"], ["ckpt", "--help"], ["dataset", "--help"]):
        r = fm(*args, env=env)
        assert r.returncode == 0 and r.stdout.strip() and r.stdout[0] != "\n", (args, r.stdout)


def test_outputs_use_singulars_and_start_without_a_blank_line(tmp_path, no_shard_env):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"x")
    env = {"FMSTORE_HOME": str(tmp_path / "h")}
    r = fm("stage", str(src), str(tmp_path / "d"), "--no-progress", env=env)
    assert r.returncode == 0 and r.stderr.startswith("copied 1 file (1 B)"), r.stderr
    r = fm("stage", "-n", str(src), str(tmp_path / "e"), env=env)
    assert r.stdout.startswith("plan: 1 file, 1 B selected"), r.stdout
    for args in (["ls", str(src)], ["ls", "-l", str(src)], ["du", str(src)]):
        r = fm(*args)
        assert r.returncode == 0 and r.stdout.strip() and r.stdout[0] != "\n", (args, r.stdout)
        assert "1 objects" not in r.stdout and "1 files" not in r.stdout, r.stdout
    assert fm("ls", str(src)).stdout.splitlines()[-1] == "1 object, 1 B"


def test_a_missing_tier_location_names_the_resolved_path(tmp_path):
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(f'[tiers.lustre]\nurl = "{tmp_path}/lustre"\n')
    env = {"FMSTORE_CONFIG": str(cfg), "FMSTORE_HOME": str(tmp_path / "h")}
    for args in (["ls", "lustre:ds/x"], ["stage", "lustre:ds/x", str(tmp_path / "d")]):
        r = fm(*args, env=env)
        assert r.returncode == 1 and f"({tmp_path}/lustre/ds/x: tier lustre of " in r.stderr, (
            r.stderr
        )
