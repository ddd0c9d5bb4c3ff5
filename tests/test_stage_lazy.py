"""Lazy staging: only the listing is staged; fmstore.open fetches on first read and keeps
the file; hydrate preloads; release drops content only where that is safe."""

from __future__ import annotations

import json
import os

import pytest
from stage_data import file_crcs, fm, fm_here, kill9_when

import fmstore
from fmstore.config import set_config
from fmstore.errors import CorruptData, NotFound, PermissionDenied
from fmstore.stores.crc import crc32c
from fmstore.tiering.staging import lazy
from fmstore.tiering.staging.lazy import INDEX_NAME
from fmstore.tiering.staging.lazy_index import MAX_INDEX_BYTES as LAZY_MAX


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
    """``fmstore.tiering.staging.lazy.hydrate_async`` keeps the staging's journal: cancelled
    mid-file, the next ``hydrate`` keeps the finished parts of the big file."""
    import threading

    from fmstore import runtime
    from fmstore.tiering.copy.transfer import TransferOptions, TransferProgress
    from fmstore.tiering.staging import lazy

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
        if not os.path.isfile(os.path.join(d, name)):
            continue  # the stage locks' directory
        with open(os.path.join(d, name), "rb") as f:
            if b'{"p":' in f.read():
                return True
    return False


def test_hydrate_outside_a_lazy_tree_is_a_clear_error(tmp_path):
    r = fm("hydrate", str(tmp_path))
    assert r.returncode == 1 and "not inside a lazily staged directory" in r.stderr


# ---- the index is hostile data (who wrote it, where it lies, what it names) --------------

ROOT = os.geteuid() == 0
as_root = pytest.mark.skipif(not ROOT, reason="needs root to give files to another user")
OTHER_UID = 12345


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """A config with POSIX tiers ``nvme`` and ``lustre`` and ``[stage] lazy_sources``
    naming ``tmp_path/allowed``; a file there (``ok.bin``) and a root-only file outside
    (``secret/key``, 0600 in a 0700 directory)."""
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "ok.bin").write_bytes(b"allowed bytes")
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    (secret / "key").write_bytes(b"root only")
    (secret / "key").chmod(0o600)
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
        f'[tiers.lustre]\nurl = "{tmp_path / "lustre"}"\n'
        f'[stage]\nlazy_sources = ["{tmp_path / "allowed"}"]\n'
    )
    monkeypatch.setenv("FMSTORE_CONFIG", str(cfg))
    monkeypatch.setenv("FMSTORE_HOME", str(tmp_path / "home"))
    set_config(None)
    yield tmp_path
    set_config(None)


def _index(where, source: str, keys=("ok.bin",), *, uid: int | None = None, size: int = 13):
    where.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"fmstore_lazy": 1, "source": source})]
    lines += [json.dumps({"k": k, "s": size}) for k in keys]
    (where / INDEX_NAME).write_text("\n".join(lines) + "\n")
    if uid is not None:
        os.chown(where / INDEX_NAME, uid, uid)
    return where / INDEX_NAME


def _refused(r, *words: str) -> None:
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


@as_root
def test_a_root_only_file_is_not_copied_by_a_users_index(hostile):
    """The issue's first case: a user's index names a root-only file (``local://``); root's
    hydrate refuses the index (owned by the user) and copies nothing."""
    user_dir = hostile / "user"
    user_dir.mkdir()
    os.chown(user_dir, OTHER_UID, OTHER_UID)
    _index(user_dir, f"local://{hostile / 'secret'}", ["key"], uid=OTHER_UID, size=9)
    _refused(fm_here("hydrate", str(user_dir)), "not trusted", f"owned by uid {OTHER_UID}")
    assert not (user_dir / "key").exists()
    with pytest.raises(PermissionDenied):
        fmstore.open(str(user_dir / "key"))
    assert not (user_dir / "key").exists()


@pytest.mark.parametrize(
    "form", ["local", "file", "path", "simplecache", "relative", "dotdot", "s3-other"]
)
def test_sources_that_are_no_tier_and_not_allowed_are_never_opened(hostile, form):
    """A trusted index (root's, in root's directory) still names its source only among the
    configured tiers and [stage] lazy_sources: no other path or protocol is opened."""
    secret = hostile / "secret"
    source = {
        "local": f"local://{secret}",
        "file": f"file://{secret}",
        "path": str(secret),
        "simplecache": f"simplecache::file://{secret}",
        "relative": "secret",
        "dotdot": f"{hostile / 'allowed'}/../secret",
        "s3-other": "s3://some-bucket/ds",
    }[form]
    dst = hostile / "dst"
    _index(dst, source, ["key"], size=9)
    _refused(fm_here("hydrate", str(dst)), "neither a configured tier", "lazy_sources")
    with pytest.raises(PermissionDenied):
        fmstore.open(str(dst / "key"))
    assert os.listdir(dst) == [INDEX_NAME]


def test_sources_in_a_tier_or_lazy_sources_are_fetched_with_their_mode(hostile):
    """Allowed: a tier (as ``TIER:path`` or its directory) and a location of lazy_sources.
    The copy keeps the source's mode: a 0600 file is not made readable by others."""
    lustre = hostile / "lustre" / "ds"
    lustre.mkdir(parents=True)
    (lustre / "ok.bin").write_bytes(b"lustre bytes")
    (lustre / "ok.bin").chmod(0o600)
    for n, source in enumerate(["lustre:ds", str(lustre), str(hostile / "allowed")]):
        dst = hostile / f"dst{n}"
        _index(dst, source, size=(lustre / "ok.bin").stat().st_size if n < 2 else 13)
        r = fm_here("hydrate", str(dst), "--json", "--no-progress")
        assert r.returncode == 0, r.stderr
        assert (dst / "ok.bin").read_bytes() == (b"lustre bytes" if n < 2 else b"allowed bytes")
        want = 0o600 if n < 2 else (hostile / "allowed" / "ok.bin").stat().st_mode & 0o777
        assert (dst / "ok.bin").stat().st_mode & 0o777 == want


@pytest.fixture
def http_server():
    """A loopback HTTP server standing in for an instance-metadata endpoint; it counts
    the requests it gets."""
    import http.server
    import threading

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            body = b'{"secret": "credentials"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", hits
    server.shutdown()
    server.server_close()
    t.join()


def test_an_http_source_is_never_fetched(hostile, http_server):
    """The issue's second case: an index naming an HTTP endpoint fetches nothing through
    hydrate, fmstore.open or the fsspec protocol; the server sees no request."""
    import fsspec

    url, hits = http_server
    dst = hostile / "nvme" / "ds"
    _index(dst, f"{url}/latest/meta-data", ["iam"], size=25)
    _refused(fm_here("hydrate", str(dst)), "neither a configured tier")
    with pytest.raises(PermissionDenied):
        fmstore.open(str(dst / "iam"))
    fs = fsspec.filesystem("fmstore", skip_instance_cache=True)
    with pytest.raises(PermissionDenied):
        fs.cat_file("nvme/ds/iam")
    assert hits == [] and os.listdir(dst) == [INDEX_NAME]


@pytest.mark.parametrize("owner", ["user", "root"])
def test_an_index_in_a_sticky_scratch_directory_is_not_used(hostile, owner):
    """The issue's third case: an index in a 1777 scratch directory does not govern root's
    0755 directory below it, whoever owns the index; nothing is written there."""
    if owner == "user" and not ROOT:
        pytest.skip("needs root to give files to another user")
    scratch = hostile / "scratch"
    scratch.mkdir()
    scratch.chmod(0o1777)
    (scratch / "rootdir").mkdir(mode=0o755)
    (hostile / "allowed" / "rootdir").mkdir()
    (hostile / "allowed" / "rootdir" / "ok.bin").write_bytes(b"allowed bytes")
    _index(
        scratch,
        str(hostile / "allowed"),
        ["rootdir/ok.bin"],
        uid=OTHER_UID if owner == "user" else None,
    )
    r = fm_here("hydrate", str(scratch / "rootdir"))
    why = f"owned by uid {OTHER_UID}" if owner == "user" else "writable by others (mode 1777)"
    _refused(r, "not trusted", why)
    with pytest.raises(PermissionDenied):
        fmstore.open(str(scratch / "rootdir" / "ok.bin"))
    assert os.listdir(scratch / "rootdir") == []


def test_directories_others_can_write_or_own_make_an_index_untrusted(hostile):
    """Writable by others anywhere on its path (not only the index's own directory), or
    the index itself writable by others: not used.  A sticky ancestor whose next directory
    down is root's is fine (every test tree here lies below /tmp)."""
    top = hostile / "open"
    dst = top / "ds"
    _index(dst, str(hostile / "allowed"))
    top.chmod(0o777)
    _refused(fm_here("hydrate", str(dst)), f"directory {top} is writable by others (mode 0777)")
    top.chmod(0o755)
    (dst / INDEX_NAME).chmod(0o666)
    _refused(fm_here("hydrate", str(dst)), "writable by others (mode 0666)")
    (dst / INDEX_NAME).chmod(0o644)
    assert fm_here("hydrate", str(dst), "--no-progress").returncode == 0
    assert (dst / "ok.bin").read_bytes() == b"allowed bytes"


@as_root
def test_a_directory_owned_by_another_user_makes_an_index_untrusted(hostile):
    top = hostile / "theirs"
    dst = top / "ds"
    _index(dst, str(hostile / "allowed"))
    os.chown(top, OTHER_UID, OTHER_UID)
    _refused(fm_here("hydrate", str(dst)), f"directory {top} is owned by uid {OTHER_UID}")


def test_the_fsspec_protocol_uses_no_index_above_the_tier_or_of_another_user(hostile):
    """The issue's fourth case, through ``fmstore://``: ``cat_file`` of a missing key
    fetches nothing from an index above the tier's root, nor from one another user owns."""
    import fsspec

    (hostile / "nvme").mkdir()
    above = _index(hostile, str(hostile / "allowed"), ["nvme/ok.bin"])
    fs = fsspec.filesystem("fmstore", skip_instance_cache=True)
    with pytest.raises(FileNotFoundError):
        fs.cat_file("nvme/ok.bin")
    assert not fs.exists("nvme/ok.bin") and fs.ls("nvme", detail=False) == []
    above.unlink()
    if ROOT:
        _index(hostile / "nvme" / "ds", str(hostile / "allowed"), uid=OTHER_UID)
        with pytest.raises(FileNotFoundError):
            fs.cat_file("nvme/ds/ok.bin")
        assert not fs.exists("nvme/ds/ok.bin")
        assert fs.ls("nvme/ds", detail=False) == [f"nvme/ds/{INDEX_NAME}"]
    assert not (hostile / "nvme" / "ok.bin").exists()
    assert not (hostile / "nvme" / "ds" / "ok.bin").exists()


# ---- the index is read bounded, without following links or blocking ---------------------


def test_an_index_linked_to_dev_zero_or_a_fifo_is_refused_at_once(hostile):
    """Linked to /dev/zero the old reader died of MemoryError; as a FIFO, hydrate hung.
    Both are refused, without opening the file (the FIFO is run in a child with a time
    limit, so a hang fails instead of blocking the suite)."""
    import fsspec

    dst = hostile / "nvme" / "ds"
    dst.mkdir(parents=True)
    os.symlink("/dev/zero", dst / INDEX_NAME)
    _refused(fm_here("hydrate", str(dst)), "lazy index is a symbolic link")
    with pytest.raises(CorruptData, match="symbolic link"):
        fsspec.filesystem("fmstore", skip_instance_cache=True).ls("nvme/ds/sub")
    (dst / INDEX_NAME).unlink()
    os.mkfifo(dst / INDEX_NAME)
    _refused(fm("hydrate", str(dst)), "lazy index is a FIFO")
    (dst / INDEX_NAME).unlink()
    with open(dst / INDEX_NAME, "wb") as f:  # sparse: its size alone is refused
        f.truncate(LAZY_MAX + 1)
    _refused(fm_here("hydrate", str(dst)), "over the")


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"[1]", "must be a JSON object"),
        (b'{"k":"a","s":"x"}', "'s' (the size)"),
        (b'{"k":"a","s":true}', "'s' (the size)"),
        (b'{"k":"a","s":-1}', "'s' (the size)"),
        (b'{"k":5,"s":1}', "'k' (the key)"),
        (b'{"k":"../x","s":1}', "bad key"),
        (b'{"k":"/etc/passwd","s":1}', "bad key"),
        (b'{"k":".fmstore-lazy.jsonl","s":1}', "fmstore keeps for itself"),
        (b'{"k":"a","s":1,"c":5}', "'c' (the checksum)"),
        (b'{"k":"a","s":1,"v":[1]}', "'v' (the source version)"),
        (b'{"k":"ok.bin","s":1}', "listed twice"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"k": "a", "s": 1', "not a JSON value"),
        (b"[" * 200_000, "longer than"),
        (b"[" * 30_000 + b"]" * 30_000, "not a JSON value"),
        (b'{"k":"a","s":1e999}', "'s' (the size)"),
    ],
)
def test_bad_lines_are_corrupt_data_naming_the_file_and_line(hostile, line, why):
    dst = hostile / "dst"
    _index(dst, str(hostile / "allowed"))
    with open(dst / INDEX_NAME, "ab") as f:
        f.write(line + b"\n")
    with pytest.raises(CorruptData) as e:
        lazy.find_index(str(dst))
    assert (
        "line 3" in str(e.value) and why in str(e.value) and str(dst / INDEX_NAME) in str(e.value)
    )


def test_a_bad_line_is_one_error_line_on_the_command_line(hostile):
    dst = hostile / "dst"
    _index(dst, str(hostile / "allowed"))
    with open(dst / INDEX_NAME, "ab") as f:
        f.write(b'{"k":"a","s":"x"}\n')
    _refused(fm_here("hydrate", str(dst)), "lazy index line 3", str(dst / INDEX_NAME))
    assert "Traceback" not in fm_here("ls", str(dst)).stderr


# ---- stage --lazy refuses up front what its listing could not be used for ----------------


def test_stage_lazy_refuses_a_source_an_index_may_not_name(hostile):
    src = hostile / "elsewhere"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a")
    r = fm_here("stage", "--lazy", str(src), str(hostile / "dst"))
    _refused(r, "--lazy:", "lazy_sources")
    assert not (hostile / "dst").exists()
    assert (
        fm_here("stage", "--lazy", str(hostile / "allowed"), str(hostile / "dst")).returncode == 0
    )
    (hostile / "nvme").mkdir()
    (hostile / "nvme" / "b.bin").write_bytes(b"b")  # an empty source is refused as such
    assert fm_here("stage", "--lazy", "nvme:", str(hostile / "dst2")).returncode == 0
    assert (hostile / "dst" / INDEX_NAME).stat().st_mode & 0o022 == 0


def test_stage_lazy_keeps_no_listing_that_would_not_be_used(hostile):
    """A listing written straight into a sticky scratch directory would never be used:
    stage --lazy says so (exit 1) and leaves none, instead of reporting success."""
    scratch = hostile / "scratch"
    scratch.mkdir()
    scratch.chmod(0o1777)
    r = fm_here("stage", "--lazy", str(hostile / "allowed"), str(scratch))
    _refused(r, "lazy listing not kept", "writable by others (mode 1777)")
    assert os.listdir(scratch) == []


def test_lazy_sources_must_be_a_list_of_local_or_s3_locations(hostile, monkeypatch):
    for bad, why in [
        ('"/x"', "must be a list"),
        ('["http://127.0.0.1/x"]', "only paths, file://, s3:// or TIER:path"),
        ('["relative/dir"]', "must be absolute"),
        ('["nope:x"]', "unknown tier"),
    ]:
        monkeypatch.setenv("FMSTORE__STAGE__LAZY_SOURCES", bad)
        set_config(None)
        dst = hostile / "dst"
        _index(dst, "s3://bucket/x")
        r = fm_here("hydrate", str(dst))
        assert r.returncode == 1 and why in r.stderr, (bad, r.stderr)


def test_a_fetch_is_not_readable_by_others_when_its_source_was_not(hostile):
    """Staging's mode rule for fetches: a 0644 file below a 0700 directory of a tier is
    hidden from other users there, so its copy gets no bits for others either."""
    private = hostile / "lustre" / "ds" / "private"
    private.mkdir(parents=True)
    (hostile / "lustre" / "ds").chmod(0o700)
    (private / "ok.bin").write_bytes(b"private bytes")
    (private / "ok.bin").chmod(0o644)
    (hostile / "lustre" / "ds" / "open.bin").write_bytes(b"open bytes")
    dst = hostile / "dst"
    _index(dst, "lustre:ds", ["private/ok.bin"], size=13)
    r = fm_here("hydrate", str(dst), "--json", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert (dst / "private" / "ok.bin").read_bytes() == b"private bytes"
    assert (dst / "private" / "ok.bin").stat().st_mode & 0o777 == 0o640
