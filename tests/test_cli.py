from __future__ import annotations

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
    assert r.stderr.strip().startswith("error: unknown tier 'nosuchtier'")
    assert "Traceback" not in r.stderr
