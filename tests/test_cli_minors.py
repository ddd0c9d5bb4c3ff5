"""The small things a new user trips on, each through the CLI on real files (and SeaweedFS
for S3): no progress bar or wrapped title in a file or a pipe; a ``.npy`` token directory
read with its own dtype; a save that never committed listed as such; ``ckpt gc`` leaving no
empty generation directory; ``stage --no-progress`` keeping its log lines and a ``--verify``
help that says what is checked; ``rm`` of several URLs; a missing object named by its full
URL; the ``-vv`` plan naming its destination; ``convert --to dcp`` without torch's
warning and ``1 rank``; ``/healthz`` saying what its time is; an export failure naming its
location once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import warnings

import numpy as np
import pytest
import torch
from stage_data import fm_here
from tiering_helpers import posix_config

import fmstore
from fmstore import CheckpointManager
from fmstore.tiering.inventory.catalog import Catalog


def _env() -> dict[str, str]:
    """This process's environment (its config included) for a spawned CLI."""
    return {"PYTHONPATH": os.getcwd(), **os.environ}


def _ckpt(path) -> str:
    """A small committed checkpoint at ``path``."""
    fmstore.save({"w": torch.arange(6, dtype=torch.float32)}, str(path))
    return str(path)


# ---- 1. nothing of a terminal's display in a file or a pipe -----------------------------------


def test_verify_writes_no_bar_into_a_file(posix_cfg, tmp_path):
    ck = _ckpt(tmp_path / "a-checkpoint-whose-location-is-longer-than-its-table-is-wide")
    r = fm_here("ckpt", "verify", ck)  # stderr is a file here (``2>err``), not a terminal
    assert r.returncode == 0 and r.stdout.startswith("ok: 1 chunk"), r.stderr
    assert r.stderr == ""  # no bar, no escape sequence: nothing but what went wrong


def test_inspect_writes_no_wrapped_title_into_a_pipe(posix_cfg, tmp_path):
    ck = _ckpt(tmp_path / "a-checkpoint-whose-location-is-longer-than-its-table-is-wide")
    r = fm_here("ckpt", "inspect", ck)  # stdout is a pipe here, not a terminal
    assert r.returncode == 0, r.stderr
    title, *table = r.stdout.splitlines()
    assert title.startswith(f"file://{ck}  (format v1, ") and title.endswith(")")
    assert "\x1b" not in r.stdout
    assert table[-1] == "1 tensor in 1 storage, 1 blob: 24 B raw, 24 B stored (ratio 1.00)"


# ---- 2. a .npy token directory, as documented ---------------------------------------------------


def test_npy_token_directory_is_read_with_the_dtype_its_headers_give(posix_cfg, tmp_path):
    ds = tmp_path / "tokens"
    ds.mkdir()
    np.save(ds / "a.npy", np.arange(1000, dtype=np.uint16))
    np.save(ds / "b.npy", np.arange(1000, 2000, dtype=np.uint16))
    r = fm_here("dataset", "inspect", str(ds), "--seq-len", "100", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["format"] == "tokens" and info["dtype"] == "uint16" and info["samples"] == 18
    # Given, it must match the headers; a raw .bin beside them needs it; big-endian is refused.
    r = fm_here("dataset", "inspect", str(ds), "--seq-len", "100", "--dtype", "uint32")
    assert r.returncode == 1 and "holds uint16 tokens, not uint32" in r.stderr
    (ds / "c.bin").write_bytes(np.arange(500, dtype="<u2").tobytes())
    r = fm_here("dataset", "inspect", str(ds), "--seq-len", "100")
    assert r.returncode == 1 and "c.bin is a raw token file (no header): give dtype" in r.stderr
    (ds / "c.bin").unlink()
    np.save(ds / "b.npy", np.arange(1000, dtype=">u2"))
    r = fm_here("dataset", "inspect", str(ds), "--seq-len", "100")
    assert r.returncode == 1 and "b.npy: holds big-endian uint16 tokens" in r.stderr


# ---- 3. a save that never committed -------------------------------------------------------------


def test_a_save_that_raised_before_its_commit_is_listed_not_committed(posix_cfg, tmp_path):
    with CheckpointManager("runs/a", run_policies=False) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).result()
        with pytest.raises(TypeError):  # not storable without pickle: the save raises
            mgr.save(2, {"w": torch.ones(3), "o": object()}).result()
    assert not (tmp_path / "nvme" / "runs" / "a" / "step_000000000002").exists()
    r = fm_here("ckpt", "list", "runs/a")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[1]: line for line in r.stdout.splitlines() if "runs/a" in line}
    assert "present" in rows["1"]
    assert "not committed" in rows["2"] and "deleted" not in rows["2"], r.stdout
    assert "1 checkpoint;" in r.stdout  # listed, not counted
    r = fm_here("ckpt", "list", "runs/a", "--json")
    nvme = {e["step"]: e["tiers"]["nvme"] for e in json.loads(r.stdout)}
    assert nvme[2]["state"] == "deleted" and nvme[2]["never_committed"] is True
    assert nvme[2]["error"] == "save failed: TypeError" and "never_committed" not in nvme[1]


# ---- 4. ckpt gc --older-than 0 ------------------------------------------------------------------


def test_gc_of_a_killed_saves_temp_file_leaves_no_empty_generation_directory(posix_cfg, tmp_path):
    root = tmp_path / "run"
    _ckpt(root / "step_000000000001")
    gen = "step_000000000002/g01a2359c418e-da0ffdf8"
    # A writer killed mid-blob: its temp file is all that is left of the save.
    killed = (
        "import os\nfrom fmstore import runtime\nfrom fmstore.stores import open_store\n"
        f"s = open_store({str(root)!r})\n"
        "async def go():\n"
        f"    w = await s.open_writer({gen + '/000000.bin'!r})\n"
        "    await w.write(b'x' * 4096)\n"
        "runtime.run(go())\nos._exit(9)\n"
    )
    r = subprocess.run([sys.executable, "-c", killed], env=_env(), timeout=120)
    assert r.returncode == 9 and [p.name for p in (root / gen).iterdir()][0].startswith(
        ".fmstore-tmp."
    )
    r = fm_here("ckpt", "gc", str(root), "--older-than", "0")
    assert r.returncode == 0 and "1 temp file" in r.stdout, r.stdout + r.stderr
    assert sorted(os.listdir(root)) == ["step_000000000001"]  # no empty directory left
    assert fmstore.load(str(root / "step_000000000001"))["w"].sum() == 15


# ---- 5. stage: --no-progress keeps the lines; --verify says what it checks ----------------------


def test_stage_no_progress_keeps_the_log_interval_lines_and_verify_help_is_exact(
    posix_cfg, tmp_path
):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"f{i}.bin").write_bytes(os.urandom(1 << 20))
    # 4 MiB at 2 MiB/s: the copy takes over a second, the lines come every 0.2 s.
    args = ["stage", str(src), "--bwlimit", "2MiB/s", "--log-interval", "0.2s", "--no-progress"]
    r = fm_here(*args[:2], str(tmp_path / "d1"), *args[2:])
    assert r.returncode == 0, r.stderr
    assert "stage: " in r.stderr and " files, " in r.stderr, r.stderr
    help_text = " ".join(fm_here("stage", "--help").stdout.split())
    assert "Re-read" not in help_text
    assert "on S3 against the checksum the server computed and validated at upload" in help_text
    assert "by reading the file back" in help_text


# ---- 6, 7. rm of several URLs; a missing object named in full ---------------------------------


def test_rm_takes_several_urls_each_resolved_first_and_confirmed(posix_cfg, tmp_path):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    for name in ("a", "b", "sub/c"):
        (d / name).write_text(name)
    a, b, sub = str(d / "a"), str(d / "b"), str(d / "sub")
    r = fm_here("rm", a, b)  # not a terminal, no --yes: refused before anything goes
    assert r.returncode == 2 and "Nothing deleted." in r.stderr and (d / "a").exists()
    r = fm_here("rm", "-y", a, str(d / "missing"))  # each resolved first: nothing deleted
    assert r.returncode == 1 and f"file://{d}/missing" in r.stderr and (d / "a").exists()
    r = fm_here("rm", "-n", a, b)
    assert r.returncode == 0 and r.stderr.count("dry run: would delete") == 2
    r = fm_here("rm", "-y", a, b)
    assert r.returncode == 0, r.stderr
    assert f"deleted 1 object ({a})" in r.stderr and f"deleted 1 object ({b})" in r.stderr
    r = fm_here("rm", "-r", "-y", sub)
    assert r.returncode == 0 and "deleted 1 object\n" in r.stderr  # one URL: as before
    assert os.listdir(d) == []


@pytest.fixture
def s3_tier_cfg(tmp_path, s3_server, s3_bucket, monkeypatch):
    from fmstore import config as fm_config

    for k, v in s3_server.env().items():
        if k.startswith("AWS_") and "ENDPOINT" not in k:
            monkeypatch.setenv(k, v)
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[tiers.s3]\nurl = "s3://{s3_bucket}/team"\nendpoint_url = "{s3_server.endpoint_url}"\n'
        f'region = "{s3_server.region}"\naddressing_style = "path"\n'
    )
    monkeypatch.setenv("FMSTORE_CONFIG", str(cfg))
    fm_config.set_config(None)
    yield s3_bucket
    fm_config.set_config(None)


def test_rm_of_a_missing_object_under_a_prefixed_s3_tier_names_its_full_url(s3_tier_cfg, tmp_path):
    (tmp_path / "x").write_text("x")
    assert fm_here("cp", str(tmp_path / "x"), "s3:ds/x").returncode == 0
    r = fm_here("rm", "-y", "s3:ds/missing")
    assert r.returncode == 1, r.stderr
    assert f"s3://{s3_tier_cfg}/team/ds/missing" in r.stderr, r.stderr
    r = fm_here("rm", "-y", "s3:ds/x")
    assert r.returncode == 0 and "deleted 1 object" in r.stderr, r.stderr


# ---- 8. -vv names the destination --------------------------------------------------------------


def test_verbose_stage_plan_names_a_destination_not_there_yet(posix_cfg, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    dst = tmp_path / "new"
    r = fm_here("-vv", "stage", str(src), str(dst), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"plan file://{src} -> file://{dst} (not there yet): 1 of 1" in r.stderr, r.stderr


# ---- 9. convert --to dcp and inspect of its result ---------------------------------------------


def test_convert_to_dcp_warns_nothing_and_inspect_says_1_rank(posix_cfg, tmp_path):
    ck, out = _ckpt(tmp_path / "ck"), str(tmp_path / "dcp")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = fm_here("ckpt", "convert", ck, out, "--to", "dcp")
    assert r.returncode == 0 and "converted 1 tensor:" in r.stdout, r.stderr
    assert [w for w in seen if "torch.distributed is disabled" in str(w.message)] == []
    r = fm_here("ckpt", "inspect", out)
    assert r.returncode == 0, r.stderr
    assert "(native torch DCP, 1 rank, " in r.stdout and "from 1 rank:" in r.stdout, r.stdout
    assert "1 entry in 1 saved item, 1 file" in r.stdout


# ---- 10, 11. the daemon: /healthz, export failures -----------------------------------------


def test_healthz_names_its_time_and_steps_and_an_export_failure_its_location_once(tmp_path):
    from fmstore.tiering.service.daemon import Daemon, DaemonSettings

    config = posix_config(str(tmp_path), {"export": [{"to": "lustre", "every_saves": 1}]})
    with CheckpointManager("run", config=config, run_policies=False) as mgr:
        mgr.save(1, {"w": torch.ones(3)})
    # Something in the way of the export: a file where its directory goes.
    (tmp_path / "lustre" / "run").mkdir(parents=True)
    (tmp_path / "lustre" / "run" / "step_000000000001").write_bytes(b"")
    d = Daemon(config, settings=DaemonSettings(port=0, interval=0.05))
    try:
        port = d.start_http()
        before = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").read())
        assert before["last_step_at"] is None and before["policy_steps"] == 0
        assert d.run(max_steps=1) == 1  # the export failed
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").read())
    finally:
        d.close()
    assert health["policy_steps"] == 1 and isinstance(health["last_step_at"], float)
    assert health["last_step"] == health["last_step_at"]  # the old name, kept
    with Catalog.for_state_dir(config.state_dir) as cat:
        error = cat.copy("run", 1, "lustre").error
    assert error is not None and error.startswith("copy failed: "), error
    assert error.count("step_000000000001") == 1 and error.count("(tier lustre") == 1, error
