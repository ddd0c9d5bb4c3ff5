"""One config wherever a command runs: the lookup walks up from the working directory,
relative paths in a file are relative to the file, every command takes the global
``--config``, ``fmstore config`` shows what is in effect, and a missing location names the
directory it resolved to and the config that said so."""

from __future__ import annotations

import json

import pytest

from fmstore import config as fm_config
from fmstore.cli import main as cli_main


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project directory with an fmstore.toml of relative tier paths, no $FMSTORE_CONFIG,
    and a home without a user config."""
    proj = tmp_path / "proj"
    (proj / "src" / "deeper").mkdir(parents=True)
    (proj / "fmstore.toml").write_text(
        'state_dir = "state"\n[tiers.nvme]\nurl = "nvme"\n[tiers.lustre]\nurl = "../lustre"\n'
    )
    monkeypatch.delenv("FMSTORE_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FMSTORE_HOME", str(tmp_path / "default-home"))
    fm_config.set_config(None)
    yield proj
    fm_config.set_config(None)


def run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        cli_main.main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_config_found_above_the_working_directory_with_paths_relative_to_it(
    project, monkeypatch, capsys
):
    monkeypatch.chdir(project / "src" / "deeper")
    code, out, _ = run(capsys, "config", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["config"] == str(project / "fmstore.toml")
    assert doc["tiers"]["nvme"]["location"] == str(project / "nvme")
    assert doc["tiers"]["lustre"]["location"] == str(project.parent / "lustre")
    assert doc["state_dir"] == str(project / "state")
    code, out, _ = run(capsys, "config")
    assert f"config: {project / 'fmstore.toml'}" in out
    assert f"tier nvme    {project / 'nvme'}" in out


def test_missing_location_names_the_directory_and_the_config(project, monkeypatch, capsys):
    monkeypatch.chdir(project / "src")
    code, _, err = run(capsys, "ls", "nvme:runs/x")
    assert code == 1
    assert f"'nvme:runs/x' ({project / 'nvme' / 'runs' / 'x'}: tier nvme of " in err
    assert str(project / "fmstore.toml") in err
    code, _, err = run(capsys, "ckpt", "inspect", "nvme:runs/x")
    assert code == 1 and str(project / "nvme" / "runs" / "x") in err
    assert str(project / "fmstore.toml") in err
    # Outside the project, the embedded default says so instead of passing silently.
    monkeypatch.chdir(project.parent)
    code, _, err = run(capsys, "ls", "nvme:runs/x")
    assert code == 1 and "tier nvme of the embedded default (no $FMSTORE_CONFIG" in err


def test_global_config_on_every_command(project, tmp_path, monkeypatch, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = str(project / "fmstore.toml")
    (project / "nvme" / "ds").mkdir(parents=True)
    (project / "nvme" / "ds" / "a.bin").write_bytes(b"x" * 5)
    for args in (
        ("-c", cfg, "ls", "nvme:ds"),
        ("--config", cfg, "ls", "nvme:ds"),
        ("ls", "nvme:ds", "--config", cfg),
        ("ls", "--config=" + cfg, "nvme:ds"),
        ("du", "nvme:ds", "-c", cfg),
    ):
        code, out, err = run(capsys, *args)
        assert code == 0 and ("a.bin" in out or "5" in out), (args, out, err)
    # stage's own -c is its concurrency; --config after it is still the global one
    code, _, err = run(capsys, "stage", "-c", "2", "nvme:ds", "lustre:ds", "--config", cfg)
    assert code == 0, err
    assert (project.parent / "lustre" / "ds" / "a.bin").read_bytes() == b"x" * 5
    # the config in effect is the process's again after the command (in-process callers)
    assert fm_config.find_config_file() is None


def test_every_command_takes_the_global_config():
    """Every command either reads ``--config`` / ``-c`` itself or gets them moved to the
    root's option: no command rejects them."""
    cli_main._register([])
    import typer

    def leaves(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs is None:
            yield path
            return
        for name, sub in subs.items():
            yield from leaves(sub, [*path, name])

    commands = list(leaves(typer.main.get_command(cli_main.app), []))
    assert ["config"] in commands and ["ckpt", "convert"] in commands
    for path in commands:
        hoisted = cli_main.hoist_root_options([*path, "--config", "f.toml"], cli_main._own_options)
        own = cli_main._own_options(path)
        assert hoisted[:2] == ["--config", "f.toml"] or "--config" in own, path
