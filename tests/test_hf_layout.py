"""``fmstore ckpt convert`` to and from Hugging Face ``save_pretrained`` directories, with a
tiny GPT-2 built from a config (nothing downloaded), through the console-script entry."""

from __future__ import annotations

import json
import os

import pytest
import torch
from stage_data import fm as fm_process
from stage_data import fm_here as fm

import fmstore


def _transformers():  # type: ignore[no-untyped-def]
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    tf = _transformers()
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    return tf, config, tf.GPT2LMHeadModel(config).eval()


def _state(model):  # type: ignore[no-untyped-def]
    sd = model.state_dict()
    optim = {"state": {i: {"exp_avg": torch.randn(4), "step": 3} for i in range(3)}}
    return {"model": sd, "optim": optim, "rng": torch.get_rng_state(), "step": 3}


def _shard_keys(d) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".safetensors"):
            part = load_file(d / name)
            assert not set(part) & set(out)
            out.update(part)
    return out


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b) or sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_training_state_to_sharded_pretrained_dir(tmp_path, tiny):
    tf, config, model = tiny
    fmstore.save(_state(model), tmp_path / "ck")
    config.save_pretrained(tmp_path / "cfg")
    dst = tmp_path / "not" / "yet" / "hf"  # parents are created
    r = fm(
        "ckpt", "convert", str(tmp_path / "ck"), str(dst),
        "--keys", "model", "--strip-prefix", "model.", "--max-shard-size", "20KB",
        "--config", str(tmp_path / "cfg" / "config.json"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    files = sorted(os.listdir(dst))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2
    assert files == sorted([*shards, "model.safetensors.index.json", "config.json"])
    assert all(f"-of-{len(shards):05d}.safetensors" in s for s in shards)

    sd = model.state_dict()
    flat = _shard_keys(dst)
    assert sorted(flat) == sorted(sd)  # exactly the model's keys: no optimizer, no rng
    _same(flat, {k: v for k, v in sd.items()})
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(sd)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())

    back, info = tf.GPT2LMHeadModel.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    _same(back.state_dict(), sd)
    # Tied weights stay tied after loading.
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()


def test_single_file_when_it_fits_and_config_from_save_pretrained(tmp_path, tiny):
    tf, config, model = tiny
    fmstore.save(_state(model), tmp_path / "ck")
    dst = tmp_path / "hf"
    r = fm(
        "ckpt", "convert", str(tmp_path / "ck"), str(dst),
        "--keys", "model", "--strip-prefix", "model.", "--to", "hf",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert os.listdir(dst) == ["model.safetensors"]
    config.save_pretrained(dst)
    back = tf.GPT2LMHeadModel.from_pretrained(dst)
    _same(back.state_dict(), model.state_dict())


@pytest.mark.parametrize("shard", ["20KB", None])
def test_pretrained_dir_to_fmstore_checkpoint(tmp_path, tiny, shard):
    tf, config, model = tiny
    src = tmp_path / "pre"
    model.save_pretrained(src, max_shard_size=shard or "5GB", safe_serialization=True)
    names = os.listdir(src)
    assert ("model.safetensors.index.json" in names) == (shard is not None)
    r = fm("ckpt", "convert", str(src), str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr
    got = fmstore.load(tmp_path / "ck")
    want = _shard_keys(src)
    _same(got, want)
    # ... and back to a directory from_pretrained takes (keys: only the transformer).
    r = fm(
        "ckpt", "convert", str(tmp_path / "ck"), str(tmp_path / "again" / "hf"),
        "--keys", "transformer.h.0", "--max-shard-size", "10KB",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    part = _shard_keys(tmp_path / "again" / "hf")
    assert part and all(k.startswith("transformer.h.0.") for k in part)
    _same(part, {k: v for k, v in want.items() if k.startswith("transformer.h.0.")})


def _one_error(r, *words: str) -> None:  # type: ignore[no-untyped-def]
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def test_hostile_index_is_refused(tmp_path, tiny):
    tf, config, model = tiny
    src = tmp_path / "pre"
    model.save_pretrained(src, max_shard_size="20KB")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    shard = index["weight_map"][first]
    (tmp_path / "x").write_bytes((src / shard).read_bytes())

    for bad in ("../x", "/etc/passwd", "sub/x", ".."):
        index["weight_map"][first] = bad
        index_path.write_text(json.dumps(index))
        r = fm("ckpt", "convert", str(src), str(tmp_path / "out"))
        _one_error(r, "not a plain file name")
        assert not (tmp_path / "out").exists()

    # A link out of the directory, under an innocent name.
    os.symlink(tmp_path / "x", src / "evil.safetensors")
    index["weight_map"][first] = "evil.safetensors"
    index_path.write_text(json.dumps(index))
    _one_error(fm("ckpt", "convert", str(src), str(tmp_path / "out")), "evil.safetensors")

    for doc in ("[1, 2]", '{"weight_map": {"a": 3}}', "{not json", '{"weight_map": {}}'):
        index_path.write_text(doc)
        _one_error(fm("ckpt", "convert", str(src), str(tmp_path / "out")), "index.json")


def test_declared_header_size_is_checked_against_the_file(tmp_path, tiny):
    tf, config, model = tiny
    src = tmp_path / "pre"
    model.save_pretrained(src)
    f = src / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = (len(data) * 4).to_bytes(8, "little")
    f.write_bytes(bytes(data))
    _one_error(fm("ckpt", "convert", str(src), str(tmp_path / "out")), "header declares")
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage garbage}")
    _one_error(fm("ckpt", "convert", str(src), str(tmp_path / "out")), "model.safetensors")


def test_existing_destination_needs_overwrite(tmp_path, tiny):
    tf, config, model = tiny
    fmstore.save(_state(model), tmp_path / "ck")
    dst = tmp_path / "hf"
    args = ["ckpt", "convert", str(tmp_path / "ck"), str(dst), "--keys", "model"]
    args += ["--strip-prefix", "model.", "--max-shard-size", "20KB"]
    assert fm(*args).returncode == 0
    many = len(os.listdir(dst))
    _one_error(fm(*args), "--overwrite")
    # With --overwrite, the shards of the old layout do not linger.
    r = fm(*args[:-2], "--max-shard-size", "1GB", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert os.listdir(dst) == ["model.safetensors"] and many > 1
    # A plain .safetensors destination too, its parents created.
    one = tmp_path / "deep" / "er" / "w.safetensors"
    assert fm("ckpt", "convert", str(tmp_path / "ck"), str(one), "--keys", "model").returncode == 0
    _one_error(fm("ckpt", "convert", str(tmp_path / "ck"), str(one)), "--overwrite")


def test_unmatched_keys_and_wrong_options_are_one_line(tmp_path, tiny):
    tf, config, model = tiny
    fmstore.save(_state(model), tmp_path / "ck")
    _one_error(
        fm(
            "ckpt",
            "convert",
            str(tmp_path / "ck"),
            str(tmp_path / "hf"),
            "--keys",
            "nope",
            "--to",
            "hf",
        ),
        "nope",
    )
    _one_error(
        fm(
            "ckpt",
            "convert",
            str(tmp_path / "ck"),
            str(tmp_path / "hf"),
            "--max-shard-size",
            "lots",
        ),
        "--max-shard-size",
    )
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _one_error(
        fm("ckpt", "convert", str(tmp_path / "ck"), str(blocker / "hf"), "--to", "hf"),
        "cannot create",
    )


def test_oversized_index_is_refused_before_it_is_parsed(tmp_path, tiny, monkeypatch):
    from fmstore.checkpoint import hf

    tf, config, model = tiny
    src = tmp_path / "pre"
    model.save_pretrained(src, max_shard_size="20KB")
    size = (src / "model.safetensors.index.json").stat().st_size
    monkeypatch.setattr(hf, "MAX_INDEX_BYTES", size - 1)
    _one_error(fm("ckpt", "convert", str(src), str(tmp_path / "out")), "allowed")


def test_existing_fmstore_destination_names_the_flag(tmp_path, tiny):
    tf, config, model = tiny
    src = tmp_path / "pre"
    model.save_pretrained(src)
    args = ("ckpt", "convert", str(src), str(tmp_path / "a" / "b" / "ck"))
    assert fm(*args).returncode == 0
    _one_error(fm(*args), "--overwrite")
    assert fm(*args, "--overwrite").returncode == 0


def test_real_command_round_trip_and_refusal(tmp_path, tiny):
    """The console script in its own process: a save_pretrained directory to an fmstore
    checkpoint and back, and a hostile index as one error line."""
    tf, config, model = tiny
    src = tmp_path / "pre"
    model.save_pretrained(src, max_shard_size="20KB")
    r = fm_process("ckpt", "convert", str(src), str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr
    r = fm_process(
        "ckpt", "convert", str(tmp_path / "ck"), str(tmp_path / "out"),
        "--max-shard-size", "30KB", "--config", str(src / "config.json"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    back, info = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    _same(back.state_dict(), model.state_dict())
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = "../x"
    index_path.write_text(json.dumps(index))
    _one_error(fm_process("ckpt", "convert", str(src), str(tmp_path / "bad")), "../x")
