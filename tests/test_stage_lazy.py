"""Lazy staging: only the listing is staged; fmstore.open fetches on first read and keeps
the file; hydrate preloads; release drops content only where that is safe."""

from __future__ import annotations

import json
import os

import pytest
from stage_data import file_crcs, fm, kill9_when

import fmstore
from fmstore.config import set_config
from fmstore.errors import NotFound
from fmstore.stores.crc import crc32c
from fmstore.tiering.lazy import INDEX_NAME


@pytest.fixture
def lazy_tree(tmp_path, monkeypatch):
    """A source directory outside the tiers, allowed by ``[stage] lazy_sources``."""
    monkeypatch.setenv("FMSTORE_HOME", str(tmp_path / "home"))
    src = tmp_path / "src"
    monkeypatch.setenv("FMSTORE__STAGE__LAZY_SOURCES", json.dumps([str(src)]))
    set_config(None)
    (src / "train").mkdir(parents=True)
    (src / "val").mkdir()
    for i in range(20):
        (src / "train" / f"{i:02d}.bin").write_bytes(os.urandom(1000 + i))
    (src / "val" / "big.bin").write_bytes(os.urandom(70 << 20))  # parts, even when lazy
    dst = tmp_path / "dst"
    r = fm("stage", str(src), str(dst), "--lazy", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["lazy_entries"] == 21
    yield src, dst
    set_config(None)


def test_lazy_stage_writes_only_the_listing(lazy_tree):
    _src, dst = lazy_tree
    assert os.listdir(dst) == [INDEX_NAME]
    lines = (dst / INDEX_NAME).read_text().splitlines()
    assert len(lines) == 22 and json.loads(lines[0])["fmstore_lazy"] == 1


def test_ls_shows_what_is_listed_but_not_fetched(lazy_tree):
    """Before anything is fetched: the top level shows the lazy directories, a lazy
    directory lists its files, and -l marks them 'lazy'."""
    _src, dst = lazy_tree
    r = fm("ls", str(dst))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["train/", "val/"] and "21 more listed lazily" in r.stdout
    r = fm("ls", "-l", str(dst / "train"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("lazy") >= 20 and "train/00.bin" not in r.stdout and "00.bin" in r.stdout
    assert fm("ls", str(dst / "nope")).returncode == 1


def test_first_read_fetches_and_keeps_the_file(lazy_tree):
    src, dst = lazy_tree
    with fmstore.open(str(dst / "train" / "03.bin")) as f:
        assert f.read() == (src / "train" / "03.bin").read_bytes()
    assert (dst / "train" / "03.bin").exists()
    assert not (dst / "train" / "04.bin").exists()
    with fmstore.open(str(dst / "val" / "big.bin")) as f:
        assert crc32c(f.read()) == crc32c((src / "val" / "big.bin").read_bytes())
    with pytest.raises(NotFound):
        fmstore.open(str(dst / "train" / "nope.bin"))


def test_hydrate_then_release_round_trip(lazy_tree):
    src, dst = lazy_tree
    r = fm("hydrate", str(dst / "train"), "--json", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files_copied"] == 20
    assert not (dst / "val" / "big.bin").exists()
    assert file_crcs(str(dst / "train")) == file_crcs(str(src / "train"))
    # A locally modified file and a file changed on the source are not safe to drop.
    (dst / "train" / "00.bin").write_bytes(b"local edit")
    (src / "train" / "01.bin").write_bytes(os.urandom(1001))
    r = fm("release", str(dst / "train"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert sorted(out["kept"]) == ["train/00.bin", "train/01.bin"]
    assert len(out["released"]) == 18
    assert sorted(os.listdir(dst / "train")) == ["00.bin", "01.bin"]
    assert (dst / INDEX_NAME).exists()
    # Released files come back on the next read.
    with fmstore.open(str(dst / "train" / "05.bin")) as f:
        assert f.read() == (src / "train" / "05.bin").read_bytes()


def test_staging_lazily_again_drops_copies_the_new_listing_makes_stale(lazy_tree):
    """A new listing over a hydrated tree: the copy of a file changed on the source is
    dropped (the next read fetches the new one), a copy edited locally is kept and named,
    the others stay."""
    src, dst = lazy_tree
    assert fm("hydrate", str(dst / "train"), "--no-progress").returncode == 0
    (src / "train" / "01.bin").write_bytes(b"new on the source")
    (dst / "train" / "02.bin").write_bytes(b"local edit")
    r = fm("stage", str(src), str(dst), "--lazy", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["lazy_dropped"] == 1 and out["lazy_kept"] == ["train/02.bin"], out
    assert "kept train/02.bin: changed locally" in r.stderr
    assert out["bytes_total"] == sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert len(os.listdir(dst / "train")) == 19
    with fmstore.open(str(dst / "train" / "01.bin")) as f:
        assert f.read() == b"new on the source"
    assert (dst / "train" / "02.bin").read_bytes() == b"local edit"
    assert (dst / "train" / "03.bin").read_bytes() == (src / "train" / "03.bin").read_bytes()


def test_an_interrupted_hydrate_resumes_and_leaves_no_temp_file(lazy_tree, tmp_path):
    """hydrate keeps the staging's journal: killed mid-file, the next hydrate keeps the
    finished parts of the big file and leaves no temp file behind."""
    src, dst = lazy_tree
    home = str(tmp_path / "home")
    args = [
        "hydrate",
        str(dst / "val"),
        "--no-progress",
        "--bwlimit",
        "5MiB/s",
    ]  # ready at 2 s of 14
    kill9_when(args, lambda: _parts_journaled(home))
    r = fm("hydrate", str(dst / "val"), "--no-progress", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes_resumed"] > 0
    assert (dst / "val" / "big.bin").read_bytes() == (src / "val" / "big.bin").read_bytes()
    assert not [f for f in os.listdir(dst / "val") if f.startswith(".fmstore-tmp")]


def test_the_library_hydrate_resumes_as_the_command_does(lazy_tree, tmp_path):
    """``fmstore.tiering.lazy.hydrate_async`` keeps the staging's journal: cancelled
    mid-file, the next ``hydrate`` keeps the finished parts of the big file."""
    import threading

    from fmstore import runtime
    from fmstore.tiering import lazy
    from fmstore.tiering.transfer import TransferOptions, TransferProgress

    src, dst = lazy_tree
    home = str(tmp_path / "home")
    state = os.path.join(home, "state")
    # 8 MiB parts at 5 MiB/s: ready at about 2 s of 14, so it cannot finish first.
    parts = {"part_size": 8 << 20, "multipart_threshold": 16 << 20}
    slow = TransferOptions(bwlimit=5 << 20, **parts)
    ended = threading.Event()

    async def first() -> None:
        try:
            await lazy.hydrate_async(str(dst / "val"), slow, state_dir=state)
        finally:
            ended.set()

    run = runtime.submit(first())
    try:
        while not _parts_journaled(home):
            assert not run.done(), "the hydrate ended before it could be cancelled"
            ended.wait(0.05)
    finally:
        run.cancel()
        assert ended.wait(60)
    assert not (dst / "val" / "big.bin").exists()
    progress = TransferProgress()
    report = lazy.hydrate(
        str(dst / "val"), TransferOptions(**parts), state_dir=state, progress=progress
    )
    assert report.ok and report.progress is progress and progress.bytes_resumed > 0
    assert (dst / "val" / "big.bin").read_bytes() == (src / "val" / "big.bin").read_bytes()
    assert not [f for f in os.listdir(dst / "val") if f.startswith(".fmstore-tmp")]


def _parts_journaled(home: str) -> bool:
    d = os.path.join(home, "state", "transfers")
    for name in os.listdir(d) if os.path.isdir(d) else []:
        with open(os.path.join(d, name), "rb") as f:
            if b'{"p":' in f.read():
                return True
    return False


def test_hydrate_outside_a_lazy_tree_is_a_clear_error(tmp_path):
    r = fm("hydrate", str(tmp_path))
    assert r.returncode == 1 and "not inside a lazily staged directory" in r.stderr
