"""The small things a first day on one machine runs into: the module lists what it serves,
``latest_step()`` right after a save, ``ckpt gc --dry-run`` counts what the real run
removes, missing locations and buckets exit 1 with one clear line, retries of a dead
endpoint are said, config errors come together, output to a file is not wrapped."""

from __future__ import annotations

import subprocess
import sys
import threading

from tiering_helpers import posix_config, state

from fmstore import CheckpointManager, runtime


def test_dir_of_the_module_lists_the_names_served_on_first_use():
    code = "import fmstore, sys; print(sorted(set(dir(fmstore)) & {'save', 'load', 'CheckpointManager', 'async_save'})); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    listed, torch_loaded = out.stdout.splitlines()
    assert listed == str(["CheckpointManager", "async_save", "load", "save"])
    assert torch_loaded == "False"  # listing them does not import them


def test_latest_step_right_after_an_async_save_is_that_step(tmp_path, monkeypatch):
    import types

    from fmstore.tiering import manager

    cfg = posix_config(str(tmp_path), {}, tiers=("nvme",))
    with CheckpointManager("r", config=cfg, run_policies=False) as mgr:
        assert mgr.latest_step() is None  # the tiers are scanned now, not under the block
        started, release = threading.Event(), threading.Event()

        async def hold_the_loop() -> None:
            started.set()
            release.wait()  # blocks fmstore's loop: the save cannot commit meanwhile

        # The save is held until latest_step() either waits for it or has read the catalog.
        def wait(*a, **kw):
            release.set()
            return cf.wait(*a, **kw)

        def copies(*a, _orig=mgr.catalog.copies, **kw):
            out = _orig(*a, **kw)
            release.set()
            return out

        import concurrent.futures as cf

        monkeypatch.setattr(manager, "cf", types.SimpleNamespace(**{**vars(cf), "wait": wait}))
        monkeypatch.setattr(mgr.catalog, "copies", copies)
        held = runtime.submit(hold_the_loop())
        started.wait()
        mgr.save(1, state(1))
        assert mgr.latest_step() == 1
        held.result(60)
        monkeypatch.undo()


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


def test_a_dead_endpoint_says_what_is_retried_after_the_first_failed_attempt(tmp_path):
    import socket

    from stage_data import fm

    with socket.socket() as dead:  # bound, never listening: every connection is refused
        dead.bind(("127.0.0.1", 0))
        port = dead.getsockname()[1]
        cfg = tmp_path / "fmstore.toml"
        cfg.write_text(
            f'[tiers.s3]\nurl = "s3://bucket/ds"\nendpoint_url = "http://127.0.0.1:{port}"\n'
            'region = "us-east-1"\nmax_attempts = 2\n'
        )
        env = {"FMSTORE_CONFIG": str(cfg), "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
        r = fm("ls", "s3:x", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    retry = [i for i, line in enumerate(lines) if "retrying, up to 2 attempts" in line]
    assert len(retry) == 1 and "tier s3" in lines[retry[0]], r.stderr
    assert "connection" in lines[retry[0]] and retry[0] < len(lines) - 1  # before the error


def test_every_config_error_is_reported_at_once(tmp_path):
    import pytest

    from fmstore.config import load_config
    from fmstore.errors import ConfigError

    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        '[tiers.nvme]\nurl = "/tmp/nvme"\ncolour = "red"\n'
        '[s3]\nmax_attempts = "many"\n'
        "[polices]\nladder = []\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    msg = str(e.value)
    assert msg.startswith(f"3 problems in {cfg}:"), msg
    for what in ("line 3", "'colour'", "line 5", "max_attempts", "line 6", "'polices'"):
        assert what in msg, what
    from stage_data import fm_here

    r = fm_here("daemon", "--check", "--config", str(cfg))
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and len(lines) == 4, r.stderr  # the count, then one per problem
    assert "line 3" in lines[1] and "line 5" in lines[2] and "line 6" in lines[3]


def test_output_piped_to_a_file_is_not_wrapped_at_80_columns(tmp_path):
    import os

    name = "very_long_file_name_" * 5 + "x.bin"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / name).write_bytes(b"x")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    with open(tmp_path / "out.txt", "w") as out:
        subprocess.run(
            [sys.executable, "-m", "fmstore", "ls", "-l", str(tmp_path / "d")],
            stdout=out,
            env=env,
            check=True,
            timeout=120,
        )
    text = (tmp_path / "out.txt").read_text()
    assert any(name in line and "1 B" in line for line in text.splitlines()), text


def test_the_demo_plots_step_labels_that_do_not_overlap(tmp_path, monkeypatch):
    import json
    import time

    import matplotlib.pyplot as plt
    from rich.console import Console

    from fmstore.demo.report import plot
    from fmstore.tiering import catalog as cat
    from fmstore.tiering.catalog import Catalog

    (tmp_path / "fmstore.toml").write_text(
        f'state_dir = "{tmp_path / "state"}"\n[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
    )
    t0 = time.time() - 60
    log = tmp_path / "log.jsonl"
    log.write_text(
        "".join(
            json.dumps({"event": "step", "pid": 1, "t": t0 + i, "loss": 1 / (i + 1)}) + "\n"
            for i in range(60)
        )
    )
    with Catalog.for_state_dir(str(tmp_path / "state")) as c:
        for i in range(120):  # a save every half second: as dense as the demo's
            step = 10 * i
            c.record_checkpoint("runs/demo", step, created=t0 + i / 2)
            for tier in ("nvme", "lustre", "s3"):
                c.set_copy("runs/demo", step, tier, cat.PRESENT, verified=t0 + i / 2 + 0.1)
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    plot(tmp_path, log, Console(quiet=True))
    (fig,) = figs
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[1]
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(boxes) >= 30  # a label for many steps on every tier, not none
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
