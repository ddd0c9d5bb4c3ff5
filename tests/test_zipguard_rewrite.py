"""The zip guard checks what torch reads: a file another uid could rewrite in place is
read through a private copy (issue 55, MED 3).

The rewrite happens at ``zipguard.after_check``, the seam between the check and the load,
so each test is deterministic: before the fix torch read the rewritten (refused) archive.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import fmstore
from fmstore import config as fm_config
from fmstore.checkpoint import private, zipguard
from fmstore.checkpoint.sources import SourceFile, read_source
from fmstore.errors import CorruptData, PermissionDenied
from fmstore.trust import why_rewritable

OTHER = 65534
root_only = pytest.mark.skipif(
    os.geteuid() != 0, reason="chowning a file to another uid (65534) needs root"
)


def _archive(obj: object, compress: int, pad_to: int = 0) -> bytes:
    """``torch.save(obj)`` rewritten by zipfile, members stored or ``compress``ed, its end
    record's comment padding it to ``pad_to`` bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=compress)
        dst.comment = b""
    size = len(out.getvalue())
    if pad_to > size:
        with zipfile.ZipFile(out, "a") as dst:
            dst.comment = b"x" * (pad_to - size)
    return out.getvalue()


GOOD = {"w": torch.arange(7)}


@pytest.fixture(scope="module")
def pair() -> tuple[bytes, bytes]:
    """Two archives of one length: one the guard accepts, one it refuses (every member
    deflated: 16 MiB of zeros from a few KiB)."""
    bad = _archive({"w": torch.zeros(4 << 20)}, zipfile.ZIP_DEFLATED)
    good = _archive(GOOD, zipfile.ZIP_STORED, pad_to=len(bad))
    assert len(good) == len(bad)
    zipguard.check_torch_zip(good, name="good")
    with pytest.raises(CorruptData, match="compressed"):
        zipguard.check_torch_zip(bad, name="bad")
    return good, bad


@pytest.fixture
def cfg(tmp_path, monkeypatch) -> Iterator[Path]:
    """A config whose ``state_dir`` is under ``tmp_path``."""
    f = tmp_path / "fmstore.toml"
    f.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    monkeypatch.setenv("FMSTORE_CONFIG", str(f))
    fm_config.set_config(None)
    yield tmp_path / "state"
    fm_config.set_config(None)


def _others(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    os.chown(path, OTHER, OTHER)
    os.chmod(path, 0o644)
    return path


def _rewrite_with(monkeypatch, data: bytes) -> None:
    """At the seam, the owner rewrites the file in place (same inode, same length)."""

    def rewrite(path: str) -> None:
        with open(path, "r+b") as f:
            f.write(data)

    monkeypatch.setattr(zipguard, "after_check", rewrite)


def _by_load(p: Path) -> object:
    return fmstore.load(str(p))


def _by_convert(p: Path) -> object:
    return read_source(SourceFile("torch", str(p), str(p)))


READERS = pytest.mark.parametrize("read", [_by_load, _by_convert], ids=["load", "convert"])


@root_only
@READERS
def test_a_rewrite_in_place_after_the_check_is_not_read(
    tmp_path, cfg, pair, monkeypatch, read: Callable[[Path], object]
):
    good, bad = pair
    p = _others(tmp_path / "shared.pt", good)
    _rewrite_with(monkeypatch, bad)
    out = read(p)
    assert isinstance(out, dict) and torch.equal(out["w"], GOOD["w"])
    assert p.read_bytes() == bad  # the rewrite happened; what was checked was loaded


@pytest.fixture
def torch_sees(monkeypatch) -> list[tuple[str, os.stat_result, str | None]]:
    """What each ``torch.load`` is handed: its path, that file's stat and why someone
    other than a trusted uid could rewrite it (None: nobody could)."""
    seen: list[tuple[str, os.stat_result, str | None]] = []
    real = torch.load

    def load(f, *args, **kwargs):
        assert isinstance(f, str), f"torch.load handed {type(f).__name__}, not a path"
        fd = os.open(f, os.O_RDONLY)
        try:
            seen.append((f, os.fstat(fd), why_rewritable(fd)))
        finally:
            os.close(fd)
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    return seen


def _acl_writable_by_other(p: Path) -> None:
    """A POSIX ACL giving uid 65534 write (the mode then shows only the mask: 0664)."""
    entry = struct.Struct("<HHI")
    any_id = 0xFFFFFFFF
    acl = struct.pack("<I", 2) + b"".join(
        entry.pack(tag, perm, who)
        for tag, perm, who in (
            (0x01, 6, any_id),  # owner rw
            (0x02, 6, OTHER),  # uid 65534 rw
            (0x04, 4, any_id),  # group r
            (0x10, 6, any_id),  # mask rw
            (0x20, 4, any_id),  # others r
        )
    )
    try:
        os.setxattr(p, "system.posix_acl_access", acl)
    except OSError as e:
        pytest.skip(f"no POSIX ACLs on this file system ({e.strerror})")


@root_only
@READERS
@pytest.mark.parametrize("who", ["other uid", "world-writable", "acl", "trusted"])
def test_torch_never_opens_a_file_another_uid_can_write(
    tmp_path, cfg, pair, torch_sees, who, read: Callable[[Path], object]
):
    good, _ = pair
    p = tmp_path / "x.pt"
    p.write_bytes(good)
    os.chmod(p, 0o644)
    if who == "other uid":
        os.chown(p, OTHER, OTHER)
    elif who == "world-writable":
        os.chmod(p, 0o666)
    elif who == "acl":
        _acl_writable_by_other(p)
    assert (why_rewritable(os.open(p, os.O_RDONLY)) is None) == (who == "trusted")
    out = read(p)
    assert isinstance(out, dict) and torch.equal(out["w"], GOOD["w"])
    [(path, st, why)] = torch_sees
    assert why is None, f"torch.load handed {path}, which is {why}"
    same = st.st_ino == p.stat().st_ino and st.st_dev == p.stat().st_dev
    if who == "trusted":
        assert same  # a trusted file is read in place, never copied
    else:
        assert not same and st.st_nlink == 0 and path.startswith("/proc/self/fd/")


@root_only
def test_a_large_copy_is_an_unlinked_file_in_state_dir(tmp_path, cfg, pair, monkeypatch):
    good, bad = pair
    monkeypatch.setattr(private, "MEMORY_BELOW", 0)  # what a file of 256 MiB or more gets
    p = _others(tmp_path / "big.pt", good)
    seen: list[os.stat_result] = []

    def rewrite(path: str) -> None:
        fd = next(int(n) for n in os.listdir("/proc/self/fd") if _is_in(n, cfg))
        seen.append(os.fstat(fd))
        with open(path, "r+b") as f:
            f.write(bad)

    monkeypatch.setattr(zipguard, "after_check", rewrite)
    assert torch.equal(fmstore.load(str(p))["w"], GOOD["w"])
    [st] = seen
    assert st.st_nlink == 0 and st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600
    assert os.listdir(cfg) == []  # nothing left behind


def _is_in(fd_name: str, d: Path) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd_name}").startswith(f"{d}/")
    except OSError:
        return False


@root_only
def test_a_copy_above_the_limit_is_refused_saying_how_to_trust_the_file(
    tmp_path, cfg, pair, monkeypatch
):
    good, _ = pair
    monkeypatch.setenv("FMSTORE__CHECKPOINT__PRIVATE_COPY_LIMIT", "1KiB")
    fm_config.set_config(None)
    p = _others(tmp_path / "team.pt", good)
    for read in (_by_load, _by_convert):
        with pytest.raises(PermissionDenied) as e:
            read(p)
        msg = str(e.value)
        assert "team.pt is owned by uid 65534" in msg and "private_copy_limit (1.0 KiB)" in msg
        assert "chown" in msg and "copy it yourself" in msg
    # the same bytes, trusted: read in place whatever their size
    os.chown(p, 0, 0)
    assert torch.equal(fmstore.load(str(p))["w"], GOOD["w"])


@root_only
def test_the_owner_truncating_the_file_after_the_load_is_no_sigbus(tmp_path):
    """The load memory-maps what it reads (its tensors stay mapped): before the fix it
    mapped the shared file itself, and its owner truncating it killed the loading process
    with SIGBUS at the next touch of a tensor, no Python exception."""
    p = _others(tmp_path / "t.pt", _archive({"w": torch.arange(1 << 20)}, zipfile.ZIP_STORED))
    (tmp_path / "fmstore.toml").write_text(f'state_dir = "{tmp_path / "state"}"\n')
    code = textwrap.dedent(
        f"""
        import os, fmstore
        out = fmstore.load({str(p)!r})
        os.truncate({str(p)!r}, 0)
        print("sum", int(out["w"].sum()))
        """
    )
    env = {**os.environ, "FMSTORE_CONFIG": str(tmp_path / "fmstore.toml")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["sum", str(sum(range(1 << 20)))]


@root_only
def test_safetensors_of_another_uid_are_mapped_from_a_private_copy(tmp_path, cfg, monkeypatch):
    """safetensors memory-maps the file it opens: never one another uid can write."""
    import safetensors
    from safetensors.torch import save as st_save

    p = _others(tmp_path / "w.safetensors", st_save({"b": torch.ones(5)}))
    seen: list[str | None] = []
    real = safetensors.safe_open

    def safe_open(path, *args, **kwargs):
        fd = os.open(path, os.O_RDONLY)
        try:
            seen.append(why_rewritable(fd))
        finally:
            os.close(fd)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", safe_open)
    assert torch.equal(fmstore.load(str(p))["b"], torch.ones(5))
    assert seen == [None]


def test_an_acl_entry_giving_another_uid_write_makes_a_file_untrusted(tmp_path):
    """The mode of a file with an ACL shows only the mask: 0664 of root's group passes the
    mode rule while uid 65534 may write it."""
    from fmstore.trust import why_untrusted

    p = tmp_path / "x"
    p.write_bytes(b"x")
    os.chmod(p, 0o644)
    assert why_untrusted(str(p)) is None
    _acl_writable_by_other(p)
    assert why_untrusted(str(p)) == "writable by uid 65534 through its ACL"
    fd = os.open(p, os.O_RDONLY)
    try:
        assert why_rewritable(fd) == "writable by uid 65534 through its ACL"
    finally:
        os.close(fd)


def test_a_download_above_the_limit_is_refused_before_it_is_copied(
    tmp_path, s3_server, s3_bucket, monkeypatch
):
    """A remote ``.pt`` is downloaded whole before any check: its size (from the stat) is
    bounded by ``[checkpoint] private_copy_limit`` and the free space first."""
    import glob
    import tempfile

    from stage_data import s3_env

    from fmstore import runtime
    from fmstore.stores import open_store

    for k, v in s3_env(s3_server, s3_bucket, tmp_path)["env"].items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FMSTORE__CHECKPOINT__PRIVATE_COPY_LIMIT", "4KiB")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fm_config.set_config(None)
    store = open_store("s3:models")
    runtime.run(store.put("big.pt", _archive({"w": torch.arange(4096)}, zipfile.ZIP_STORED)))
    runtime.run(store.put("small.pt", _archive(GOOD, zipfile.ZIP_STORED)))
    runtime.run(store.close())
    try:
        with pytest.raises(
            PermissionDenied,
            match=r"s3:models/big.pt is downloaded, .*"
            r"more than \[checkpoint\] private_copy_limit \(4.0 KiB\): "
            r"copy it to a local file yourself",
        ):
            fmstore.load("s3:models/big.pt")
        assert glob.glob(str(tmp_path / "tmp" / "*")) == []  # nothing written, nothing left
        assert torch.equal(fmstore.load("s3:models/small.pt")["w"], GOOD["w"])
    finally:
        fm_config.set_config(None)


@root_only
def test_a_copy_that_does_not_fit_in_state_dir_is_refused(tmp_path, monkeypatch):
    """A copy of 256 MiB or more goes to ``state_dir``, only when its file system has the
    room (here a 1 MiB tmpfs and a 2 MiB file)."""
    from fmstore.errors import TierFull

    small = tmp_path / "small"
    small.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(small)], capture_output=True
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode()[:200]}")
    try:
        (tmp_path / "fmstore.toml").write_text(f'state_dir = "{small / "state"}"\n')
        monkeypatch.setenv("FMSTORE_CONFIG", str(tmp_path / "fmstore.toml"))
        monkeypatch.setattr(private, "MEMORY_BELOW", 0)
        fm_config.set_config(None)
        p = _others(tmp_path / "x.pt", _archive({"w": torch.zeros(1 << 19)}, zipfile.ZIP_STORED))
        with pytest.raises(TierFull, match=r"x.pt is owned by uid 65534.* do not fit in .*chown"):
            fmstore.load(str(p))
        assert os.listdir(small / "state") == []
    finally:
        fm_config.set_config(None)
        subprocess.run(["umount", str(small)], check=True)
