"""fmstore stage between POSIX tiers and memory://: correctness, skip, resume, delete,
shards, dry runs, metadata, bad input.

One generated dataset per module (10,000 × 4 KiB files and 3 × 300 MiB files, the sizes
of the staging issue) is shared by the tests; each test stages into its own directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import time
import uuid

import pytest
from stage_data import (
    BIG_N,
    BIG_SIZE,
    SMALL_N,
    SMALL_SIZE,
    file_crcs,
    fm,
    kill9_when,
    make_dataset,
)

from fmstore import runtime
from fmstore.errors import ConfigError
from fmstore.stores import PutOptions, open_store
from fmstore.stores.base import PrefixStore
from fmstore.tiering.copy.transfer import CopyItem, TransferOptions, copy_items
from fmstore.tiering.staging.stage import (
    KeyFilter,
    compile_glob,
    in_shard,
    plan_stage,
    shard_from_env,
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("dataset"))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An isolated FMSTORE_HOME (state dir, default tiers) for in-process and CLI runs."""
    h = tmp_path / "home"
    monkeypatch.setenv("FMSTORE_HOME", str(h))
    monkeypatch.delenv("FMSTORE_CONFIG", raising=False)
    for var in ("SLURM_PROCID", "SLURM_NTASKS", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    from fmstore.config import set_config

    set_config(None)
    yield str(h)
    set_config(None)


def journal_files(home: str) -> list[str]:
    d = os.path.join(home, "state", "transfers")
    names = os.listdir(d) if os.path.isdir(d) else []
    return [os.path.join(d, f) for f in names if f.endswith(".jsonl")]


# ---- correctness, skip, dry run -----------------------------------------------------------


def test_small_files_are_copied_exactly_and_rerun_skips_them(dataset, tmp_path, home):
    dst = str(tmp_path / "dst")
    r = fm("stage", dataset["small"], dst, "--json", "--no-progress")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["files_copied"] == SMALL_N and s["files_failed"] == 0
    assert file_crcs(dst) == dataset["small_crcs"]
    # Every file records its checksum (xattr on POSIX) for cheap identity checks.
    meta = runtime.run(open_store(dst).stat("d07/f00007.bin")).metadata
    assert meta["fmstore-crc32c"] == f"{dataset['small_crcs']['d07/f00007.bin']:08x}"
    r = fm("stage", dataset["small"], dst, "--json", "--no-progress")
    s = json.loads(r.stdout)
    assert r.returncode == 0 and s["files_copied"] == 0 and s["files_skipped"] == SMALL_N
    assert s["bytes_copied"] == 0


def test_rerun_without_journal_skips_by_recorded_checksum_and_recopies_changed(
    dataset, tmp_path, home
):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"f{i}").write_bytes(os.urandom(1000))
    dst = str(tmp_path / "dst")
    assert fm("stage", str(src), dst, "--no-progress").returncode == 0
    for j in journal_files(home):
        os.unlink(j)  # another node, or a lost state dir: identity comes from the destination
    (src / "f3").write_bytes(os.urandom(1000))  # same size, new content
    r = fm("stage", str(src), dst, "--json", "--no-progress")
    s = json.loads(r.stdout)
    assert s["files_copied"] == 1 and s["files_skipped"] == 19
    assert file_crcs(dst) == file_crcs(str(src))


def test_big_files_copied_in_parts_and_verified(dataset, tmp_path, home):
    dst = str(tmp_path / "dst")
    r = fm(
        "stage", dataset["big"], dst, "--json", "--no-progress", "--verify", "--part-size", "16MiB"
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files_copied"] == BIG_N
    assert file_crcs(dst) == dataset["big_crcs"]
    assert not [f for f in os.listdir(dst) if f.startswith(".fmstore-tmp")]


def test_dry_run_changes_nothing(dataset, tmp_path, home):
    dst = tmp_path / "dst"
    r = fm("stage", dataset["small"], str(dst), "--dry-run", "--json", "--include", "d01/*")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert (
        plan["to_copy_files"] == SMALL_N // 50
        and plan["to_copy_bytes"] == SMALL_N // 50 * SMALL_SIZE
    )
    assert not dst.exists()
    # Nor a tier's directory (the embedded default: nvme under FMSTORE_HOME).
    r = fm("stage", dataset["small"], "nvme:ds", "--dry-run", "--include", "d01/*")
    assert r.returncode == 0 and not os.path.exists(os.path.join(home, "nvme"))
    dst.mkdir()
    (dst / "stale").write_bytes(b"x")
    r = fm(
        "stage",
        dataset["small"],
        str(dst),
        "--dry-run",
        "--delete",
        "--include",
        "d01/*",
        "--include",
        "stale",
    )
    assert r.returncode == 0 and "to delete: 1 file\n" in r.stdout
    assert os.listdir(dst) == ["stale"]
    assert journal_files(home) == []


def test_a_copy_edited_in_place_is_copied_again_and_can_be_staged_onward(tmp_path, home):
    """The checksum fmstore records with a file describes the bytes it wrote: once the
    file is written in place (same size, the journal gone: nothing but the file to go
    by), a re-run repairs it rather than skipping it, and staging it onward computes its
    checksum rather than failing on the recorded one."""
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    os.mkdir(a)
    with open(os.path.join(a, "cfg.json"), "w") as f:
        f.write('{"lr": 0.1}\n')
    assert fm("stage", a, b, "--no-progress").returncode == 0
    for j in journal_files(home):
        os.unlink(j)
    time.sleep(1.1)  # an edit made later than the copy (times are compared to the second)
    with open(os.path.join(b, "cfg.json"), "r+") as f:
        f.write('{"lr": 0.2}\n')
    r = fm("stage", b, c, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert open(os.path.join(c, "cfg.json")).read() == '{"lr": 0.2}\n'
    r = fm("stage", a, b, "--no-progress", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files_copied"] == 1
    assert open(os.path.join(b, "cfg.json")).read() == '{"lr": 0.1}\n'


# ---- delete semantics ---------------------------------------------------------------------


def test_delete_removes_only_extra_files_matching_the_filter(tmp_path, home):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "a").mkdir(parents=True)
    (src / "a" / "keep.txt").write_bytes(b"1")
    (dst / "a").mkdir(parents=True)
    (dst / "a" / "extra.txt").write_bytes(b"2")
    (dst / "other.log").write_bytes(b"3")  # outside --include: never deleted
    r = fm("stage", str(src), str(dst), "--delete", "--include", "*.txt", stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "without --yes" in r.stderr
    assert (dst / "a" / "extra.txt").exists()
    r = fm(
        "stage",
        str(src),
        str(dst),
        "--delete",
        "--include",
        "*.txt",
        "--yes",
        "--json",
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["deleted"] == 1
    assert sorted(file_crcs(str(dst))) == ["a/keep.txt", "other.log"]


# ---- shards -------------------------------------------------------------------------------


def test_shards_partition_the_keys_exactly_once(dataset, home):
    src = open_store(dataset["small"])
    dst = open_store(os.path.join(home, "empty"))
    seen: list[str] = []
    sizes = []
    for k in range(4):
        plan = runtime.run(plan_stage(src, dst, shard=(k, 4)))
        sizes.append(plan.files)
        seen += [i.src_key for i in plan.items]
    assert sorted(seen) == sorted(dataset["small_crcs"]) and len(seen) == len(set(seen))
    assert min(sizes) > SMALL_N // 4 * 0.9  # a stable hash spreads keys evenly
    slurm = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}
    assert shard_from_env({**slurm, "SLURM_STEP_ID": "0"}) == (2, 4)
    # The batch script itself (no srun step) sees the allocation's task count: all data.
    assert shard_from_env(slurm) is None
    assert shard_from_env({**slurm, "SLURM_STEP_ID": "batch"}) is None
    assert shard_from_env({"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2)
    assert shard_from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    assert all(in_shard(k, None) for k in seen[:10])


def test_cli_shards_from_rank_env_together_cover_the_source(tmp_path, home):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(60):
        (src / f"f{i:02d}").write_bytes(os.urandom(100))
    dst = tmp_path / "dst"
    copied = 0
    for rank in range(3):
        r = fm(
            "stage",
            str(src),
            str(dst),
            "--json",
            "--no-progress",
            env={"RANK": str(rank), "WORLD_SIZE": "3"},
        )
        assert r.returncode == 0, r.stderr
        assert f"shard {rank}/3" in r.stderr
        copied += json.loads(r.stdout)["files_copied"]
    assert copied == 60 and file_crcs(str(dst)) == file_crcs(str(src))


# ---- interrupt and resume -----------------------------------------------------------------


def _wait_for(pred, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def _journal_records(home: str) -> list[dict]:
    recs = []
    for j in journal_files(home):
        with open(j, "rb") as f:
            for line in f.read().split(b"\n"):
                with contextlib.suppress(ValueError):
                    recs.append(json.loads(line))
    return recs


def test_kill9_mid_big_files_resumes_without_rewriting_finished_parts(dataset, tmp_path, home):
    dst = tmp_path / "dst"
    args = ["stage", dataset["big"], str(dst), "--part-size", "8MiB", "--no-progress"]
    kill9_when(
        [*args, "--bwlimit", "60MiB/s", "--concurrency", "4"],  # ready at 4 s of 15
        lambda: sum(1 for r in _journal_records(home) if "p" in r) >= 30,
    )
    recs = _journal_records(home)
    parts_done = [r for r in recs if "p" in r]
    done_bytes = sum(r["n"] for r in parts_done)
    assert done_bytes < BIG_N * BIG_SIZE
    # Nothing half-written is visible under a final name.
    for name in os.listdir(dst):
        if not name.startswith(".fmstore"):
            assert file_crcs(str(dst))[name] == dataset["big_crcs"][name]
    # The parts were written without an fsync each and no sync ran before the kill: damage
    # one journaled part, as a power cut could; the rerun must check and rewrite it.
    victim = parts_done[0]
    token = next(r["t"] for r in recs if r.get("u") == victim["p"])
    with open(dst / token, "r+b") as f:
        f.seek(victim["i"] * (8 << 20))
        f.write(b"\0" * 4096)
    r = fm(*args, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["bytes_resumed"] >= done_bytes - victim["n"]
    assert s["bytes_copied"] <= BIG_N * BIG_SIZE - done_bytes + victim["n"]
    assert file_crcs(str(dst)) == dataset["big_crcs"]
    assert not [f for f in os.listdir(dst) if f.startswith(".fmstore-tmp")]


def test_a_write_that_cannot_be_resumed_leaves_no_temp_file(dataset, tmp_path, home):
    """Killed mid-file, then run again with another part size: the journaled parts do not
    fit, so the file is copied afresh, and the first run's temp file goes with it."""
    dst = tmp_path / "dst"
    args = ["stage", dataset["big"], str(dst), "--no-progress", "--include", "shard-0.bin"]
    kill9_when(
        [*args, "--part-size", "8MiB", "--bwlimit", "20MiB/s"],  # ready at 1 s of 15
        lambda: sum(1 for r in _journal_records(home) if "p" in r) >= 2,
    )
    assert [f for f in os.listdir(dst) if f.startswith(".fmstore-tmp")]
    r = fm(*args, "--part-size", "16MiB")
    assert r.returncode == 0, r.stderr
    assert file_crcs(str(dst)) == {"shard-0.bin": dataset["big_crcs"]["shard-0.bin"]}
    assert not [f for f in os.listdir(dst) if f.startswith(".fmstore-tmp")]


def test_kill9_mid_small_files_resumes_without_recopying_finished_files(dataset, tmp_path, home):
    dst = tmp_path / "dst"
    args = ["stage", dataset["small"], str(dst), "--include", "d0*/*", "--no-progress"]
    kill9_when(
        [*args, "--bwlimit", "512KiB/s"],  # ready at 1 s of 16
        lambda: sum(1 for r in _journal_records(home) if "f" in r) >= 100,
    )
    done = {r["f"] for r in _journal_records(home) if "f" in r}
    # No sync ran before the kill: zero one journaled file's bytes (size and recorded
    # checksum kept), as a power cut could; the rerun must read it, see it, copy it again.
    victim = sorted(done)[0]
    with open(dst / victim, "r+b") as f:
        f.write(b"\0" * SMALL_SIZE)
    done.discard(victim)
    inodes = {k: os.stat(dst / k).st_ino for k in done}
    r = fm(*args, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["files_skipped"] >= len(done)
    assert s["files_copied"] + s["files_skipped"] == 10 * (SMALL_N // 50)
    assert all(os.stat(dst / k).st_ino == ino for k, ino in inodes.items())  # not rewritten
    want = {k: v for k, v in dataset["small_crcs"].items() if k.startswith("d0")}
    assert file_crcs(str(dst)) == want


# ---- verification and failures ------------------------------------------------------------


def test_checksum_mismatch_with_recorded_source_checksum_fails_that_file_only(tmp_path, home):
    src = open_store(str(tmp_path / "src"))
    runtime.run(src.put("good", b"a" * 100))
    runtime.run(src.put("bad", b"b" * 100, PutOptions(metadata={"fmstore-crc32c": "deadbeef"})))
    r = fm("stage", str(tmp_path / "src"), str(tmp_path / "dst"), "--json", "--no-progress")
    assert r.returncode == 3
    s = json.loads(r.stdout)
    assert s["files_copied"] == 1 and [f["key"] for f in s["failures"]] == ["bad"]
    assert "checksum mismatch" in r.stderr and "FAILED bad" in r.stderr
    assert not (tmp_path / "dst" / "bad").exists()


def test_source_file_vanishing_after_planning_is_reported_and_others_copied(tmp_path, home):
    src = open_store(str(tmp_path / "src"))
    dst = open_store(str(tmp_path / "dst"))
    for i in range(10):
        runtime.run(src.put(f"f{i}", os.urandom(10)))
    plan = runtime.run(plan_stage(src, dst))
    runtime.run(src.delete("f4"))
    report = runtime.run(copy_items(src, dst, plan.items, TransferOptions(retries=0)))
    assert [f.key for f in report.failures] == ["f4"]
    assert report.progress.files_copied == 9


def test_posix_attributes_travel_in_fsx_convention(tmp_path, home):
    src = tmp_path / "src"
    src.mkdir()
    f = src / "script.sh"
    f.write_bytes(b"#!/bin/sh\n")
    os.chmod(f, 0o750)
    os.utime(f, ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    mem = f"memory://stage-{uuid.uuid4().hex}"
    assert fm("stage", str(src), str(tmp_path / "dst"), "--no-progress").returncode == 0
    st = os.stat(tmp_path / "dst" / "script.sh")
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_mtime_ns == 1_600_000_000_123_456_789
    meta = runtime.run(open_store(str(tmp_path / "dst")).stat("script.sh")).metadata
    assert meta["file-permissions"] == "0100750"
    assert meta["file-mtime"] == "1600000000123456789ns"
    assert meta["file-owner"] == str(os.getuid()) and meta["file-group"] == str(os.getgid())
    atime = meta["file-atime"]
    assert atime.endswith("ns") and st.st_atime_ns == int(atime[:-2])
    del mem


def test_fsx_times_without_ns_suffix_are_milliseconds(tmp_path):
    from fmstore.stores import posixmeta

    assert posixmeta.parse_time_ns("1600000000123ns") == 1600000000123
    assert posixmeta.parse_time_ns("1600000000123") == 1600000000123000000
    assert posixmeta.parse_time_ns("garbage") is None
    f = tmp_path / "f"
    f.write_bytes(b"x")
    posixmeta.apply(str(f), {"file-mtime": "1600000000500", "file-permissions": "0100600"})
    st = os.stat(f)
    assert st.st_mtime_ns == 1_600_000_000_500_000_000 and stat.S_IMODE(st.st_mode) == 0o600


def test_memory_store_round_trip(tmp_path, home):
    src = tmp_path / "src"
    (src / "x").mkdir(parents=True)
    for i in range(30):
        (src / "x" / f"{i}").write_bytes(os.urandom(i * 100))
    (src / "big").write_bytes(os.urandom(3 << 20))
    mem_url = f"memory://stage-{uuid.uuid4().hex}"

    async def go():
        s, m = open_store(str(src)), open_store(mem_url)
        plan = await plan_stage(s, m)
        opts = TransferOptions(part_size=1 << 20, multipart_threshold=1 << 20, verify=True)
        r1 = await copy_items(s, m, plan.items, opts)
        back = open_store(str(tmp_path / "back"))
        plan2 = await plan_stage(m, back)
        r2 = await copy_items(m, back, plan2.items, opts)
        return r1, r2

    r1, r2 = runtime.run(go())
    assert r1.ok and r2.ok and r1.progress.files_copied == 31
    assert file_crcs(str(tmp_path / "back")) == file_crcs(str(src))


# ---- bad input ----------------------------------------------------------------------------


def test_bad_input_gives_clear_errors_and_documented_exit_codes(tmp_path, home):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"1")
    r = fm("stage", str(tmp_path / "nope"), str(tmp_path / "d"))
    assert r.returncode == 1 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = fm("stage", str(src), str(src / "inner"))
    assert r.returncode == 1 and "inside source" in r.stderr
    assert not (src / "inner").exists()  # refused before anything was created
    r = fm("stage", str(src), str(src / "f"))
    assert r.returncode == 1 and "is a file, not a directory" in r.stderr
    r = fm("stage", str(src), str(src))
    assert r.returncode == 1 and "same location" in r.stderr
    r = fm("stage", str(src), str(tmp_path / "d"), "--include", "a[b")
    assert r.returncode == 2 and "malformed glob" in r.stderr
    r = fm("stage", str(src), "nosuchtier:x")
    assert r.returncode == 1 and "unknown tier 'nosuchtier'" in r.stderr
    r = fm("stage", str(src / "f"), str(tmp_path / "d"))
    assert r.returncode == 1 and "fmstore cp" in r.stderr
    r = fm("stage", str(src), str(tmp_path / "d"), "--shard", "3/2")
    assert r.returncode == 2 and "shard" in r.stderr
    r = fm("stage", str(src), str(tmp_path / "d"), "--bwlimit", "fast")
    assert r.returncode == 2 and "not a size" in r.stderr
    assert not (tmp_path / "d").exists()


def test_globs():
    assert compile_glob("*.txt").fullmatch("a/b/c.txt")
    assert not compile_glob("a/*.txt").fullmatch("a/b/c.txt")
    assert compile_glob("a/**/*.txt").fullmatch("a/b/c/d.txt")
    assert compile_glob("a/**/*.txt").fullmatch("a/d.txt")
    assert compile_glob("f[0-9]").fullmatch("x/f7") and not compile_glob("f[!0-9]").fullmatch("f7")
    for bad in ("a[b", "x]", "", "/abs", "[]"):
        with pytest.raises(ConfigError, match="malformed glob"):
            compile_glob(bad)
    f = KeyFilter.of(["*.bin"], ["skip/**"])
    assert (
        f("a/x.bin") and not f("skip/x.bin") and not f("a/x.txt") and not f(".fmstore-lazy.jsonl")
    )


def test_cp_du_rm(tmp_path, home):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a.bin").write_bytes(os.urandom(5000))
    (src / "b.bin").write_bytes(os.urandom(100))
    r = fm("cp", str(src / "d" / "a.bin"), str(tmp_path / "out") + "/")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "a.bin").read_bytes() == (src / "d" / "a.bin").read_bytes()
    r = fm("cp", str(src / "d" / "a.bin"), str(tmp_path / "out" / "a.bin"))
    assert r.returncode == 0 and "identical" in r.stderr
    r = fm("cp", str(src / "missing"), str(tmp_path / "out") + "/")
    assert r.returncode == 1 and "no such object" in r.stderr
    r = fm("du", str(src), "-b")
    assert r.returncode == 0 and "5100" in r.stdout and "d/" in r.stdout
    r = fm("rm", "-r", str(src / "d"), stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and (src / "d" / "a.bin").exists()
    r = fm("rm", "-r", str(src / "d"), "--yes")
    assert r.returncode == 0 and not (src / "d" / "a.bin").exists()
    r = fm("rm", str(src / "b.bin"), "-y")
    assert r.returncode == 0 and not (src / "b.bin").exists()


def test_du_and_rm_take_a_file_and_refuse_a_missing_directory(tmp_path, home):
    """``du FILE`` measures it and ``rm -r FILE`` deletes it, as du and rm do; a missing
    directory is an error, and nothing is created on the way."""
    (tmp_path / "f.bin").write_bytes(b"x" * 1234)
    r = fm("du", "-b", str(tmp_path / "f.bin"))
    assert r.returncode == 0 and "1234" in r.stdout
    r = fm("rm", "-r", str(tmp_path / "f.bin"), "-y")
    assert r.returncode == 0 and not (tmp_path / "f.bin").exists()
    for cmd in (["du"], ["rm", "-r", "-y"]):
        r = fm(*cmd, str(tmp_path / "typo"))
        assert r.returncode == 1 and "does not exist" in r.stderr, r.stderr
    assert not (tmp_path / "typo").exists()


def test_a_refused_delete_says_nothing_was_copied(tmp_path, home):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "new").write_bytes(b"1")
    (dst / "old").write_bytes(b"2")
    r = fm("stage", str(src), str(dst), "--delete", "--no-progress", stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "Nothing copied or deleted" in r.stderr
    assert sorted(os.listdir(dst)) == ["old"]


def test_stage_shows_confirm_the_plan_before_anything_changes(tmp_path, home):
    """The library's ``confirm`` sees the plan (what would be copied and deleted) before
    anything is; a no leaves the destination as it was, a yes (here an awaitable) runs
    the plan, counting into the caller's progress."""
    from fmstore.tiering.copy.transfer import TransferProgress
    from fmstore.tiering.staging.stage import StageOptions, stage

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "a").write_bytes(b"new a")
    (src / "b").write_bytes(b"b")
    (dst / "a").write_bytes(b"old")
    (dst / "old").write_bytes(b"2")
    plans = []

    def no(plan):
        plans.append(plan)
        return False

    res = stage(str(src), str(dst), StageOptions(delete=True), confirm=no)
    assert res.declined and res.plan is plans[0]
    assert [i.src_key for i in plans[0].items] == ["a", "b"] and plans[0].delete == ["old"]
    assert sorted(os.listdir(dst)) == ["a", "old"] and (dst / "a").read_bytes() == b"old"

    async def yes(plan):
        return True

    progress = TransferProgress()
    res = stage(str(src), str(dst), StageOptions(delete=True), progress=progress, confirm=yes)
    assert not res.declined and res.ok and res.deleted == 1
    assert res.report.progress is progress and progress.files_copied == 2
    assert file_crcs(str(dst)) == file_crcs(str(src))


def test_a_dry_run_of_the_library_plans_without_creating_the_destination(tmp_path, home):
    from fmstore.tiering.staging.stage import StageOptions, stage

    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"1")
    dst = tmp_path / "not" / "yet"
    res = stage(str(src), str(dst), StageOptions(dry_run=True), confirm=lambda plan: 1 / 0)
    assert res.plan is not None and [i.src_key for i in res.plan.to_copy()] == ["a"]
    assert not (tmp_path / "not").exists()


def test_a_file_name_that_is_not_utf8_is_a_clear_error(tmp_path, home):
    src = tmp_path / "src"
    src.mkdir()
    with open(os.path.join(os.fsencode(src), b"lat\xe9.txt"), "wb") as f:
        f.write(b"x")
    for cmd in (["stage", str(src), str(tmp_path / "d"), "--no-progress"], ["ls", str(src)]):
        r = fm(*cmd)
        assert r.returncode == 1, r.stderr
        assert "not valid UTF-8" in r.stderr and "Traceback" not in r.stderr


# ---- durability: one sync per batch -------------------------------------------------------


def test_journal_knows_which_records_a_completed_sync_covers(tmp_path):
    from fmstore.tiering.copy.journal import Journal

    path = str(tmp_path / "j.jsonl")
    syncs = []

    async def sync():
        syncs.append(1)

    async def write():
        j = await Journal.open(path)
        j.file_done("a", 1, "v1", 1, None)
        await j.parts_started("big", "tok", "v", 8)
        await j.part_done("big", "tok", 0, 7, 8)
        await j.synced(sync)
        j.file_done("b", 1, "v1", 2, None)
        await j.part_done("big", "tok", 1, 9, 8)
        await j.close()

    runtime.run(write())
    assert syncs == [1]
    j = runtime.run(Journal.open(path))
    assert j.files["a"].synced and not j.files["b"].synced
    assert j.pending["big"].parts.keys() == {0, 1} and j.pending["big"].unsynced == {1}
    # Compaction keeps the distinction.
    j._compact()
    runtime.run(j.close())
    j = runtime.run(Journal.open(path))
    assert j.files["a"].synced and not j.files["b"].synced
    assert j.pending["big"].unsynced == {1}
    runtime.run(j.close())


def test_a_finished_run_syncs_once_and_leaves_every_record_synced(tmp_path, home):
    from fmstore.tiering.copy.journal import Journal

    src = tmp_path / "src"
    src.mkdir()
    for i in range(50):
        (src / f"f{i}").write_bytes(os.urandom(100))
    dst = str(tmp_path / "dst")
    assert fm("stage", str(src), dst, "--no-progress").returncode == 0
    recs = _journal_records(home)
    assert [r for r in recs if "y" in r], "the run must end with a completed sync"
    (path,) = journal_files(home)
    j = runtime.run(Journal.open(path))
    assert len(j.files) == 50 and all(r.synced for r in j.files.values())
    runtime.run(j.close())


def test_journals_no_run_used_for_a_month_are_removed_once_a_day(tmp_path, home):
    """Journals stay after a run (re-runs skip finished files on their word), one per
    source and destination; those unused for 30 days go, checked at most once a day, and
    a journal in use is never removed, however old."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"x" * 100)
    src, dst = str(src), str(tmp_path / "dst")
    assert fm("stage", src, dst, "--no-progress").returncode == 0
    (mine,) = journal_files(home)
    tdir = os.path.dirname(mine)
    day, now = 86400, time.time()

    def journal(name: str, age_days: float) -> str:
        path = os.path.join(tdir, name)
        with open(path, "w") as f:
            f.write('{"f":"k","s":1,"v":null,"c":null,"d":null}\n')
        os.utime(path, (now - age_days * day,) * 2)
        return path

    def age(path: str, days: float) -> None:
        os.utime(path, (now - days * day,) * 2)

    old, recent = journal("old.jsonl", 40), journal("recent.jsonl", 10)
    age(mine, 40)
    # The first run left the day's mark: nothing is removed yet, and the run's own journal
    # is marked as used.
    r = fm("stage", src, dst, "--no-progress", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["files_skipped"] == 1
    assert os.path.exists(old) and time.time() - os.stat(mine).st_mtime < day
    # A day later, the next opening of any journal removes what is a month old.
    age(os.path.join(tdir, ".pruned"), 2)
    age(mine, 40)
    assert fm("stage", src, dst, "--no-progress").returncode == 0
    assert sorted(journal_files(home)) == sorted([mine, recent])


def test_journal_housekeeping_never_fails_a_run(tmp_path):
    """What cannot be removed (here a directory where a journal would be; in a shared
    state directory, another user's journal) is left, and the journal still opens."""
    from fmstore.tiering.copy.journal import Journal, prune

    old = time.time() - 40 * 86400
    stuck, gone = tmp_path / "stuck.jsonl", tmp_path / "gone.jsonl"
    stuck.mkdir()
    gone.write_text("")
    for p in (stuck, gone):
        os.utime(p, (old, old))
    j = runtime.run(Journal.open(str(tmp_path / "mine.jsonl")))
    runtime.run(j.close())
    assert stuck.is_dir() and not gone.exists()
    assert prune(str(tmp_path)) == 0  # once a day
    assert prune(str(tmp_path / "missing")) == 0


def test_a_file_changing_while_copied_is_copied_again_and_counted_once(tmp_path):
    """The source grows while its parts are read: the copy notices (its version changed),
    drops what it wrote and copies the file again, and the bytes it reports copied are the
    file's, not the file's plus the abandoned attempt's."""
    from fmstore.stores.posix import PosixStore

    class GrowsOnce(PosixStore):
        grown = False

        async def get_into(self, key, start, out):
            await super().get_into(key, start, out)
            if not GrowsOnce.grown:
                GrowsOnce.grown = True
                with open(os.path.join(self.root, key), "ab") as f:
                    f.write(b"z" * (1 << 20))

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.bin").write_bytes(os.urandom(12 << 20))
    src, dst = GrowsOnce(str(tmp_path / "src")), open_store(str(tmp_path / "dst"))
    item = CopyItem("big.bin", "big.bin", 12 << 20, None, None)
    opts = TransferOptions(part_size=4 << 20, multipart_threshold=8 << 20)
    report = runtime.run(copy_items(src, dst, [item], opts))
    assert report.ok, report.failures
    assert GrowsOnce.grown
    assert (tmp_path / "dst" / "big.bin").read_bytes() == (
        tmp_path / "src" / "big.bin"
    ).read_bytes()
    assert report.progress.bytes_copied == 13 << 20


def test_crc_combine_equals_the_crc_of_the_concatenation():
    import random

    from fmstore.stores.crc import combine, combine_all, crc32c

    rng = random.Random(7)
    for _ in range(100):
        a, b = rng.randbytes(rng.randint(0, 5000)), rng.randbytes(rng.randint(0, 5000))
        assert combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    parts = [rng.randbytes(rng.choice([0, 1, 4096, 10_000])) for _ in range(12)]
    assert combine_all((crc32c(p), len(p)) for p in parts) == crc32c(b"".join(parts))


class _RewrittenAfterRead(PrefixStore):
    """A local tier whose file someone rewrites (same size) right after fmstore read it."""

    def __init__(self, inner, rewrite) -> None:
        super().__init__(inner, "")
        self.rewrite = rewrite

    async def get_into(self, key, start, out):
        await super().get_into(key, start, out)
        if self.rewrite is not None and key == "b.bin":
            self.rewrite, rewrite = None, self.rewrite
            rewrite()


def test_local_files_read_whole_into_reused_buffers(tmp_path):
    """Local files of 1 MiB and more copied whole are read into buffers reused from one
    file to the next: a smaller file after a bigger one gets its own bytes only, and a
    file rewritten while it was read is copied again (the version read is not published
    with the checksum of another)."""
    src = tmp_path / "src"
    src.mkdir()
    bodies = {n: os.urandom(size) for n, size in (("a.bin", 3 << 20), ("b.bin", (1 << 20) + 7))}
    bodies["c.bin"] = os.urandom(2 << 20)
    for n, b in bodies.items():
        (src / n).write_bytes(b)
    new_b = os.urandom(len(bodies["b.bin"]))

    def rewrite() -> None:
        with open(src / "b.bin", "r+b") as f:
            f.write(new_b)
        st = os.stat(src / "b.bin")
        os.utime(src / "b.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))

    s = _RewrittenAfterRead(open_store(str(src)), rewrite)
    d = open_store(f"memory://reuse-{uuid.uuid4().hex}")
    items = [CopyItem(n, n, len(b)) for n, b in sorted(bodies.items())]
    opts = TransferOptions(concurrency=1, multipart_threshold=64 << 20)
    report = runtime.run(copy_items(s, d, items, opts))
    assert report.ok and report.progress.files_copied == 3
    assert runtime.run(d.get("a.bin")) == bodies["a.bin"]
    assert runtime.run(d.get("b.bin")) == new_b
    assert runtime.run(d.get("c.bin")) == bodies["c.bin"]
