from __future__ import annotations

import os
import subprocess
import sys

import fmstore


def fm(*args: str, **kw):
    return subprocess.run(
        [sys.executable, "-m", "fmstore", *args], capture_output=True, text=True, timeout=120, **kw
    )


def test_version_and_help():
    r = fm("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"fmstore {fmstore.__version__}"
    r = fm("--help")
    assert r.returncode == 0 and "ls" in r.stdout


def test_every_command_and_option_is_explained():
    """``--help`` teaches: every command and option says what it does, and each paragraph
    of a command's description reads as one (no line breaks from the source's wrapping)."""
    r = fm("stage", "--help", env={**os.environ, "COLUMNS": "80", "TERM": "dumb"})
    assert r.returncode == 0
    assert "resumes where it stopped" in " ".join(r.stdout.split())
    from typer._click import Context
    from typer.main import get_command

    from fmstore.cli import main as cli

    cli._register(["--help"])
    root = get_command(cli.app)
    todo = [("fmstore", root)]
    seen = 0
    while todo:
        name, cmd = todo.pop()
        seen += 1
        ctx = Context(cmd)
        for p in cmd.params:
            if p.param_type_name == "option" and p.name != "help":
                assert getattr(p, "help", None), f"{name} {p.opts}: no help"
        for para in (cmd.help or "").split("\n\n"):
            assert "\n" not in para, f"{name}: {para!r}"
        for sub in getattr(cmd, "list_commands", lambda c: [])(ctx):
            todo.append((f"{name} {sub}", cmd.get_command(ctx, sub)))
    assert seen > 15


def test_ls_lists_with_total(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 2048)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"y")
    r = fm("ls", "-r", "-l", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "d/b" in r.stdout and "2 objects" in r.stdout


def test_errors_are_one_clear_line(tmp_path):
    r = fm("ls", "nosuchtier:x", cwd=tmp_path)
    assert r.returncode == 1
    # the config in effect, then the error: one line each
    said = r.stderr.strip().splitlines()
    assert said[-1].startswith("error: unknown tier 'nosuchtier'"), said
    assert [x for x in said[:-1] if not x.startswith("config: ")] == [], said
    assert "Traceback" not in r.stderr


def test_copy_commands_start_without_metrics_or_rich(tmp_path):
    """Only the daemon serves metrics: a copy logging to a file loads neither
    prometheus_client nor rich (about 75 ms of start-up), and still copies."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 1000)
    r = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "fmstore",
            "stage",
            str(src),
            str(tmp_path / "d"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "d" / "a.bin").read_bytes() == b"x" * 1000
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "fmstore.stores.posix" in imported
    assert not {m for m in imported if m.startswith(("prometheus_client", "rich"))}


def test_help_and_tiering_commands_start_without_torch(posix_cfg, tmp_path):
    """torch takes about 0.8 s to import: ``--help``, ``ckpt list`` and the daemon's
    modules read manifests and catalogs, never tensors, so they do not load it (nor
    numpy, which only the codecs need)."""
    import torch

    fmstore.save({"w": torch.ones(4)}, str(tmp_path / "nvme" / "run" / "step_000000000007"))
    probe = (
        "import sys\n"
        "from fmstore.cli.main import main\n"
        "import fmstore.tiering.service.daemon, fmstore.checkpoint.verify, fmstore.checkpoint.gc\n"
        "for args in (['--help'], ['ckpt', '--help'], ['daemon', '--help'], ['ckpt', 'list']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, (args, e.code)\n"
        "print('loaded:', sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "run" in r.stdout and "present" in r.stdout, r.stdout[-2000:]
    assert "loaded: []" in r.stdout, r.stdout[-2000:]
