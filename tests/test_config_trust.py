"""Config trust: an ``fmstore.toml`` found by looking (above the working directory, the
user's, the system's) is used only when nobody but root and the caller could have written
it (``fmstore.trust``); one that fails is an error that says how to proceed, never a reason
to look further.  The walk stops at ``$HOME``, file-system boundaries and
``$FMSTORE_CEILING_DIRECTORIES``; ``/etc/fmstore/fmstore.toml`` is in the lookup; commands
that act on tiers say which config they act by."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from stage_data import fm_here

from fmstore import config as fm_config
from fmstore import configfile as fm_configfile
from fmstore.errors import ConfigError

NOBODY = 65534
CEILING = "FMSTORE_CEILING_DIRECTORIES"
ABOVE, HERE = "found above the working directory", "found in the working directory"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to uid 65534 needs root")


@pytest.fixture
def iso(tmp_path, monkeypatch):
    """No named config, a home of its own without a user config, a system config path
    inside the test's directory, and a ceiling that keeps the walk inside it."""
    home = tmp_path / "home"
    home.mkdir()
    for var in ("FMSTORE_CONFIG", "SUDO_UID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("FMSTORE_HOME", str(tmp_path / "default-home"))
    monkeypatch.setenv(CEILING, str(tmp_path.parent))
    system = str(tmp_path / "etc" / "fmstore.toml")
    monkeypatch.setattr(fm_configfile, "SYSTEM_CONFIG", system)
    fm_config.set_config(None)
    yield tmp_path
    fm_config.set_config(None)


def _found() -> tuple[Path | None, str | None]:
    """The file of the config in effect and how it was found."""
    cfg = fm_config.load_config()
    return (None if cfg.source is None else Path(cfg.source)), getattr(cfg, "found_by", None)


def _toml(path: Path, tiers: dict[str, str], extra: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(f'[tiers.{n}]\nurl = "{u}"\n' for n, u in tiers.items())
    path.write_text(body + extra)
    return path


def _cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real ``fmstore`` in a subprocess run from ``cwd``, without a named config."""
    base = {k: v for k, v in os.environ.items() if k not in ("FMSTORE_CONFIG", "SUDO_UID")}
    return subprocess.run(
        [sys.executable, "-m", "fmstore", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def _sticky(d: Path) -> Path:
    d.mkdir(parents=True)
    d.chmod(0o1777)
    return d


@needs_root
def test_a_config_planted_in_a_sticky_directory_above_is_refused_and_deletes_nothing(
    iso, monkeypatch
):
    """Another uid's fmstore.toml in a 1777 scratch directory above root's working
    directory named another team's directory as tier lustre: ``rm -r -y`` deleted it."""
    victim = iso / "teamB" / "runs" / "old"
    victim.mkdir(parents=True)
    (victim / "last-copy.bin").write_bytes(b"x" * 10)
    scratch = _sticky(iso / "scratch")
    planted = _toml(scratch / "fmstore.toml", {"lustre": str(iso / "teamB")})
    os.chown(planted, NOBODY, NOBODY)
    run = scratch / "me" / "run"
    run.mkdir(parents=True)
    env = {"HOME": str(iso / "home"), CEILING: str(iso.parent)}
    r = _cli(run, "rm", "-r", "-y", "lustre:runs/old", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert f"{planted} (found above the working directory) is not trusted" in lines[0]
    assert f"owned by uid {NOBODY}" in lines[0]
    assert f"--config {planted}" in lines[0] and f"FMSTORE_CONFIG={planted}" in lines[0]
    assert "safe_directories" in lines[0] and f"add {scratch} to ${CEILING}" in lines[0]
    assert (victim / "last-copy.bin").read_bytes() == b"x" * 10
    # A library caller below it (a training process) gets the same error.
    monkeypatch.chdir(run)
    with pytest.raises(ConfigError, match="is not trusted"):
        fm_config.load_config()


def test_own_directory_in_a_sticky_directory_passes_a_file_directly_in_it_does_not(
    iso, monkeypatch
):
    scratch = _sticky(iso / "scratch")
    mine = _toml(scratch / "me" / "fmstore.toml", {"lustre": "lus"})
    (scratch / "me" / "run").mkdir()
    monkeypatch.chdir(scratch / "me" / "run")
    assert _found() == (mine, ABOVE)
    monkeypatch.chdir(scratch / "me")
    assert _found() == (mine, HERE)
    # the caller's own file, lying directly in the sticky directory: anyone can rename it
    loose = _toml(scratch / "fmstore.toml", {"lustre": "lus"})
    (scratch / "other").mkdir()
    monkeypatch.chdir(scratch / "other")
    with pytest.raises(ConfigError) as e:
        fm_config.find_config_file()
    assert f"{loose} (found above the working directory) is not trusted" in str(e.value)
    assert f"its directory {scratch} is writable by others (mode 1777)" in str(e.value)


@needs_root
def test_a_group_or_world_writable_directory_above_refuses(iso, monkeypatch):
    shared = iso / "shared"
    cfg = _toml(shared / "proj" / "fmstore.toml", {"lustre": "lus"})
    (shared / "proj" / "src").mkdir()
    monkeypatch.chdir(shared / "proj" / "src")
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=f"directory {shared} is writable by others .mode 0777"):
        fm_config.find_config_file()
    shared.chmod(0o775)
    os.chown(shared, 0, NOBODY)  # a group that is neither root's nor a private one
    with pytest.raises(ConfigError, match=f"directory {shared} is writable by others .mode 0775"):
        fm_config.find_config_file()
    os.chown(shared, 0, 0)  # root's group is not "others"
    assert _found() == (cfg, ABOVE)
    cfg.chmod(0o666)
    with pytest.raises(ConfigError, match=r"writable by others \(mode 0666\)"):
        fm_config.find_config_file()


def test_the_walk_stops_at_a_ceiling_directory_and_above_home(iso, monkeypatch):
    top = iso / "top"
    cfg = _toml(top / "fmstore.toml", {"lustre": "lus"})
    (top / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(top / "a" / "b")
    assert _found() == (cfg, ABOVE)
    for ceiling in (top, top / "a", f"relative:{top}"):
        monkeypatch.setenv(CEILING, f"/nowhere:{ceiling}")
        assert fm_config.find_config_file() is None, ceiling
    link = iso / "link-to-top"
    link.symlink_to(top)
    monkeypatch.setenv(CEILING, str(link))  # compared with its links resolved
    assert fm_config.find_config_file() is None
    # the working directory itself is always looked in, as git does
    monkeypatch.setenv(CEILING, str(top))
    monkeypatch.chdir(top)
    assert _found() == (cfg, HERE)
    # $HOME is looked in, nothing above it
    monkeypatch.setenv(CEILING, str(iso.parent))
    monkeypatch.setenv("HOME", str(top / "a"))
    monkeypatch.chdir(top / "a" / "b")
    assert fm_config.find_config_file() is None
    in_home = _toml(top / "a" / "fmstore.toml", {"lustre": "lus"})
    assert _found() == (in_home, ABOVE)


def test_the_walk_follows_no_link(iso, monkeypatch):
    real = _toml(iso / "real" / "fmstore.toml", {"lustre": "lus"})
    (iso / "proj").mkdir()
    (iso / "proj" / "fmstore.toml").symlink_to(real)
    monkeypatch.chdir(iso / "proj")
    with pytest.raises(ConfigError, match="is a symbolic link") as e:
        fm_config.find_config_file()
    assert CEILING not in str(e.value)  # no ceiling keeps the walk out of where it starts


@needs_root
def test_a_walked_file_below_another_uids_directory_is_refused_unless_sudo_uid_is_theirs(iso):
    other = iso / "other"
    cfg = _toml(other / "proj" / "fmstore.toml", {"lustre": str(iso / "lus")})
    os.chown(other, NOBODY, NOBODY)
    env = {"HOME": str(iso / "home"), CEILING: str(iso.parent)}
    r = _cli(other / "proj", "config", "--json", env=env)
    assert r.returncode == 1 and f"directory {other} is owned by uid {NOBODY}" in r.stderr
    r = _cli(other / "proj", "config", "--json", env={**env, "SUDO_UID": "1"})
    assert r.returncode == 1 and f"directory {other} is owned by uid {NOBODY}" in r.stderr
    # root under sudo, run by uid 65534: its own directory and file are its to trust
    os.chown(cfg, NOBODY, NOBODY)
    r = _cli(other / "proj", "config", "--json", env={**env, "SUDO_UID": str(NOBODY)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config"] == str(cfg)


@pytest.mark.skipif(shutil.which("sudo") is None, reason="sudo is not installed here")
@pytest.mark.parametrize("how", [["sudo"], ["sudo", "-E"], ["sudo", "-i"]])
def test_under_sudo_a_planted_config_is_refused(iso, how):
    """Whatever sudo keeps of the environment, a file another uid planted above the
    working directory is not root's config (``sudo -i`` starts in root's home instead)."""
    if os.geteuid() != 0:
        pytest.skip("plants a file as uid 65534: needs root")
    scratch = _sticky(iso / "scratch")
    planted = _toml(scratch / "fmstore.toml", {"lustre": str(iso / "victim")})
    os.chown(planted, NOBODY, NOBODY)
    (scratch / "run").mkdir()
    py = f"import sys; sys.path.insert(0, {str(Path(fm_config.__file__).parents[1])!r}); "
    code = py + "from fmstore.cli.main import entry; sys.argv[1:] = ['config', '--json']; entry()"
    r = subprocess.run(
        [*how, "-n", sys.executable, "-c", code],
        cwd=scratch / "run",
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    if r.returncode != 0 and "password" in r.stderr:
        pytest.skip(f"{' '.join(how)} -n asks for a password here")
    if how[-1] == "-i":
        assert str(planted) not in r.stdout, r.stdout
    else:
        assert r.returncode == 1 and f"{planted} (found above" in r.stderr, r.stdout + r.stderr


def test_the_system_config_comes_after_the_users_and_both_must_be_trusted(iso, monkeypatch):
    (iso / "empty").mkdir()
    monkeypatch.chdir(iso / "empty")
    system = _toml(iso / "etc" / "fmstore.toml", {"lustre": str(iso / "sys-lus")})
    assert _found() == (system, "system config")
    r = fm_here("rm", "-r", "-n", "lustre:runs/x")
    assert r.stderr.startswith(f"config: {system} (system config)\n"), r.stderr
    user = _toml(iso / "home" / ".config" / "fmstore" / "fmstore.toml", {"lustre": "u"})
    assert _found() == (user, "user config")
    # a user config reached through a link passes when the link and its file both do
    user.rename(iso / "home" / "dotfile.toml")
    user.symlink_to(iso / "home" / "dotfile.toml")
    assert _found() == (user, "user config")
    if os.geteuid() != 0:
        return
    os.chown(iso / "home" / ".config", NOBODY, NOBODY)  # a ~/.config someone else owns
    with pytest.raises(ConfigError) as e:
        fm_config.find_config_file()
    assert f"{user} (user config) is not trusted" in str(e.value)
    assert f"directory {iso / 'home' / '.config'} is owned by uid {NOBODY}" in str(e.value)
    shutil.rmtree(iso / "home" / ".config")
    os.chown(system, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"{system} .system config. is not trusted"):
        fm_config.find_config_file()


@needs_root
def test_a_safe_directory_of_the_users_config_trusts_a_walked_file_a_walked_one_cannot(
    iso, monkeypatch
):
    scratch = _sticky(iso / "scratch")
    planted = _toml(
        scratch / "fmstore.toml",
        {"lustre": "lus"},
        f'[trust]\nsafe_directories = ["{scratch}"]\n',  # not read from a walked file
    )
    os.chown(planted, NOBODY, NOBODY)
    (scratch / "run").mkdir()
    monkeypatch.chdir(scratch / "run")
    with pytest.raises(ConfigError, match="is not trusted"):
        fm_config.find_config_file()
    user = iso / "home" / ".config" / "fmstore" / "fmstore.toml"
    _toml(user, {"nvme": "n"}, f'[trust]\nsafe_directories = ["{scratch}"]\n')
    assert _found() == (planted, f"{ABOVE}, in a safe directory of {user}")
    assert fm_config.load_config().tier("lustre").url == str(scratch / "lus")


def test_commands_that_act_on_tiers_print_the_config_in_effect(iso, monkeypatch):
    proj = iso / "proj"
    cfg = _toml(proj / "fmstore.toml", {"nvme": "nvme", "lustre": "lustre"})
    for d in ("nvme/runs/a", "lustre/runs", "src"):
        (proj / d).mkdir(parents=True)
    (proj / "nvme" / "runs" / "a" / "f.bin").write_bytes(b"x")
    monkeypatch.chdir(proj / "src")
    line = f"config: {cfg} (found above the working directory)"
    for args in (
        ("rm", "-r", "-n", "nvme:runs/a"),
        ("gc", "-n", "nvme:"),
        ("ckpt", "gc", "-n", "nvme:runs"),
        ("cp", "nvme:runs/a/f.bin", "lustre:runs/f.bin"),
        ("stage", "-n", "nvme:runs", "lustre:runs"),
        ("ls", "nvme:runs"),  # read-only commands say it too
        ("-q", "ls", "nvme:runs"),  # -q: nothing said
    ):
        r = fm_here(*args)
        assert r.returncode == 0, (args, r.stderr)
        said = r.stderr.splitlines()[:1] == [line]
        assert said == (args[0] != "-q"), (args, r.stderr)
    assert fm_here("ls", str(proj / "src")).stderr == ""  # a plain path: the config decides nothing
    # ckpt list reads every tier whatever its argument: said before its answer (none here)
    r = fm_here("ckpt", "list", "runs")
    assert r.stderr.splitlines()[0] == line and "no checkpoint" in r.stderr, r.stderr
    # a file the caller named is not announced; the embedded default is
    monkeypatch.setenv("FMSTORE_CONFIG", str(cfg))
    assert line not in fm_here("rm", "-r", "-n", "nvme:runs/a").stderr
    monkeypatch.delenv("FMSTORE_CONFIG")
    monkeypatch.chdir(iso)
    r = fm_here("rm", "-r", "-n", "nvme:runs/a")
    assert r.stderr.startswith("config: embedded default (no config file found)\n"), r.stderr


def test_the_daemon_logs_the_config_it_acts_by(iso):
    cfg = iso / "proj" / "fmstore.toml"
    cfg.parent.mkdir()
    cfg.write_text('state_dir = "state"\n[tiers.nvme]\nurl = "nvme"\n[tiers.lustre]\nurl = "l"\n')
    env = {"HOME": str(iso / "home"), CEILING: str(iso.parent)}
    r = _cli(cfg.parent, "daemon", "--once", "--no-http", env=env)
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stderr.splitlines()]
    first = events[0]
    assert first["event"] == "config" and first["file"] == str(cfg), events
    assert first["msg"] == f"config: {cfg} (found in the working directory)"


def test_rm_asks_with_the_resolved_location(iso, monkeypatch):
    proj = iso / "proj"
    cfg = _toml(proj / "fmstore.toml", {"lustre": "lus"})
    (proj / "lus" / "runs" / "old").mkdir(parents=True)
    (proj / "lus" / "runs" / "old" / "f").write_bytes(b"x")
    monkeypatch.chdir(proj)
    r = fm_here("rm", "-r", "lustre:runs/old")  # no terminal to ask on: refused, as asked
    where = f"'lustre:runs/old' ({proj}/lus/runs/old: tier lustre of {cfg})"
    assert r.returncode == 2 and f"Delete 1 object under {where}?" in r.stderr, r.stderr
    assert (proj / "lus" / "runs" / "old" / "f").exists()
