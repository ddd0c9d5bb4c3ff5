"""First-day frictions of the CLI: habits from s5cmd, rclone and the aws cli (``cp`` of a
glob or a tree, ``sync``, ``mv``), ``-v`` after the command, usage lines, progress units."""

from __future__ import annotations

import pytest
from stage_data import fm, fm_here, s3_env

from fmstore.cli.progress import eta_text, rate_text


@pytest.fixture
def tree(tmp_path, posix_cfg):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"a" * 10)
    (src / "sub" / "b.bin").write_bytes(b"b" * 20)
    (src / "c.txt").write_bytes(b"c")
    return src


def files(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_cp_of_a_glob_copies_what_it_matches_below_its_directory(tree, tmp_path):
    r = fm_here("cp", f"{tree}/*.bin", f"{tmp_path}/out/")
    assert r.returncode == 0, r.stderr
    assert files(tmp_path / "out") == {"a.bin"}  # in its directory, as ls reads it
    r = fm_here("cp", "-r", f"{tree}/*.bin", f"{tmp_path}/out/")
    assert r.returncode == 0, r.stderr
    assert files(tmp_path / "out") == {"a.bin", "sub/b.bin"}  # with -r, at any depth
    assert "copied 1 file (20 B), 1 identical skipped" in r.stderr
    r = fm_here("cp", f"{tree}/*.zip", f"{tmp_path}/out/")
    assert r.returncode == 1 and "no object under" in r.stderr and "'*.zip'" in r.stderr
    (tree / "run[1].bin").write_bytes(b"r")  # a path that exists is itself, not a glob
    r = fm_here("cp", f"{tree}/run[1].bin", f"{tmp_path}/lit/")
    assert r.returncode == 0 and files(tmp_path / "lit") == {"run[1].bin"}, r.stderr


def test_cp_r_copies_a_tree_and_cp_of_a_directory_says_to_add_r(tree, tmp_path):
    r = fm_here("cp", str(tree), f"{tmp_path}/out/")
    assert r.returncode == 1 and "use 'fmstore cp -r'" in r.stderr, r.stderr
    r = fm_here("cp", "-r", str(tree), f"{tmp_path}/out/")
    assert r.returncode == 0, r.stderr
    assert files(tmp_path / "out") == {"a.bin", "sub/b.bin", "c.txt"}
    r = fm_here("cp", "-r", str(tree / "c.txt"), f"{tmp_path}/one/")  # a file: as cp -r does
    assert r.returncode == 0 and files(tmp_path / "one") == {"c.txt"}, r.stderr


@pytest.mark.s3
def test_cp_of_a_glob_and_of_a_prefix_on_s3(s3_server, s3_bucket, tmp_path, tree):
    env = s3_env(s3_server, s3_bucket, tmp_path)["env"]
    assert fm("stage", str(tree), "s3:train", "--no-progress", env=env).returncode == 0
    r = fm("cp", "-r", "s3:train/*.bin", f"{tmp_path}/local/", env=env)
    assert r.returncode == 0, r.stderr
    assert files(tmp_path / "local") == {"a.bin", "sub/b.bin"}
    r = fm("cp", "s3:train", f"{tmp_path}/x/", env=env)
    assert r.returncode == 1 and "is a prefix: use 'fmstore cp -r'" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "command,hint", [("sync", "fmstore stage SRC DST --delete"), ("mv", "--include GLOB")]
)
def test_sync_and_mv_point_to_the_fmstore_way(command, hint):
    r = fm_here(command, "s3:a", "s3:b")
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: fmstore has no '{command}' command; use ")
    assert hint in r.stderr


def test_verbosity_after_the_command_is_taken(tree, tmp_path):
    r = fm_here("ls", str(tree), "-vv")
    assert r.returncode == 0, r.stderr
    assert "DEBUG fmstore" in r.stderr and "a.bin" in r.stdout


def test_usage_lines_write_arguments_in_capitals():
    from typer._click import Context
    from typer.main import get_command

    from fmstore.cli import main as cli

    cli._register(["--help"])
    todo = [get_command(cli.app)]
    seen = 0
    while todo:
        cmd = todo.pop()
        pieces = " ".join(cmd.collect_usage_pieces(Context(cmd)))
        assert "{" not in pieces and pieces == pieces.upper(), (cmd.name, pieces)
        if cmd.name != "fmstore":  # the root's -v/-q are taken after any command
            opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
            assert not opts & {"-v", "--verbose", "-q", "--quiet"}, cmd.name
        todo.extend(getattr(cmd, "commands", {}).values())
        seen += 1
    assert seen > 10
    r = fm_here("ls", "--help")
    assert "ls [OPTIONS] URL\n" in r.stdout


def test_progress_speaks_binary_units_and_no_absurd_time_left():
    assert rate_text(3 << 20) == "3.0 MiB/s" and rate_text(None) == "?/s"
    assert eta_text(100 << 20, 10 << 20) == "0:00:10"
    assert eta_text(3 << 30, 1 << 20) == "0:51:12"
    # throttled to nearly nothing, or stalled: no "ETA 5628339 s"
    assert eta_text(50 << 30, 10.0) == "?"
    assert eta_text(50 << 30, 0.0) == "?" and eta_text(50 << 30, None) == "?"
    assert eta_text(0, None) == "0:00:00"
