"""fmstore stage between POSIX and S3 (a real SeaweedFS server), both ways: checksums,
skip on re-run, FSx metadata, kill -9 and resume of multipart uploads, faults through
the fault proxy, a missing bucket."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
from pagecache import cachestat
from stage_data import (
    SMALL_N,
    file_crcs,
    fm,
    journal_parts,
    kill9_after_parts,
    kill9_when,
    make_dataset,
    pass_then_hold,
    proxied,
    s3_env,
    write_s3_config,
)

from fmstore import runtime
from fmstore.errors import ConfigError
from fmstore.stores import open_store
from fmstore.stores.base import PrefixStore
from fmstore.stores.crc import crc32c
from fmstore.testing.faultproxy import FaultProxy, Rule
from fmstore.tiering.copy.transfer import TransferOptions, copy_items
from fmstore.tiering.staging.stage import plan_stage

pytestmark = pytest.mark.s3


#: The big files here: above the 64 MiB multipart threshold, twelve 8 MiB parts each, two
#: of them (one with other permissions); the POSIX tests keep three of 300 MiB.
BIG_N, BIG_SIZE = 2, 96 << 20


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(
        tmp_path_factory.mktemp("dataset"), small_dirs=3, big_n=BIG_N, big_size=BIG_SIZE
    )


@pytest.fixture
def s3env(s3_server, s3_bucket, tmp_path):
    return s3_env(s3_server, s3_bucket, tmp_path)


def _s3(s3_server, bucket: str, prefix: str = "ds"):
    return open_store(f"s3://{bucket}/{prefix}", **s3_server.store_options())


#: SeaweedFS on a small shared machine takes about 100 small PUTs a second, so the S3 test
#: stages 600 of the 10,000 small files (the POSIX tests and the benchmark use them all).
SUBSET = "d0[0-2]/*"
SUBSET_N = 3 * SMALL_N // 50


def test_small_files_posix_to_s3_and_back(dataset, s3env, s3_server, tmp_path):
    env = s3env["env"]
    sub = ["--include", SUBSET]
    r = fm("stage", dataset["small"], "s3:small", "--json", "--no-progress", *sub, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files_copied"] == SUBSET_N
    head = s3_server.boto3_client().head_object(
        Bucket=s3env["bucket"], Key="ds/small/d02/f00002.bin"
    )
    assert head["Metadata"]["fmstore-crc32c"] == f"{dataset['small_crcs']['d02/f00002.bin']:08x}"
    assert head["Metadata"]["file-permissions"] == "0100644"
    r = fm("stage", dataset["small"], "s3:small", "--json", "--no-progress", *sub, env=env)
    assert json.loads(r.stdout)["files_skipped"] == SUBSET_N
    back = tmp_path / "back"
    r = fm("stage", "s3:small", str(back), "--json", "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files_copied"] == SUBSET_N
    want = {
        k: v for k, v in dataset["small_crcs"].items() if k.split("/")[0] in ("d00", "d01", "d02")
    }
    assert file_crcs(str(back)) == want
    # Another node (no journal here) still skips: identity comes from recorded metadata.
    r = fm(
        "stage",
        "s3:small",
        str(back),
        "--json",
        "--no-progress",
        env={**env, "FMSTORE_HOME": str(tmp_path / "h2")},
    )
    assert json.loads(r.stdout)["files_skipped"] == SUBSET_N


@pytest.mark.slow
def test_big_files_posix_to_s3_and_back_keep_fsx_metadata(dataset, s3env, s3_server, tmp_path):
    env = s3env["env"]
    r = fm("stage", dataset["big"], "s3:big", "--json", "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files_copied"] == BIG_N
    c = s3_server.boto3_client()
    head = c.head_object(Bucket=s3env["bucket"], Key="ds/big/shard-1.bin")
    st = os.stat(os.path.join(dataset["big"], "shard-1.bin"))
    assert head["Metadata"]["file-permissions"] == "0100640"
    assert head["Metadata"]["file-mtime"] == f"{st.st_mtime_ns}ns"
    assert head["ContentLength"] == BIG_SIZE
    back = tmp_path / "back"
    r = fm("stage", "s3:big", str(back), "--json", "--no-progress", "--verify", env=env)
    assert r.returncode == 0, r.stderr
    assert file_crcs(str(back)) == dataset["big_crcs"]
    got = os.stat(back / "shard-1.bin")
    assert stat.S_IMODE(got.st_mode) == 0o640 and got.st_mtime_ns == st.st_mtime_ns
    r = fm("stage", dataset["big"], "s3:big", "--json", "--no-progress", env=env)
    assert json.loads(r.stdout)["files_skipped"] == BIG_N


#: ``python -m fmstore`` with Python's Ctrl-C handler, as in a terminal's foreground: a test
#: runner started in the background (``cmd &`` in a script) passes SIGINT on as ignored.
FOREGROUND = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'fmstore'; runpy.run_module('fmstore', run_name='__main__', alter_sys=True)"
)


def test_ctrl_c_exits_130_and_the_rerun_resumes(s3env, s3_server, tmp_path):
    src = _s3(s3_server, s3env["bucket"], "ds/held")
    body = os.urandom(80 << 20)
    runtime.run(src.put("big.bin", body))
    dst = tmp_path / "dst"
    args = ["stage", "proxied:held", str(dst), "--part-size", "8MiB", "--no-progress"]
    args += ["--shard", "none"]
    with proxied(s3env, s3_server, pass_then_hold(5, "GET", r"/ds/held/big\.bin")) as proxy:
        proc = subprocess.Popen(
            [sys.executable, "-c", FOREGROUND, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **s3env["env"], "PYTHONFAULTHANDLER": "1"},
        )
        try:
            while len(journal_parts(s3env["home"])) < 5:
                assert proc.poll() is None, proc.communicate()[1]
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            try:
                _out, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack
                pytest.fail("no exit 120 s after SIGINT:\n" + proc.communicate()[1][-20000:])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 130, err
        assert "run the same command again to resume" in err
        assert not (dst / "big.bin").exists()
        proxy.clear()
        r = fm(*args, "--json", env=s3env["env"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes_resumed"] >= 5 * (8 << 20)
    assert crc32c((dst / "big.bin").read_bytes()) == crc32c(body)


@pytest.mark.slow
def test_kill9_during_upload_resumes_multipart_without_resending_parts(dataset, s3env, s3_server):
    env = s3env["env"]
    # One file is enough to interrupt mid-upload (the other is the big test's): 8 of its
    # 12 parts go through, the next ones stall until the kill.
    args = ["stage", dataset["big"], "proxied:resume", "--part-size", "8MiB", "--no-progress"]
    args += ["--include", "shard-0.bin"]
    with proxied(s3env, s3_server, pass_then_hold(8, "PUT", r"/ds/resume/shard-0\.bin")):
        kill9_after_parts([*args, "--concurrency", "4"], s3env, 8)
    done = sum(r["n"] for r in journal_parts(s3env["home"]))
    c = s3_server.boto3_client()
    listed = c.list_objects_v2(Bucket=s3env["bucket"], Prefix="ds/resume/").get("Contents", [])
    assert all(o["Size"] == BIG_SIZE for o in listed)  # nothing partial is visible
    with proxied(s3env, s3_server, []):
        r = fm(*args, "--json", env=env)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["bytes_resumed"] >= done
    assert s["bytes_copied"] <= BIG_SIZE - done
    store = _s3(s3_server, s3env["bucket"], "ds/resume")
    assert crc32c(runtime.run(store.get("shard-0.bin"))) == dataset["big_crcs"]["shard-0.bin"]
    assert not c.list_multipart_uploads(Bucket=s3env["bucket"]).get("Uploads")


@pytest.mark.slow
def test_an_upload_that_cannot_be_resumed_is_aborted(dataset, s3env, s3_server):
    """Killed mid-upload, then run again with another part size: the journaled parts do
    not fit, so the file is uploaded afresh and the first run's upload is aborted rather
    than left to hold its parts."""
    args = ["stage", dataset["big"], "proxied:again", "--no-progress", "--include", "shard-0.bin"]
    with proxied(s3env, s3_server, pass_then_hold(4, "PUT", r"/ds/again/shard-0\.bin")):
        kill9_after_parts([*args, "--part-size", "8MiB"], s3env, 4)
    c = s3_server.boto3_client()
    assert c.list_multipart_uploads(Bucket=s3env["bucket"]).get("Uploads")
    with proxied(s3env, s3_server, []):
        r = fm(*args, "--part-size", "16MiB", env=s3env["env"])
    assert r.returncode == 0, r.stderr
    store = _s3(s3_server, s3env["bucket"], "ds/again")
    assert crc32c(runtime.run(store.get("shard-0.bin"))) == dataset["big_crcs"]["shard-0.bin"]
    assert not c.list_multipart_uploads(Bucket=s3env["bucket"]).get("Uploads")


def test_kill9_during_a_mid_sized_download_resumes_its_parts(s3env, s3_server, tmp_path):
    """Below the multipart threshold (40 MiB < 64 MiB), an object from S3 to a local file
    still streams in parts (8 MiB here: one object, five requests): a killed run leaves them
    journaled, the next run (at another concurrency) keeps them and fetches only the rest."""
    src = _s3(s3_server, s3env["bucket"], "ds/mid")
    body = os.urandom(40 << 20)
    runtime.run(src.put("mid.bin", body))
    dst = tmp_path / "dst"
    args = ["stage", "proxied:mid", str(dst), "--no-progress", "--shard", "none"]
    env = s3env["env"]
    with proxied(s3env, s3_server, pass_then_hold(2, "GET", r"/ds/mid/mid\.bin")):
        kill9_after_parts([*args, "--concurrency", "5"], s3env, 2)
    parts = journal_parts(s3env["home"])
    assert {r["n"] for r in parts} == {8 << 20}
    assert not (dst / "mid.bin").exists()  # nothing partial at the final name
    with proxied(s3env, s3_server, []):
        r = fm(*args, "--json", env=env)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    done = sum(r["n"] for r in parts)
    assert s["bytes_resumed"] >= done
    assert s["bytes_copied"] <= len(body) - done
    assert crc32c((dst / "mid.bin").read_bytes()) == crc32c(body)
    assert sorted(os.listdir(dst)) == ["mid.bin"]


def test_s3_to_posix_through_faults(s3env, s3_server, tmp_path):
    src = _s3(s3_server, s3env["bucket"], "ds/faulty")

    async def fill():
        for i in range(100):
            await src.put(f"f{i:03d}", os.urandom(3000))
        await src.put("big.bin", os.urandom(24 << 20))

    runtime.run(fill())
    want = {}

    async def crcs():
        async for m in src.list(""):
            want[m.key] = crc32c(await src.get(m.key))

    runtime.run(crcs())
    with FaultProxy(s3_server.endpoint_url, seed=7) as proxy:
        proxy.set_plan(
            [
                Rule("slowdown", method="GET", rate=0.1),
                Rule("reset", method="GET", rate=0.05),
                Rule("truncate", method="GET", rate=0.03),
            ]
        )
        cfg = s3env["cfg"]
        cfg.write_text(cfg.read_text().replace("PROXY", proxy.endpoint_url))
        dst = tmp_path / "dst"
        r = fm(
            "stage",
            "proxied:faulty",
            str(dst),
            "--json",
            "--no-progress",
            "--part-size",
            "8MiB",
            env=s3env["env"],
        )
        assert r.returncode == 0, r.stderr
        assert sum(proxy.injected.values()) > 0
        assert file_crcs(str(dst)) == want
        proxy.down()
        # A dead endpoint is an error once the retries are spent: 3 of them, not the 20
        # that rode out the faults above (at up to 5 s each).
        cfg.write_text(cfg.read_text().replace("max_attempts = 20", "max_attempts = 3"))
        r = fm("stage", "proxied:faulty", str(tmp_path / "dst2"), "--no-progress", env=s3env["env"])
        assert r.returncode == 1 and "error:" in r.stderr and "Traceback" not in r.stderr


def test_missing_bucket_is_a_clear_error(s3env, s3_server, tmp_path):
    cfg = tmp_path / "missing.toml"
    write_s3_config(cfg, s3_server.endpoint_url, "no-such-bucket-here")
    env = {**s3env["env"], "FMSTORE_CONFIG": str(cfg)}
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    r = fm("stage", str(tmp_path / "src"), "s3:x", env=env)
    assert r.returncode == 1 and "does not exist" in r.stderr, r.stderr
    r = fm("stage", "s3:x", str(tmp_path / "dst"), env=env)
    assert r.returncode == 1 and "does not exist" in r.stderr, r.stderr


def test_a_source_with_no_files_is_an_error_and_creates_nothing(s3env, tmp_path):
    """A Slurm prolog staging from a mistyped prefix must fail, not start the job."""
    env = s3env["env"]
    for extra in ([], ["--dry-run"]):
        r = fm("stage", "s3:nods", str(tmp_path / "x"), *extra, env=env)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "source 's3:nods' has no objects" in r.stderr and "missing one" in r.stderr
        assert not (tmp_path / "x").exists()
    (tmp_path / "empty").mkdir()
    r = fm("stage", str(tmp_path / "empty"), "s3:y", env=env)
    assert r.returncode == 1 and "is an empty directory" in r.stderr, r.stderr
    r = fm("stage", str(tmp_path / "empty"), str(tmp_path / "z"), env=env)
    assert r.returncode == 1 and not (tmp_path / "z").exists()


def test_stage_concurrency_is_the_s3_stores_request_limit(s3env, s3_server, tmp_path):
    """``fmstore stage --concurrency 40`` has 40 requests in flight on S3, not the S3
    store's own default of 16: every GET of a file is held by the proxy (a read timeout
    longer than the test, so none is retried), and the run is stopped once 40 are held
    at once."""
    src = _s3(s3_server, s3env["bucket"], "ds/conc")

    async def fill():
        for i in range(40):
            await src.put(f"f{i:02d}", os.urandom(1000))

    runtime.run(fill())
    cfg = tmp_path / "held.toml"
    with FaultProxy(s3_server.endpoint_url) as proxy:
        proxy.set_plan([Rule("stall", method="GET", path=rf"^/{s3env['bucket']}/ds/conc/f\d+")])
        cfg.write_text(
            f"""
[tiers.held]
url = "s3://{s3env["bucket"]}/ds"
endpoint_url = "{proxy.endpoint_url}"
addressing_style = "path"
region = "us-east-1"
read_timeout = 3600
"""
        )
        args = ["stage", "held:conc", str(tmp_path / "dst"), "--no-progress", "--shard", "none"]
        kill9_when(
            [*args, "--concurrency", "40"],
            lambda: proxy.injected["stall"] >= 40,
            env={**s3env["env"], "FMSTORE_CONFIG": str(cfg)},
        )
        assert proxy.injected["stall"] == 40


def test_open_store_gives_s3_the_callers_concurrency_unless_its_options_name_one(tmp_path):
    from fmstore.config import Config, TierConfig
    from fmstore.stores import Location

    opts = {"endpoint_url": "http://127.0.0.1:9", "region": "us-east-1", "metered": False}
    assert open_store("s3://bkt/p", **opts).options.max_concurrency == 16
    store = open_store("s3://bkt/p", concurrency=64, **opts)
    assert store.options.max_concurrency == 64 and store.limiter.max_limit == 64
    explicit = open_store("s3://bkt/p", concurrency=64, max_concurrency=8, **opts)
    assert explicit.options.max_concurrency == 8
    # A limit set in the tier's configuration is the operator's: it holds.
    tier = {"endpoint_url": opts["endpoint_url"], "region": "us-east-1", "max_concurrency": 8}
    cfg = Config(tiers={"s3": TierConfig("s3", "s3://bkt/p", tier)}, state_dir=str(tmp_path))
    tiered = Location.parse("s3:sub", cfg).open(concurrency=64)
    assert tiered.inner.options.max_concurrency == 8
    # Backends without a request limit of their own take the figure and ignore it.
    local = open_store(str(tmp_path / "d"), concurrency=64, metered=False)
    assert local.local_root == str(tmp_path / "d")
    with pytest.raises(ConfigError):
        open_store("s3://bkt/p", concurrency=0, **opts)


def test_a_download_asks_for_each_object_once(s3env, s3_server, tmp_path):
    """Per object one HEAD (its metadata and version) and its ranges, all pinned to that
    version, so no second HEAD to see whether it changed meanwhile; with as many objects as
    requests in flight, each is one GET, while an object alone still goes as several."""
    bucket = s3env["bucket"]
    src = _s3(s3_server, bucket, "ds/once")
    bodies = {f"f{i}.bin": os.urandom(12 << 20) for i in range(4)}
    for k, b in bodies.items():
        runtime.run(src.put(k, b))
    env = s3env["env"]
    dst = tmp_path / "dst"
    with proxied(s3env, s3_server, []) as proxy:
        r = fm("stage", "proxied:once", str(dst), "--no-progress", "-c", "4", env=env)
        assert r.returncode == 0, r.stderr
        asked = [(s.method, s.path) for s in proxy.seen if s.path.startswith(f"/{bucket}/ds/once/")]
        one = tmp_path / "one"
        first_run = len(proxy.seen)
        r = fm(
            "stage",
            "proxied:once",
            str(one),
            "--include",
            "f0.bin",
            "--no-progress",
            "-c",
            "4",
            env=env,
        )
        assert r.returncode == 0, r.stderr
        alone = [s for s in proxy.seen[first_run:] if s.path == f"/{bucket}/ds/once/f0.bin"]
    for k, body in bodies.items():
        path = f"/{bucket}/ds/once/{k}"
        assert sorted(m for m, p in asked if p == path) == ["GET", "HEAD"], k
        assert (dst / k).read_bytes() == body
    assert [s.method for s in alone].count("HEAD") == 1
    # Two ranged GETs, sent at once: the order they reach the server in is not fixed.
    assert sorted(s.range for s in alone if s.method == "GET") == [
        "bytes=0-8388607",
        "bytes=8388608-12582911",
    ]
    assert (one / "f0.bin").read_bytes() == bodies["f0.bin"]


class _OverwrittenAfterOneRange(PrefixStore):
    """The real store, whose object someone overwrites right after the first range of it
    is read (the moment a copy in several ranges could splice two versions)."""

    def __init__(self, inner, overwrite) -> None:
        super().__init__(inner, "")
        self.overwrite = overwrite

    async def read_to(self, key, start, end, consume, *, etag=None, ring=None):
        await super().read_to(key, start, end, consume, etag=etag, ring=ring)
        if self.overwrite is not None:
            self.overwrite, overwrite = None, self.overwrite
            overwrite()


def test_an_object_overwritten_between_its_ranges_is_copied_again_whole(s3env, s3_server, tmp_path):
    """Written by another tool (no checksum in its metadata to catch a splice), the object
    changes after the first of its three ranges is read: the next range, pinned to the
    version the copy began with, is refused, and the retry copies the new version whole."""
    bucket = s3env["bucket"]
    old, new = os.urandom(24 << 20), os.urandom(24 << 20)
    boto = s3_server.boto3_client()
    boto.put_object(Bucket=bucket, Key="ds/splice/obj.bin", Body=old)
    s3 = _s3(s3_server, bucket, "ds/splice")
    src = _OverwrittenAfterOneRange(
        s3, lambda: boto.put_object(Bucket=bucket, Key="ds/splice/obj.bin", Body=new)
    )
    dst = open_store(str(tmp_path / "dst"))
    items = runtime.run(plan_stage(src, dst)).items
    opts = TransferOptions(concurrency=1, part_size=8 << 20, retries=1)
    report = runtime.run(copy_items(src, dst, items, opts))
    assert report.ok and report.progress.files_copied == 1
    assert (tmp_path / "dst" / "obj.bin").read_bytes() == new
    runtime.run(s3.close())


def test_fsync_none_leaves_write_back_to_the_kernel_and_batch_syncs(s3env, s3_server, tmp_path):
    """``--fsync none`` is scratch data: its small files are neither synced nor have their
    write-back started (that CPU is the copy's; the kernel's flusher writes them later).
    A big file streams to disk from the rings it is received into (``O_DIRECT``), in
    either mode: none of it passes through the page cache.  The default leaves nothing
    dirty behind it."""
    src = _s3(s3_server, s3env["bucket"], "ds/scratch")
    bodies = {"big.bin": os.urandom(24 << 20), "small.bin": os.urandom(64 << 10)}
    for k, b in bodies.items():
        runtime.run(src.put(k, b))
    pages = {k: -(-len(b) // os.sysconf("SC_PAGE_SIZE")) for k, b in bodies.items()}
    # Each run's files are looked at before the next: a sync of the file system (the
    # default's) writes back everyone's dirty pages.
    # The flusher starts on its own only past dirty_expire_centisecs (30 s by default) or
    # under memory pressure; a few pages may have gone already.
    for dst, extra in ((tmp_path / "scratch", ["--fsync", "none"]), (tmp_path / "durable", [])):
        r = fm("stage", "s3:scratch", str(dst), "--no-progress", *extra, env=s3env["env"])
        assert r.returncode == 0, r.stderr
        cached = {k: cachestat(dst / k) for k in bodies}
        for k, b in bodies.items():
            assert (dst / k).read_bytes() == b
        assert cached["big.bin"] == (0, 0)
        if extra:
            assert cached["small.bin"] == (pages["small.bin"], pages["small.bin"])
        else:
            assert cached["small.bin"][1] == 0
