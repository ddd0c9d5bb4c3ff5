"""Records, manifests and leases are read bounded, and a lease cannot be immortal: a record
over its limit is refused before it is read, gc meets sparse gigabyte leases and manifests
in bounded memory, a lease renewed at no real time is dead, and a generation behind an
immortal lease (or one naming a huge pid) is still collected."""

from __future__ import annotations

import time

import pytest
from hostile_helpers import run_limited

from fmstore import runtime
from fmstore.errors import ConfigError, CorruptData, NotFound
from fmstore.stores import open_store


def test_read_bounded_refuses_before_reading(tmp_path, monkeypatch):
    from fmstore.stores.bounded import RECORD_LIMIT, manifest_limit, read_bounded

    store = open_store(str(tmp_path))
    (tmp_path / "small.json").write_bytes(b'{"a":1}')
    with open(tmp_path / "big.json", "wb") as f:
        f.truncate(RECORD_LIMIT + 1)  # sparse: no disk used
    assert runtime.run(read_bounded(store, "small.json", 7)) == b'{"a":1}'
    with pytest.raises(CorruptData, match=r"part record .*big.json is 4194305 bytes, more than"):
        runtime.run(read_bounded(store, "big.json", RECORD_LIMIT, what="part record"))
    with pytest.raises(NotFound):
        runtime.run(read_bounded(store, "absent.json", RECORD_LIMIT))
    assert manifest_limit() > 600_000_000  # a 70B model's manifest on 1,024 ranks
    monkeypatch.setenv("FMSTORE_MAX_MANIFEST_BYTES", "1000")
    assert manifest_limit() == 1000
    monkeypatch.setenv("FMSTORE_MAX_MANIFEST_BYTES", "lots")
    with pytest.raises(ConfigError, match="FMSTORE_MAX_MANIFEST_BYTES"):
        manifest_limit()


def test_gc_meets_sparse_gigabyte_lease_and_manifest_in_bounded_memory(tmp_path):
    gen = tmp_path / "step_00000001" / "g000000000001-deadbeef"
    gen.mkdir(parents=True)
    (gen / "000000.bin").write_bytes(b"x" * 10)
    with open(gen / "export-n1.json", "wb") as f:
        f.truncate(3 << 29)  # 1.5 GiB, no disk used
    (tmp_path / "other").mkdir()
    with open(tmp_path / "other" / "manifest.json", "wb") as f:
        f.truncate(3 << 29)
    res = run_limited(
        f"""
        os.environ["FMSTORE_MAX_MANIFEST_BYTES"] = str(64 << 20)
        from fmstore.checkpoint.gc import gc
        def go():
            rep = gc({str(tmp_path)!r}, dry_run=True, older_than=0)
            # the unreadable lease counts as alive, the unreadable manifest keeps its prefix
            assert rep.exporting == ["step_00000001/g000000000001-deadbeef"], rep
            assert rep.unreadable == ["other"], rep
        report(go)
        """
    )
    assert res == [{"error": None}], res


def _lease_doc(node: str, pid: object, renewed: str) -> bytes:
    return (
        f'{{"format":"fmstore-export-lease","version":1,"node":"{node}","pid":{pid},'
        f'"renewed":{renewed}}}'
    ).encode()


@pytest.mark.parametrize("renewed", ["Infinity", "NaN", "1e300", "1e400", "-Infinity", "FUTURE"])
def test_lease_renewed_at_no_real_time_is_dead(renewed):
    from fmstore.protocol.env import Env
    from fmstore.protocol.records import ExportLease

    env, now = Env(), time.time()
    far = str(now + 100 * env.lease_ttl)
    doc = _lease_doc("elsewhere", 1, far if renewed == "FUTURE" else renewed)
    assert not ExportLease.loads(doc, where="x").alive(env, now)
    # another node's clock a little ahead is still a renewal
    assert ExportLease.loads(_lease_doc("elsewhere", 1, str(now + 5)), where="x").alive(env, now)


def test_gc_removes_an_immortal_lease_generation_and_survives_a_huge_pid(tmp_path, monkeypatch):
    from fmstore.checkpoint.gc import gc

    monkeypatch.setenv("FMSTORE_NODE_ID", "n-here")
    for name, doc in {
        "g000000000001-00000001": _lease_doc("elsewhere", 1, "Infinity"),
        "g000000000002-00000002": _lease_doc("n-here", 10**23, str(time.time())),
    }.items():
        gen = tmp_path / "step_00000001" / name
        gen.mkdir(parents=True)
        (gen / "000000.bin").write_bytes(b"x" * 10)
        (gen / "export-n1.json").write_bytes(doc)
    rep = gc(str(tmp_path), dry_run=True, older_than=0)
    # the pid no process has: malformed, alive only while its file is younger than a lease
    assert rep.exporting == ["step_00000001/g000000000002-00000002"], rep
    assert "step_00000001/g000000000001-00000001/000000.bin" in rep.removed, rep
