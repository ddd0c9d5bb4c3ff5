"""Steps moved aside, replicas and replica accounting never follow a link out of the tier:
another user may plant ``TIER/.replicas/RUN -> /elsewhere`` (or ``TIER/.aside`` as a link)
on a node-local tier and wait for a restore to move ``/elsewhere`` into ``.aside`` and for
``fmstore gc`` (root) to delete it; or make ``.aside`` / ``.replicas`` first and own what
every user's restores and replicas put there."""

from __future__ import annotations

import json
import os
import time

import pytest
from stage_data import fm

from fmstore.checkpoint.dcp.replicas import open_replicas
from fmstore.config import from_dict
from fmstore.errors import PermissionDenied
from fmstore.stores import open_store
from fmstore.stores.posix_io import tree_bytes
from fmstore.tiering.inventory import aside
from fmstore.tiering.tiers import Tiers

STEP = "step_000000000090"
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _step_dir(at) -> None:
    """A step directory with one blob and a manifest at ``at``."""
    (at / "g0000000000ff-deadbeef").mkdir(parents=True)
    (at / "g0000000000ff-deadbeef" / "000000.bin").write_bytes(b"x" * 100)
    (at / "manifest.json").write_bytes(b"{}")


def _token(age_s: float = 7200) -> str:
    return f"{int((time.time() - age_s) * 1000):013d}-0123abcd"


def _tree(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _config(tmp_path):
    return from_dict(
        {
            "tiers": {"nvme": {"url": str(tmp_path / "nvme"), "scope": "node"}},
            "state_dir": str(tmp_path / "state"),
        }
    )


def test_a_link_under_replicas_is_never_moved_aside(tmp_path):
    nvme = tmp_path / "nvme"
    outside = tmp_path / "outside"
    _step_dir(outside / STEP)  # someone else's directory, shaped like a newer step
    before = _tree(outside)
    _step_dir(nvme / "run" / "step_000000000080")  # the step restored
    (nvme / ".replicas").mkdir()
    (nvme / ".replicas" / "run").symlink_to(outside)
    store = open_store(str(nvme), tier="nvme")

    with pytest.raises(PermissionDenied, match="symbolic link") as e:
        aside.newer_steps(store, "nvme", "run", 80)
    assert e.value.tier == "nvme" and e.value.key == ".replicas/run"
    with pytest.raises(PermissionDenied, match="symbolic link"):
        aside.move_aside(store, "nvme", "run", [90])
    assert _tree(outside) == before and not (nvme / ".aside").exists()

    # a link in the run's own place, or as the step's directory: refused the same way
    (nvme / ".replicas" / "run").unlink()
    (nvme / "run" / STEP).symlink_to(outside / STEP)
    for call in (
        lambda: aside.newer_steps(store, "nvme", "run", 80),
        lambda: aside.move_aside(store, "nvme", "run", [90]),
    ):
        with pytest.raises(PermissionDenied, match="symbolic link"):
            call()
    assert _tree(outside) == before and not (nvme / ".aside").exists()


def test_a_linked_aside_is_neither_listed_nor_removed(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    outside = tmp_path / "outside"
    token = _token()
    _step_dir(outside / token / "run" / STEP)
    before = _tree(outside)
    (nvme / ".aside").symlink_to(outside)
    store = open_store(str(nvme), tier="nvme")

    with pytest.raises(PermissionDenied, match="symbolic link"):
        aside.moved_aside(store, now=time.time())
    with pytest.raises(PermissionDenied, match="symbolic link"):
        aside.remove(store, f".aside/{token}")
    (nvme / "run" / STEP).mkdir(parents=True)
    with pytest.raises(PermissionDenied, match="symbolic link"):  # nothing moved into it
        aside.move_aside(store, "nvme", "run", [90])
    assert (nvme / "run" / STEP).is_dir()
    assert _tree(outside) == before


def test_gc_never_deletes_what_a_linked_aside_points_to(tmp_path):
    """``fmstore gc nvme: --older-than 0`` (root, in a subprocess): a linked ``.aside`` is
    reported, not swept (a step moved aside, with links in it, is swept in
    ``test_sweep.py``)."""
    nvme = tmp_path / "nvme"
    outside = tmp_path / "outside"
    _step_dir(outside / _token() / "run" / STEP)
    (nvme / "run").mkdir(parents=True)
    (nvme / ".aside").symlink_to(outside)
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[tiers.nvme]\nurl = "{nvme}"\nscope = "node"\n'
    )
    env = {"FMSTORE_CONFIG": str(cfg), "FMSTORE_HOME": str(tmp_path / "home")}
    before = _tree(outside)

    r = fm("gc", "nvme:", "--older-than", "0", "--json", env=env)
    doc = json.loads(r.stdout)
    assert any(".aside" in e and "symbolic link" in e for e in doc["errors"]), doc
    assert not [o for o in doc["orphans"] if o["kind"] == "aside"]
    assert _tree(outside) == before


@as_root
@pytest.mark.parametrize("name", [".aside", ".replicas"])
def test_aside_and_replicas_made_by_another_uid_are_refused(tmp_path, name):
    nvme = tmp_path / "nvme"
    token = _token()
    (nvme / ".aside" / token).mkdir(parents=True)
    (nvme / ".replicas" / "run" / STEP).mkdir(parents=True)
    (nvme / "run" / STEP).mkdir(parents=True)
    os.chown(nvme / name, NOBODY, NOBODY)
    store = open_store(str(nvme), tier="nvme")
    cfg = _config(tmp_path)
    if name == ".aside":
        calls = [
            lambda: aside.moved_aside(store, now=time.time()),
            lambda: aside.remove(store, f".aside/{token}"),
            lambda: aside.move_aside(store, "nvme", "run", [90]),
        ]
    else:
        calls = [
            lambda: aside.newer_steps(store, "nvme", "run", 80),
            lambda: aside.move_aside(store, "nvme", "run", [90]),
            lambda: open_replicas(f"nvme:.replicas/run/{STEP}", {"config": cfg}, create=True),
            lambda: open_replicas(f"nvme:.replicas/run/{STEP}", {"config": cfg}),
        ]
    for call in calls:
        with pytest.raises(PermissionDenied, match=f"owned by uid {NOBODY}") as e:
            call()
        assert e.value.tier == "nvme" and e.value.key == name
    assert (nvme / ".aside" / token).is_dir() and (nvme / "run" / STEP).is_dir()
    # root's own, but writable by everyone: refused the same way
    os.chown(nvme / name, 0, 0)
    os.chmod(nvme / name, 0o777)
    with pytest.raises(PermissionDenied, match="writable by others"):
        calls[0]()


@as_root
def test_aside_and_replicas_are_made_with_the_tier_roots_owner(tmp_path):
    nvme = tmp_path / "nvme"
    (nvme / "run" / STEP).mkdir(parents=True)
    (nvme / ".replicas").mkdir()  # root's own: root may use it
    os.chown(nvme, NOBODY, NOBODY)  # a tier its user owns, a restore run by root
    store = open_store(str(nvme), tier="nvme")
    dest = aside.move_aside(store, "nvme", "run", [90])
    assert dest is not None and os.path.isdir(os.path.join(dest, "run", STEP))
    st = os.lstat(nvme / ".aside")
    assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
    assert st.st_mode & 0o7777 == 0o755 & ~_umask()

    os.rmdir(nvme / ".replicas")
    open_replicas(f"nvme:.replicas/run/{STEP}", {"config": _config(tmp_path)}, create=True)
    st = os.lstat(nvme / ".replicas")
    assert (st.st_uid, st.st_mode & 0o7777) == (NOBODY, 0o755 & ~_umask())


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def test_tree_bytes_refuses_a_linked_top_and_usage_counts_it_as_nothing(tmp_path):
    nvme = tmp_path / "nvme"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"y" * 100_000)
    nvme.mkdir()
    (nvme / ".replicas").symlink_to(outside)
    with pytest.raises(OSError, match="symbolic link"):
        tree_bytes(str(nvme / ".replicas"))
    u = Tiers(_config(tmp_path)).usage("nvme")
    assert u is not None and u.replicas == 0
    assert tree_bytes(str(outside)) == 100_000 and tree_bytes(str(tmp_path / "none")) == 0


def test_a_token_with_a_trailing_newline_is_no_token(tmp_path):
    nvme = tmp_path / "nvme"
    odd = nvme / ".aside" / (_token() + "\n")
    _step_dir(odd / "run" / STEP)
    store = open_store(str(nvme), tier="nvme")
    assert aside.moved_aside(store, now=time.time()) == []
    with pytest.raises(ValueError, match="not a step moved aside"):
        aside.remove(store, f".aside/{odd.name}")
    assert odd.is_dir()


def test_rm_r_never_follows_a_link_in_the_tiers_path(tmp_path, monkeypatch):
    """``rm -r``'s note on the replicas beside a run and its removal of the directories it
    emptied resolve the path beneath the tier's root: a link on the way (one swapped in
    after the delete, here planted before the clean-up) is never followed."""
    from fmstore import config as fm_config
    from fmstore.cli import object_cmds

    nvme, outside = tmp_path / "nvme", tmp_path / "outside"
    (outside / "run" / "empty").mkdir(parents=True)
    (nvme / ".replicas").mkdir(parents=True)
    (nvme / ".replicas" / "run").symlink_to(outside / "run")
    (nvme / "scratch").symlink_to(outside)
    monkeypatch.setattr(fm_config, "_cached", _config(tmp_path))  # restored after the test
    assert object_cmds._replicas_beside("nvme:run") is None
    object_cmds._remove_empty_dirs("nvme:scratch/run", keep_top=False)
    assert (outside / "run" / "empty").is_dir()
    # the location's own empty directories go, and it too
    (nvme / "scratch").unlink()
    (nvme / "scratch" / "run" / "a" / "b").mkdir(parents=True)
    (nvme / "scratch" / "run" / "link").symlink_to(outside)
    object_cmds._remove_empty_dirs("nvme:scratch/run", keep_top=False)
    assert _tree(nvme / "scratch") == ["run", "run/link"] and (outside / "run" / "empty").is_dir()
    (nvme / "scratch" / "run" / "link").unlink()
    object_cmds._remove_empty_dirs("nvme:scratch/run", keep_top=False)
    assert _tree(nvme / "scratch") == []
