"""FSx-convention metadata on S3 objects is hostile input: staged to a POSIX directory it
never makes a setuid, setgid, sticky or world-writable file, changes ownership only on the
operator's word (``--preserve-owner``, ``[stage] preserve_owner``) and ignores absurd
times.  Objects are written with boto3 straight into a real SeaweedFS bucket."""

from __future__ import annotations

import os
import stat

import pytest
from stage_data import fm

pytestmark = pytest.mark.s3

BIG = 9 << 20  # over 8 MiB: from S3 to a local file it goes through the part writer


def _put(s3_server, bucket: str, key: str, meta: dict[str, str], size: int = 100) -> None:
    s3_server.boto3_client().put_object(
        Bucket=bucket, Key=f"ds/{key}", Body=b"x" * size, Metadata=meta
    )


@pytest.fixture
def env(s3_server, s3_bucket, tmp_path):
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f"""
[tiers.s3]
url = "s3://{s3_bucket}/ds"
endpoint_url = "{s3_server.endpoint_url}"
addressing_style = "path"
region = "us-east-1"
"""
    )
    for var in ("SLURM_PROCID", "SLURM_NTASKS", "RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    return {
        "FMSTORE_CONFIG": str(cfg),
        "FMSTORE_HOME": str(tmp_path / "home"),
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
    }


def _hostile(s3_server, bucket: str) -> None:
    owner = {"file-owner": "12345", "file-group": "23456"}
    _put(s3_server, bucket, "suid", {"file-permissions": "0104755", **owner})
    _put(s3_server, bucket, "sgid-root", {"file-permissions": "0102755", "file-owner": "0"})
    _put(s3_server, bucket, "sticky-ww", {"file-permissions": "0101777"})
    _put(s3_server, bucket, "ww", {"file-permissions": "0100666"})
    _put(s3_server, bucket, "junk-mode", {"file-permissions": "0_7_7_7"})
    _put(s3_server, bucket, "big-suid", {"file-permissions": "0106755", **owner}, BIG)
    _put(s3_server, bucket, "neg-time", {"file-mtime": "-5000ns", "file-atime": "-1"})
    _put(s3_server, bucket, "nan-time", {"file-mtime": "NaN"})
    _put(s3_server, bucket, "inf-time", {"file-mtime": "Infinity"})
    _put(s3_server, bucket, "far-time", {"file-mtime": "99999999999999999999ns"})
    _put(s3_server, bucket, "y3000", {"file-mtime": "32503680000000"})  # ms: year 3000
    _put(s3_server, bucket, "ok-time", {"file-mtime": "1600000000123456789ns"})


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_staged_files_never_get_special_bits_foreign_owner_or_absurd_times(
    s3_server, s3_bucket, env, tmp_path
):
    _hostile(s3_server, s3_bucket)
    out = tmp_path / "out"
    r = fm("stage", "s3:", str(out), "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    assert _mode(out / "suid") == 0o755
    assert _mode(out / "sgid-root") == 0o755
    assert _mode(out / "big-suid") == 0o755
    assert _mode(out / "sticky-ww") == 0o775
    assert _mode(out / "ww") == 0o664
    assert _mode(out / "junk-mode") == 0o644  # malformed: left at the default
    me = os.getuid(), os.getgid()
    for name in ("suid", "big-suid"):
        st = os.stat(out / name)
        assert (st.st_uid, st.st_gid) == me  # no opt-in: ownership untouched
    for name in ("neg-time", "nan-time", "inf-time", "far-time", "y3000"):
        st = os.stat(out / name)
        assert 0 < st.st_mtime_ns < (1 << 63) and st.st_atime_ns > 0, name
    assert os.stat(out / "ok-time").st_mtime_ns == 1_600_000_000_123_456_789


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_preserve_owner_by_flag_or_config_restores_owner_but_never_special_bits(
    s3_server, s3_bucket, env, tmp_path
):
    _hostile(s3_server, s3_bucket)
    out = tmp_path / "flag"
    r = fm("stage", "s3:", str(out), "--no-progress", "--preserve-owner", env=env)
    assert r.returncode == 0, r.stderr
    for name in ("suid", "big-suid"):
        st = os.stat(out / name)
        assert (st.st_uid, st.st_gid) == (12345, 23456)
        assert stat.S_IMODE(st.st_mode) == 0o755
    assert os.stat(out / "sgid-root").st_uid == 0 and _mode(out / "sgid-root") == 0o755

    one = tmp_path / "cp-one"
    r = fm("cp", "s3:suid", str(one), "--preserve-owner", env=env)
    assert r.returncode == 0, r.stderr
    assert os.stat(one).st_uid == 12345 and _mode(one) == 0o755
    two = tmp_path / "cp-two"
    r = fm("cp", "s3:suid", str(two), env=env)
    assert r.returncode == 0, r.stderr
    assert os.stat(two).st_uid == os.getuid() and _mode(two) == 0o755

    cfg = env["FMSTORE_CONFIG"]
    with open(cfg, "a") as f:
        f.write("\n[stage]\npreserve_owner = true\n")
    out2 = tmp_path / "config"
    r = fm("stage", "s3:", str(out2), "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    assert os.stat(out2 / "suid").st_uid == 12345 and _mode(out2 / "suid") == 0o755
    out3 = tmp_path / "overridden"
    r = fm("stage", "s3:", str(out3), "--no-progress", "--no-preserve-owner", env=env)
    assert r.returncode == 0, r.stderr
    assert os.stat(out3 / "suid").st_uid == os.getuid()


def test_stage_section_is_validated(env, tmp_path):
    cfg = env["FMSTORE_CONFIG"]
    with open(cfg, "a") as f:
        f.write('\n[stage]\npreserve_owner = "yes"\n')
    r = fm("stage", "s3:", str(tmp_path / "x"), "--no-progress", env=env)
    assert r.returncode != 0
    assert "preserve_owner must be true or false" in r.stderr
