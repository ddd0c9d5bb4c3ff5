"""The location matrix: every operation on every location form.

Columns are the forms a user may write (docs/configuration.md, "Locations"): a plain path,
``file://``, ``nvme:``, ``lustre:``, ``s3:`` (a tier whose URL has a prefix), ``s3://``
(endpoint from ``[s3]`` of fmstore.toml, nothing in the environment), ``memory://`` and
another fsspec protocol (``local://``).  Rows are the operations.  Each cell passes, or
raises the documented :class:`~fmstore.errors.NotSupported` /
:class:`~fmstore.errors.ConfigError` -- never an ``AttributeError``, and never a network
error caused by a setting that was ignored.  The S3 cells run on both real S3 servers:
``s3tier`` and ``s3url`` on SeaweedFS, ``s3tier@moto`` and ``s3url@moto`` on moto_server
(where they differ from AWS: ``tests/s3_servers.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from stage_data import fm_here

import fmstore
from fmstore import runtime
from fmstore.config import load_config, set_config
from fmstore.stores import Location, open_store

S3_FORMS = ["s3tier", "s3url"]
FORMS = ["path", "file", "nvme", "lustre", *S3_FORMS, "memory", "fsspec"]
FORMS += [f"{f}@moto" for f in S3_FORMS]  # the S3 cells again, on the second server
LOCAL_FORMS = {"path", "file", "nvme", "lustre"}


def _server_name(request) -> str:
    """``moto`` for a cell of the second S3 server (form ``...@moto``, or ``server``)."""
    callspec = getattr(request.node, "callspec", None)
    params = callspec.params if callspec is not None else {}
    if str(params.get("form", "")).endswith("@moto") or params.get("server") == "moto":
        return "moto"
    return "seaweed"


@pytest.fixture
def world(tmp_path, monkeypatch, request):
    """A config as docs/configuration.md shows it: nvme and lustre directories, an S3 tier
    ``s3://BUCKET/tier-prefix`` and the endpoint only in ``[s3]``.  Credentials come from
    the environment (botocore's chain); no endpoint does."""
    s3_server = request.getfixturevalue(f"{_server_name(request)}_server")
    s3_bucket = s3_server.create_bucket(f"t-{uuid.uuid4().hex[:20]}")
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    mode = getattr(request, "param", "eager")
    toml = tmp_path / "fmstore.toml"
    toml.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
        f'[tiers.lustre]\nurl = "file://{tmp_path / "lustre"}"\n'
        f'[tiers.s3]\nurl = "s3://{s3_bucket}/tier-prefix"\n'
        f'[tiers.s3root]\nurl = "s3://{s3_bucket}"\n'
        f'[s3]\nendpoint_url = "{s3_server.endpoint_url}"\nregion = "{s3_server.region}"\n'
        "max_attempts = 2\n"
        '[policies]\nladder = ["nvme", "lustre", "s3", "s3root"]\n'
        f'[policies.restore]\nmode = "{mode}"\n'
    )
    monkeypatch.setenv("FMSTORE_CONFIG", str(toml))
    monkeypatch.setenv("FMSTORE_HOME", str(tmp_path / "home"))
    set_config(load_config())
    yield _World(tmp_path, s3_bucket)
    set_config(None)
    s3_server.delete_bucket(s3_bucket)


class _World:
    def __init__(self, tmp: Path, bucket: str) -> None:
        self.tmp, self.bucket = tmp, bucket

    def loc(self, form: str, name: str | None = None) -> str:
        """A fresh location of ``form``."""
        name = name or f"x-{uuid.uuid4().hex[:8]}"
        form = form.partition("@")[0]  # the same form on the other S3 server
        t = self.tmp
        return {
            "path": str(t / "plain" / name),
            "file": f"file://{t / 'viafile' / name}",
            "nvme": f"nvme:sub/{name}",
            "lustre": f"lustre:sub/{name}",
            "s3tier": f"s3:sub/{name}",
            "s3url": f"s3://{self.bucket}/direct/{name}",
            "memory": f"memory://fm-{uuid.uuid4().hex[:8]}/{name}",
            "fsspec": f"local://{t / 'fs' / name}",
        }[form]


def _state(n: int = 8) -> dict:
    g = torch.Generator().manual_seed(n)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.arange(5)}, "step": 3}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


# ---- resolution ------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_location_resolves_locality_before_anything_is_opened(world, form):
    loc = Location.parse(world.loc(form, "a"))
    assert loc.is_local == (form in LOCAL_FORMS)
    if loc.local_root is not None:
        assert os.path.isabs(loc.local_root) and loc.local_root.endswith("/a")
        assert not os.path.exists(loc.local_root)  # parsing creates nothing
    store = open_store(world.loc(form, "a"))
    try:
        # The opened store (a prefix over a metered backend, for tiers) gives the same answer.
        assert store.local_root == loc.local_root
    finally:
        runtime.run(store.close())


def test_s3_url_takes_its_endpoint_from_the_config(world):
    loc = Location.parse(f"s3://{world.bucket}/x")
    assert loc.options["endpoint_url"].startswith("http://127.0.0.1:")


# ---- fmstore.save / load / async_save ---------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_save_and_load_small(world, form):
    uri = world.loc(form)
    fmstore.save(_state(), uri)
    assert _same(fmstore.load(uri), _state())


@pytest.mark.parametrize("form", FORMS)
def test_load_multi_chunk_keys_lazy_and_mmap(world, form):
    uri = world.loc(form)
    big = _state(1 << 20)  # 4 MiB of floats, cut into 1 MiB chunks
    fmstore.save(big, uri, chunk_size=1 << 20, compression="none")
    assert _same(fmstore.load(uri), big)
    assert _same(fmstore.load(uri, keys="model.w"), {"model": {"w": big["model"]["w"]}})
    lazy = fmstore.load(uri, lazy=True)
    assert torch.equal(lazy["model"]["w"], big["model"]["w"])
    # mmap maps where the store has local files and reads elsewhere: same values.
    assert _same(fmstore.load(uri, mmap=True), big)


@pytest.mark.parametrize("form", FORMS)
def test_async_save(world, form):
    uri = world.loc(form)
    fmstore.async_save(_state(300), uri).result(timeout=120)
    assert _same(fmstore.load(uri), _state(300))


@pytest.mark.parametrize("form", FORMS)
def test_dcp_writer_and_reader(world, form):
    import torch.distributed.checkpoint as dcp

    from fmstore.checkpoint.dcp import Reader, Writer

    uri = world.loc(form)
    sd = {"w": torch.randn(1000), "b": torch.arange(7)}
    dcp.save(sd, storage_writer=Writer(uri), no_dist=True)
    out = {"w": torch.zeros(1000), "b": torch.zeros(7, dtype=torch.long)}
    dcp.load(out, storage_reader=Reader(uri), no_dist=True)
    assert _same(out, sd)


# ---- the checkpoint manager: the only copy on each tier --------------------------------


@pytest.mark.parametrize(
    ("tier", "server"),
    [(t, "seaweed") for t in ("nvme", "lustre", "s3", "s3root")] + [("s3", "moto")],
)
@pytest.mark.parametrize("world", ["eager", "lazy"], indirect=True)
def test_manager_restores_the_only_copy_on_each_tier_after_losing_the_catalog(world, tier, server):
    from fmstore import CheckpointManager

    big = _state(1 << 20)
    fmstore.save(big, f"{tier}:runs/a/step_000000000009", chunk_size=1 << 20)
    shutil.rmtree(world.tmp / "state", ignore_errors=True)  # the node's catalog is gone
    with CheckpointManager("runs/a", run_policies=False) as mgr:
        assert mgr.latest_step() == 9 and mgr.tiers_of(9) == [tier]
        got = mgr.restore()
        assert mgr.restored_step == 9
        assert torch.equal(got["model"]["w"], big["model"]["w"]) and got["step"] == 3
    r = fm_here("ckpt", "list", "--json", "runs/a")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert row["step"] == 9 and row["tiers"][tier]["state"] == "present"


# ---- the data loader ---------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_streaming_dataset(world, form, tmp_path):
    from fmstore.loaders import StreamingDataset, write_dataset

    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(50)))
    uri = world.loc(form)
    write_dataset(src, uri, shard_size=200)
    ds = StreamingDataset(uri, str(tmp_path / f"cache-{form}"), transform=lambda s: s["i"])
    assert sorted(ds) == list(range(50))


# ---- the CLI -----------------------------------------------------------------------------


def _tree(root: Path) -> None:
    (root / "d").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"alpha" * 100)
    (root / "d" / "b.bin").write_bytes(os.urandom(3000))


@pytest.mark.parametrize("form", FORMS)
def test_cli_stage_both_ways_and_object_commands(world, form, tmp_path):
    src = tmp_path / "src"
    _tree(src)
    there = world.loc(form)
    r = fm_here("stage", str(src), there)
    assert r.returncode == 0, r.stderr
    back = tmp_path / "back"
    r = fm_here("stage", there, str(back))
    assert r.returncode == 0, r.stderr
    assert (back / "d" / "b.bin").read_bytes() == (src / "d" / "b.bin").read_bytes()

    r = fm_here("ls", "-r", there)
    assert r.returncode == 0 and "d/b.bin" in r.stdout and "a.txt" in r.stdout, r.stdout + r.stderr
    r = fm_here("du", there)
    assert r.returncode == 0 and "2 files  total" in r.stdout, r.stdout + r.stderr
    r = fm_here("cp", f"{there}/a.txt", f"{there}/c.txt")
    assert r.returncode == 0, r.stderr
    r = fm_here("rm", "--yes", f"{there}/c.txt")
    assert r.returncode == 0, r.stderr
    r = fm_here("rm", "-r", "--yes", there)
    assert r.returncode == 0, r.stderr
    r = fm_here("ls", "-r", there)
    assert "a.txt" not in r.stdout


@pytest.mark.parametrize("form", FORMS)
def test_cli_ckpt_inspect_and_verify(world, form):
    uri = world.loc(form)
    fmstore.save(_state(5000), uri)
    r = fm_here("ckpt", "inspect", uri)
    assert r.returncode == 0 and "model.w" in r.stdout, r.stdout + r.stderr
    r = fm_here("ckpt", "verify", uri)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("form", FORMS)
def test_cli_lazy_stage_hydrate_release(world, form, tmp_path, monkeypatch):
    """Lazy staging keeps a listing in a local directory: a source is a tier, below one,
    or below a location of ``[stage] lazy_sources`` (other fsspec protocols are refused up
    front); only local forms are destinations, the others are refused up front, and
    ``hydrate`` of them too, with a one-line ConfigError."""
    allowed = [str(world.tmp / "plain"), f"file://{world.tmp / 'viafile'}"]
    monkeypatch.setenv("FMSTORE__STAGE__LAZY_SOURCES", json.dumps(allowed))
    set_config(load_config())
    src_dir = tmp_path / "src"
    _tree(src_dir)
    remote = world.loc(form)
    assert fm_here("stage", str(src_dir), remote).returncode == 0
    if form not in LOCAL_FORMS:
        r = fm_here("stage", "--lazy", str(src_dir), remote)
        assert r.returncode == 1 and "--lazy: the destination must be a local" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert ".fmstore-lazy.jsonl" not in fm_here("ls", "-r", remote).stdout
    local = tmp_path / "lazy"
    r = fm_here("stage", "--lazy", remote, str(local))
    if form in ("memory", "fsspec"):
        assert r.returncode == 1 and "lazy_sources" in r.stderr, r.stderr
        assert not local.exists()
        return
    assert r.returncode == 0, r.stderr
    r = fm_here("hydrate", str(local))
    assert r.returncode == 0, r.stderr
    assert (local / "d" / "b.bin").read_bytes() == (src_dir / "d" / "b.bin").read_bytes()
    r = fm_here("release", str(local))
    assert r.returncode == 0, r.stderr
    assert not (local / "d" / "b.bin").exists()
    if form not in LOCAL_FORMS:
        r = fm_here("hydrate", remote)
        assert r.returncode != 0 and "lazy staging works on local paths" in r.stderr
        assert "Traceback" not in r.stderr
