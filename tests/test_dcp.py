"""Multi-rank checkpoints through torch.distributed.checkpoint with fmstore's Writer/Reader.

One ``torchrun --nproc_per_node=2`` launch (gloo, CPU) covers the sharded scenarios
(tests/dcp_worker.py), DCP's save-plan caching among them, and ends with a rank killed
mid-save; everything a single process can check runs here directly.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from sharded_support import equal_trees
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from fmstore import runtime
from fmstore.checkpoint.dcp import Reader, Stager, Writer, async_save, read_manifest
from fmstore.checkpoint.dcp.api import (
    inspect_checkpoint,
    is_dcp_checkpoint,
    load_full_state_dict,
    verify_checkpoint,
)
from fmstore.checkpoint.gc import gc
from fmstore.errors import AlreadyExists, CorruptData, NotFound
from fmstore.stores import open_store
from fmstore.testing import torchrun as launcher

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dcp_worker.py")


def torchrun(scenario: str, out: str, roots: list[str], env: dict[str, str], timeout: float) -> int:
    """The exit status of ``scenario`` on 2 ranks, its output in ``out/launch.log``."""
    cmd = launcher.command(WORKER, [scenario, out, *roots], nproc=2)
    full_env = {**os.environ, **env, "DCP_WORKER_HANG_DUMP": str(int(timeout - 10))}
    return launcher.run(cmd, timeout=timeout, log=os.path.join(out, "launch.log"), env=full_env)


# ---- the 2-rank launch -----------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, s3_server):
    """One torchrun launch running every sharded scenario on POSIX and on S3, then the
    kill scenario (which ends the launch: its exit status is the kill test's)."""
    base = tmp_path_factory.mktemp("dcp")
    out = base / "out"
    out.mkdir()
    bucket = s3_server.create_bucket()
    roots = [str(base / "root"), f"s3://{bucket}/run"]
    env = {"FMSTORE_TEST_S3_OPTIONS": json.dumps(s3_server.store_options())}
    rc = torchrun("main,kill", str(out), roots, env, timeout=420)
    log = (out / "launch.log").read_text()
    # Every rank got through main (each marks it past the barrier that follows it).
    assert all((out / f"main-done-{r}").exists() for r in (0, 1)), log[-6000:]
    report = json.loads((out / "main.json").read_text())
    yield {
        "out": str(out), "roots": roots, "report": report, "s3": s3_server.store_options(),
        "rc": rc, "log": log,
    }  # fmt: skip
    s3_server.delete_bucket(bucket)


def _so(sharded: dict[str, Any], root: str) -> dict[str, Any]:
    return sharded["s3"] if root.startswith("s3://") else {}


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["posix", "s3"])
def test_sharded_saves_load_back_bit_exact_on_two_ranks(sharded, which):
    # The worker asserts bit-exactness of 2->2, 1->2 and both async_save kinds itself;
    # it only writes its report when every assertion held.
    rep = sharded["report"][sharded["roots"][which]]
    assert rep["changed"], "training did not change the weights during async_save"
    assert rep["reused"], "the stager allocated new buffers for the second save"


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["posix", "s3"])
def test_two_rank_checkpoint_loads_resharded_on_one_rank(sharded, which):
    root = sharded["roots"][which]
    so = _so(sharded, root)
    ref = torch.load(os.path.join(sharded["out"], f"ref-{which}.pt"), weights_only=False)
    m = runtime.run(read_manifest(open_store(f"{root}/a", **so)))
    assert m.world_size == 2
    # Into plain full-size tensors: each rank's shard lands in a slice of the target.
    target = {
        "model": {k: torch.zeros_like(v) for k, v in ref["model"].items()},
        "optim": {
            "state": {
                p: {k: torch.zeros_like(v) for k, v in st.items()}
                for p, st in ref["optim"]["state"].items()
            },
            "param_groups": ref["optim"]["param_groups"],
        },
    }
    dcp.load(target, storage_reader=Reader(f"{root}/a", store_options=so), no_dist=True)
    equal_trees(target["model"], ref["model"])
    equal_trees(target["optim"]["state"], ref["optim"]["state"])
    # And whole, without a template (what convert uses).
    full = load_full_state_dict(f"{root}/a", **so)
    equal_trees(full["model"], ref["model"])
    equal_trees(full["optim"], ref["optim"])


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["posix", "s3"])
def test_rank_failing_mid_save_commits_nothing(sharded, which):
    root = sharded["roots"][which]
    rep = sharded["report"][root]
    assert rep["fail_error"] and "injected write failure" in rep["fail_error"]
    store = open_store(f"{root}/fail", **_so(sharded, root))
    keys = runtime.run(store.list_keys(""))
    assert "manifest.json" not in keys
    assert not is_dcp_checkpoint(f"{root}/fail", **_so(sharded, root))


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["posix", "s3"])
def test_plan_caching_saves_load_back_bit_exact(sharded, which):
    # The worker compared every one of these saves bit-exact after loading it back; what
    # rank 0 sent says the cached plan was used where the structure had not changed.
    sent = sharded["report"][sharded["roots"][which]]["plan_cache"]["sent"]
    assert sent["first"] is True
    assert sent["steady"] is False and sent["async"] is False
    assert sent["changed"] is True  # a value added: the plan is sent again
    assert sent["alternating"] == [True] * 4  # two structures in turn: never a stale plan
    # A dtype changed: DCP's comparison (names, offsets, sizes) kept the cached plan, and
    # the save still wrote the new dtype (the worker loaded it back bit-exact).
    assert sent["dtype"] is False


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["posix", "s3"])
def test_plan_caching_rank_skipping_an_item_commits_nothing(sharded, which):
    root = sharded["roots"][which]
    rep = sharded["report"][root]["plan_cache"]
    assert rep["sent"]["skip"] is False  # the cached plan was in force
    assert rep["skip_error"] and "rank 1 did not write 1 item(s) of its plan" in rep["skip_error"]
    assert not is_dcp_checkpoint(f"{root}/pc-skip", **_so(sharded, root))


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["posix", "s3"])
def test_plan_caching_out_of_step_coordinator_writes_nothing(sharded, which):
    root = sharded["roots"][which]
    first, failed, after = sharded["report"][root]["plan_cache"]["out_of_step"]
    assert first is None
    assert failed and "already committed" in failed
    assert after and "the coordinator's planner cached another plan" in after
    assert not runtime.run(open_store(f"{root}/pc-s2", **_so(sharded, root)).list_keys(""))


@pytest.mark.slow
def test_rank_killed_mid_save_leaves_previous_checkpoint_loadable(sharded):
    # The same launch as the scenarios above, killed in its last one.
    out, root = Path(sharded["out"]), Path(sharded["roots"][0]) / "kill"
    rc, log = sharded["rc"], sharded["log"]
    assert rc != 0 and "SIGKILL" in log, log[-4000:]
    assert (out / "kill-started").exists(), log[-4000:]
    assert not (out / "kill.json").exists(), log[-4000:]  # the kill ended the launch
    ref = torch.load(out / "ref-kill.pt", weights_only=False)
    m = runtime.run(read_manifest(open_store(str(root / "k"))))
    # The interrupted save left a generation that no manifest names ...
    gens = sorted(p.name for p in (root / "k").iterdir() if p.is_dir())
    assert len(gens) == 2 and m.generation in gens
    # ... the committed checkpoint still loads bit-exact ...
    full = load_full_state_dict(str(root / "k"))
    equal_trees(full["model"], ref["model"])
    equal_trees(full["optim"], ref["optim"])
    # ... and gc removes only the leftover.
    rep = gc(str(root), older_than=0)
    assert rep.checkpoints == ["k"]
    assert rep.removed and all(m.generation not in k for k in rep.removed)
    left = runtime.run(open_store(str(root / "k")).list_keys(""))
    assert left and all(k == "manifest.json" or k.startswith(m.generation + "/") for k in left)


# ---- single process ---------------------------------------------------------------------


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 500, generator=g),
        "bf": torch.randn(4096, generator=g).bfloat16(),
        "i": torch.arange(1000, dtype=torch.int32),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "meta": {"step": 7, "name": "run-1", "lrs": [0.1, 0.01]},
    }


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    out = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out["meta"] = {"step": 0, "name": "", "lrs": []}
    return out


def _save(sd: dict[str, Any], uri: str, **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=Writer(uri, **kw), no_dist=True)


def _load(sd: dict[str, Any], uri: str, **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=Reader(uri, **kw), no_dist=True)


@pytest.mark.parametrize("compression", ["none", "auto", "zstd"])
def test_round_trip_every_codec_bit_exact(tmp_path, compression):
    sd = _state()
    _save(sd, str(tmp_path / "c"), compression=compression, chunk_size=64 << 10)
    out = _zeros_like(sd)
    _load(out, str(tmp_path / "c"), direct_min=4096)
    equal_trees(out, sd)
    m, rows = inspect_checkpoint(str(tmp_path / "c"))
    codecs = {c for r in rows for c in r.codecs}
    assert codecs == {"raw"} if compression == "none" else codecs - {"raw"}


def test_large_raw_items_are_blobs_of_their_own(tmp_path):
    """Raw items of at least direct_min bytes get one blob each (written from the tensor's
    memory); the rest share packed blobs; everything loads bit-exact."""
    uri = str(tmp_path / "own")
    sd = _state()
    _save(sd, uri, chunk_size=64 << 10, direct_min=8192, streams=2)
    m = runtime.run(read_manifest(open_store(uri)))
    users: dict[int, list[str]] = {}
    for it in m.items:
        for b in {c.blob for c in it.chunks}:
            users.setdefault(b, []).append(it.fqn)
    own = {it.fqn for it in m.items if it.kind == "tensor" and it.nbytes >= 8192}
    assert own == {"w", "bf"}
    for it in m.items:
        blobs = {c.blob for c in it.chunks}
        if it.fqn in own:
            (b,) = blobs
            assert users[b] == [it.fqn] and m.blobs[b].size == it.nbytes
            assert len(it.chunks) == -(-it.nbytes // (64 << 10))
    out = _zeros_like(sd)
    _load(out, uri)
    equal_trees(out, sd)
    assert verify_checkpoint(uri).ok


def test_round_trip_on_memory_store():
    uri = "memory://dcp-test/round-trip"
    sd = _state(1)
    _save(sd, uri, streams=2)
    out = _zeros_like(sd)
    _load(out, uri)
    equal_trees(out, sd)


@pytest.mark.parametrize("direct_min", [4096, 1 << 30], ids=["own-blob", "packed"])
def test_partial_box_reads_fetch_only_needed_chunks(tmp_path, direct_min):
    """A read of a sub-box (here a non-contiguous one) of a saved tensor."""
    uri = str(tmp_path / "box")
    w = torch.arange(64 * 1000, dtype=torch.float32).reshape(64, 1000)
    _save({"w": w}, uri, chunk_size=16 << 10, direct_min=direct_min)
    reader = Reader(uri)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    dest = {"w": torch.zeros(10, 7)}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(dest, md, True)
    req = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w", (0, 0)),
        dest_offsets=torch.Size((0, 0)),
        storage_index=MetadataIndex("w", (0, 0)),
        storage_offsets=torch.Size((40, 300)),
        lengths=torch.Size((10, 7)),
    )
    store = reader.store
    gets: list[tuple[int, int]] = []
    orig = store.get_range

    async def spy(key: str, start: int, end: int | None = None) -> bytes:
        gets.append((start, end or 0))
        return await orig(key, start, end)

    store.get_range = spy  # type: ignore[method-assign]
    reader.read_data(LoadPlan([req]), planner).wait()
    assert torch.equal(dest["w"], w[40:50, 300:307])
    fetched = sum(e - s for s, e in gets)
    assert 0 < fetched < w.numel() * 4 // 2  # a slice of the tensor, not all of it


@pytest.mark.parametrize("direct_min", [4096, 1 << 30], ids=["own-blob", "packed"])
def test_corrupt_chunk_is_named_on_load_and_by_verify(tmp_path, direct_min):
    """direct_min (both sides): "own-blob" reads runs of chunks straight into the tensor."""
    uri = str(tmp_path / "bad")
    sd = _state()
    _save(sd, uri, chunk_size=64 << 10, direct_min=direct_min)
    m = runtime.run(read_manifest(open_store(uri)))
    item = next(i for i in m.items if i.fqn == "w")
    c = item.chunks[3]
    path = tmp_path / "bad" / m.blob_key(c.blob)
    data = bytearray(path.read_bytes())
    data[c.offset + 100] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(BaseException) as ei:  # DCP wraps rank errors in CheckpointException
        _load(_zeros_like(sd), uri, direct_min=direct_min)
    msg = str(ei.value)
    assert "CorruptData" in msg and "corrupt chunk of 'w'" in msg and m.blob_key(c.blob) in msg
    # Straight through the Reader (no DCP wrapping) it is a CorruptData.
    reader = Reader(uri, direct_min=direct_min)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    target = _zeros_like(sd)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(target, md, True)
    with pytest.raises(CorruptData):
        reader.read_data(planner.create_local_plan(), planner).wait()
    res = verify_checkpoint(uri)
    assert not res.ok and len(res.bad) == 1 and res.bad[0].tensor == "w"


def test_existing_checkpoint_is_kept_unless_overwrite(tmp_path):
    uri = str(tmp_path / "ow")
    a, b = _state(1), _state(2)
    _save(a, uri)
    with pytest.raises(BaseException) as ei:  # DCP wraps it in a CheckpointException
        _save(b, uri)
    assert "AlreadyExists" in repr(ei.value) or isinstance(ei.value, AlreadyExists)
    out = _zeros_like(a)
    _load(out, uri)
    equal_trees(out, a)
    old = runtime.run(read_manifest(open_store(uri))).generation
    _save(b, uri, overwrite=True)
    out = _zeros_like(b)
    _load(out, uri)
    equal_trees(out, b)
    # The superseded generation is gone.
    assert not (tmp_path / "ow" / old).exists()


def test_missing_checkpoint_is_not_found_and_creates_nothing(tmp_path):
    with pytest.raises(BaseException) as ei:
        _load(_zeros_like(_state()), str(tmp_path / "nothing"))
    assert "no checkpoint" in str(ei.value) or isinstance(ei.value, NotFound)
    assert not (tmp_path / "nothing").exists()


def test_async_save_keeps_values_of_the_moment_and_reuses_buffers(tmp_path):
    sd = _state()
    snap = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    stager = Stager()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fut = async_save(sd, Writer(str(tmp_path / "a1")), stager=stager, no_dist=True)
        sd["w"].add_(1.0)  # training goes on
        sd["meta"]["step"] = 8
        fut.result()
        size = stager.staged_bytes
        fut = async_save(sd, Writer(str(tmp_path / "a2")), stager=stager, no_dist=True)
        fut.result()
    assert stager.staged_bytes == size
    out = _zeros_like(sd)
    _load(out, str(tmp_path / "a1"))
    for k, v in snap.items():
        assert torch.equal(out[k], v), k
    assert out["meta"]["step"] == 7
    out = _zeros_like(sd)
    _load(out, str(tmp_path / "a2"))
    assert torch.equal(out["w"], sd["w"]) and out["meta"]["step"] == 8


def test_cli_inspect_verify_convert_understand_dcp(tmp_path, monkeypatch):
    from stage_data import fm_here

    monkeypatch.setenv("COLUMNS", "200")

    def fm(*args: str) -> tuple[int, str]:
        r = fm_here(*args)
        return r.returncode, r.stdout + r.stderr

    uri = str(tmp_path / "cli")
    sd = _state()
    _save(sd, uri, compression="auto")
    code, out = fm("ckpt", "inspect", uri)
    assert code == 0 and "DCP" in out and "bfloat16" in out and "300x500" in out, out
    code, out = fm("ckpt", "verify", uri)
    assert code == 0 and "ok:" in out, out
    pt = str(tmp_path / "out.pt")
    code, out = fm("ckpt", "convert", uri, pt)
    assert code == 0, out
    loaded = torch.load(pt, weights_only=False)
    equal_trees(
        {k: v for k, v in loaded.items() if k != "meta"},
        {k: v for k, v in sd.items() if k != "meta"},
    )
    fm_dst = str(tmp_path / "single")
    code, out = fm("ckpt", "convert", uri, fm_dst)
    assert code == 0, out
    from fmstore import load

    single = load(fm_dst)
    assert torch.equal(single["w"], sd["w"]) and single["meta"]["step"] == 7


@pytest.mark.s3
def test_s3_faults_are_retried_and_load_bit_exact(s3_server, s3_bucket):
    from fmstore.testing.faultproxy import FaultProxy, Rule

    with FaultProxy(s3_server.endpoint_url) as proxy:
        so = {**s3_server.store_options(), "endpoint_url": proxy.endpoint_url}
        uri = f"s3://{s3_bucket}/faulty"
        proxy.set_plan(
            [
                Rule("slowdown", method="PUT", times=3),
                Rule("reset", method="GET", times=2),
                Rule("slowdown", method="GET", times=2),
            ]
        )
        sd = _state()
        _save(sd, uri, store_options=so, chunk_size=64 << 10)
        out = _zeros_like(sd)
        _load(out, uri, store_options=so)
        equal_trees(out, sd)
        assert sum(proxy.injected.values()) >= 5


@pytest.mark.s3
def test_s3_large_item_is_one_multipart_upload_from_its_memory(s3_server, s3_bucket):
    so = s3_server.store_options()
    uri = f"s3://{s3_bucket}/large"
    g = torch.Generator().manual_seed(3)
    sd = {"big": torch.randn(3 << 20, generator=g), "small": torch.arange(100)}  # 12 MiB
    _save(sd, uri, store_options=so)
    m = runtime.run(read_manifest(open_store(uri, **so)))
    big = next(it for it in m.items if it.fqn == "big")
    assert len({c.blob for c in big.chunks}) == 1 and m.blobs[big.chunks[0].blob].size == 12 << 20
    out = {"big": torch.zeros(3 << 20), "small": torch.zeros(100, dtype=torch.int64)}
    _load(out, uri, store_options=so)
    assert torch.equal(out["big"], sd["big"]) and torch.equal(out["small"], sd["small"])


@pytest.mark.s3
def test_s3_restore_merges_chunks_under_2_mib_into_ranged_gets(s3_server, s3_bucket, fault_proxy):
    """Items just over the 1 MiB direct-read size (the 70B job's FFN shards) packed in
    blobs: on S3 each was a GET of its own; merged, one ranged GET per blob here."""
    so = {**s3_server.store_options(), "endpoint_url": fault_proxy.endpoint_url}
    uri = f"s3://{s3_bucket}/merged"
    g = torch.Generator().manual_seed(5)
    sd = {f"ffn{i}": torch.randn(5 << 16, generator=g) for i in range(12)}  # 1.25 MiB each
    _save(sd, uri, store_options=so, streams=2)
    m = runtime.run(read_manifest(open_store(uri, **so)))
    assert len(m.blobs) == 2
    fault_proxy.seen.clear()
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    _load(out, uri, store_options=so)
    equal_trees(out, sd)
    gets = {k: v for k, v in fault_proxy.fetched().items() if k.endswith(".bin")}
    assert sum(len(v) for v in gets.values()) == len(m.blobs), gets
    # onto a device (the ring's path, here routed on the CPU): merged alike
    from fmstore.checkpoint.devring import route_cpu

    fault_proxy.seen.clear()
    ringed = {k: torch.zeros_like(v) for k, v in sd.items()}
    with route_cpu(slots=2, slot_bytes=1 << 20) as rec:
        _load(ringed, uri, store_options=so)
    equal_trees(ringed, sd)
    assert sum(n for _, n in rec.uses) == sum(v.nbytes for v in sd.values())
    again = [s for k, v in fault_proxy.fetched().items() if k.endswith(".bin") for s in v]
    assert len(again) == len(m.blobs)
    # the threshold is an option: at 1 MiB every chunk is a GET of its own again
    fault_proxy.seen.clear()
    _load(out, uri, store_options=so, object_direct_min=1 << 20)
    again = [s for k, v in fault_proxy.fetched().items() if k.endswith(".bin") for s in v]
    assert len(again) == len(sd)


@pytest.mark.s3
def test_s3_outage_is_a_clear_error_and_commits_nothing(s3_server, s3_bucket):
    from fmstore.testing.faultproxy import FaultProxy, Rule

    with FaultProxy(s3_server.endpoint_url) as proxy:
        # Every manifest PUT fails: 3 attempts, not the default 10 (10 s of back-off).
        so = {**s3_server.store_options(), "endpoint_url": proxy.endpoint_url, "max_attempts": 3}
        uri = f"s3://{s3_bucket}/down"
        proxy.set_plan([Rule("error", method="PUT", path=r".*manifest\.json")])
        with pytest.raises(BaseException) as ei:
            _save(_state(), uri, store_options=so)
        assert "manifest.json" in str(ei.value)
    assert not is_dcp_checkpoint(uri, **s3_server.store_options())
