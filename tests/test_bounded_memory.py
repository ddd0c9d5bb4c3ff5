"""A bounded read bounds memory: manifests, records and indexes are judged from their bytes
as they are read (a first byte other than ``{``, a NUL), decoded as UTF-8 only, and a
decode error is described by its kind and position, never by a repr of the input.

The sparse cases run in a subprocess whose address space is capped about 3 GiB above its
baseline, so the old code (a 4 GiB read, a repr at four characters a byte) fails there
with a ``MemoryError`` rather than meeting the OOM killer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from hostile_helpers import _PRELUDE, REPO
from loader_helpers import make_dataset

from fmstore import runtime
from fmstore.checkpoint.dcp.manifest import DcpManifest
from fmstore.errors import CorruptData, NotFound, describe_error
from fmstore.format.manifest import FORMAT_NAME, Manifest
from fmstore.loaders import StreamingDataset
from fmstore.stores import open_store
from fmstore.stores.bounded import FIRST_WINDOW, decode_json, read_bounded

#: Address space beyond the subprocess's baseline: less than the 4 GiB the old code read.
HEADROOM = 3 << 30
#: What judging a sparse manifest may add to the subprocess's peak resident memory.
SPARSE_PEAK = 32 << 20
#: A message about a hostile input stays this short, whatever the input's size.
SHORT = 400

# VmHWM, not ru_maxrss: the latter survives exec, so it starts at the parent's own peak.
_PEAK = """
def _peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")

def measured(fn):
    def go():
        before = _peak()
        try:
            fn()
        finally:
            print("PEAK", _peak() - before)
    return go
"""


def _sparse(path, size: int, head: bytes = b"") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)  # the rest is a hole: no disk used
    return str(path)


def _run_peaks(code: str) -> tuple[list[dict], list[int]]:
    """Like :func:`run_limited`, with the peak of each measured call."""
    full = _PRELUDE.format(headroom=HEADROOM) + _PEAK + textwrap.dedent(code)
    env = dict(os.environ, PYTHONPATH=str(REPO), MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-c", full], capture_output=True, text=True, timeout=300, env=env
    )
    out = p.stdout.splitlines()
    res = [json.loads(line[7:]) for line in out if line.startswith("RESULT ")]
    peaks = [int(line[5:]) for line in out if line.startswith("PEAK ")]
    assert res and len(res) == len(peaks), f"rc {p.returncode}:\n{p.stdout}\n{p.stderr[-3000:]}"
    return res, peaks


def test_sparse_manifests_are_refused_after_reading_a_little(tmp_path):
    """64 MiB - 1 and 4 GiB - 1 bytes of hole (all NULs, or ``{`` then NULs) as a
    checkpoint's manifest: the reader, the multi-rank reader, ``gc``, ``ckpt gc`` on the
    command line and the loader (as a dataset's index) each refuse it with a short
    ``CorruptData`` (``gc`` counts it unreadable), adding at most a few MiB to the peak
    resident memory (the old code: a 4 GiB read, or a repr at four characters a byte)."""
    small = _sparse(tmp_path / "small" / "manifest.json", (64 << 20) - 1)
    huge = _sparse(tmp_path / "huge" / "manifest.json", (4 << 30) - 1)
    braced = _sparse(tmp_path / "braced" / "manifest.json", (4 << 30) - 1, b'{"format":')
    dcp = _sparse(tmp_path / "dcp" / "manifest.json", (4 << 30) - 1, b"  {")
    index = _sparse(tmp_path / "data" / "index.json", (64 << 20) - 1, b"{")
    root = str(tmp_path)
    res, peaks = _run_peaks(
        f"""
        from fmstore import runtime
        from fmstore.checkpoint.dcp import reader
        from fmstore.checkpoint.gc import gc
        from fmstore.checkpoint.layout import read_manifest
        from fmstore.cli.main import main
        from fmstore.loaders import StreamingDataset
        from fmstore.stores import open_store

        def read(path, how=read_manifest):
            runtime.run(how(open_store(os.path.dirname(path))))

        def gc_keeps(root, unreadable):
            rep = gc(root, dry_run=True, older_than=0)
            assert rep.unreadable == unreadable, rep

        for path in ({small!r}, {huge!r}, {braced!r}):
            report(measured(lambda: read(path)))
        report(measured(lambda: read({dcp!r}, reader.read_manifest)))
        report(measured(lambda: gc_keeps({root!r}, ["braced", "dcp", "huge", "small"])))
        report(measured(lambda: main(["ckpt", "gc", {root!r}, "-n", "--older-than", "0"])))
        report(measured(lambda: StreamingDataset({os.path.dirname(index)!r},
                                                 {str(tmp_path / "cache")!r})))
        """
    )
    assert [r["error"] for r in res] == ["CorruptData"] * 4 + [None, None, "CorruptData"], res
    assert all(len(r.get("msg", "")) < SHORT for r in res), res
    assert all(p <= SPARSE_PEAK for p in peaks), (peaks, res)
    assert "NUL byte at byte 0" in res[0]["msg"] and "small/manifest.json" in res[0]["msg"], res
    assert "NUL byte at byte 10" in res[2]["msg"], res
    assert "NUL byte at byte 3" in res[3]["msg"], res
    assert "dataset index" in res[-1]["msg"] and "NUL byte at byte 1" in res[-1]["msg"], res
    assert os.path.getsize(huge) == (4 << 30) - 1  # nothing removed or rewritten


def test_dense_hostile_manifests_cost_at_most_four_times_their_size(tmp_path):
    """64 MiB manifests with no NUL that fail to decode: invalid UTF-8 after the ``{``, and
    a valid JSON object whose ``created`` is a 64 MiB string (the old code's ``float()``
    quoted all of it in its error, then the message quoted that error's repr).  Each is a short ``CorruptData`` with a peak of at most 4x its size (the
    old code formatted each error's repr: about 8x)."""
    size = 64 << 20
    bad_utf8 = tmp_path / "utf8" / "manifest.json"
    bad_utf8.parent.mkdir()
    bad_utf8.write_bytes(b'{"format":"' + b"\xff" * (size - 11))
    created = tmp_path / "created" / "manifest.json"
    created.parent.mkdir()
    doc = {"format": FORMAT_NAME, "version": 1, "generation": "g", "tree": None}
    doc.update(tensors=[], storages=[], blobs=[], created="")
    text = json.dumps(doc).encode()
    created.write_bytes(text[:-2] + b"x" * (size - len(text)) + text[-2:])
    res, peaks = _run_peaks(
        f"""
        from fmstore import runtime
        from fmstore.checkpoint.layout import read_manifest
        from fmstore.stores import open_store

        for path in ({str(bad_utf8)!r}, {str(created)!r}):
            report(measured(lambda: runtime.run(read_manifest(open_store(os.path.dirname(path))))))
        """
    )
    assert [r["error"] for r in res] == ["CorruptData"] * 2, res
    assert all(len(r["msg"]) < SHORT for r in res), res
    assert "not utf-8 text: invalid start byte at byte 11" in res[0]["msg"], res
    assert "field 'created' is 'xxx" in res[1]["msg"] and "..., not a number" in res[1]["msg"], res
    assert all(p <= 4 * size for p in peaks), (peaks, res)


# ---- judged from the bytes, decoded as UTF-8 only ----------------------------------------


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"[1, 2]", "begins with b'['"),
        (b'\xef\xbb\xbf{"a": 1}', "begins with b'\\xef'"),
        (b'"text"', "begins with b'\"'"),
        (b'{"a": "b\x00c"}', "a NUL byte at byte 8"),
        (b"\x00\x00\x00{", "NUL byte at byte 0"),
        (b'{"a":"' + b"b" * FIRST_WINDOW + b'\x00"}', f"NUL byte at byte {FIRST_WINDOW + 6}"),
    ],
)
def test_a_record_that_cannot_be_a_json_object_is_refused_as_read(tmp_path, data, why):
    store = open_store(str(tmp_path))
    (tmp_path / "manifest.json").write_bytes(data)
    with pytest.raises(CorruptData, match="manifest .*manifest.json is not JSON text") as e:
        runtime.run(read_bounded(store, "manifest.json", 1 << 30, what="manifest"))
    assert why in str(e.value)
    (tmp_path / "ok.json").write_bytes(b' \n\t{"a": "\xc3\xa9"}')
    assert runtime.run(read_bounded(store, "ok.json", 100)) == b' \n\t{"a": "\xc3\xa9"}'


def test_a_manifest_in_utf16_or_utf32_is_not_a_manifest(tmp_path):
    """``json.loads`` given bytes guesses UTF-16 and UTF-32 from NULs: the old code loaded a
    manifest in either.  Only UTF-8 is read, and the error is short."""
    import fmstore

    fmstore.save({"w": 1}, str(tmp_path / "c"))
    good = (tmp_path / "c" / "manifest.json").read_bytes()
    Manifest.loads(good)
    for enc in ("utf-16", "utf-32-le", "utf-32-be"):
        text = good.decode().encode(enc)
        with pytest.raises(CorruptData, match="manifest is not JSON") as e:
            Manifest.loads(text)
        assert len(str(e.value)) < SHORT
        (tmp_path / "c" / "manifest.json").write_bytes(text)
        with pytest.raises(CorruptData, match="NUL byte"):
            fmstore.load(str(tmp_path / "c"))


@pytest.mark.parametrize("loads", [Manifest.loads, DcpManifest.loads])
def test_invalid_utf8_gives_a_short_message_with_its_position(loads):
    data = b'{"format": "' + b"\xff" * (4 << 20)
    with pytest.raises(CorruptData) as e:
        loads(data, where="here")
    msg = str(e.value)
    assert len(msg) < SHORT and "not utf-8 text: invalid start byte at byte 12" in msg, msg


def test_describe_error_never_formats_the_input_whole():
    big = "x" * (8 << 20)
    try:
        float(big)
    except ValueError as e:
        assert len(describe_error(e)) < SHORT
    try:
        (b"\x00" * (8 << 20) + b"\xff").decode("utf-8")
    except UnicodeDecodeError as e:
        assert describe_error(e) == f"not utf-8 text: invalid start byte at byte {8 << 20}"
    assert describe_error(KeyError("generation")) == "KeyError: generation"
    assert describe_error(ValueError(b"\x00" * 1000)).startswith("ValueError: b'\\x00")
    assert len(describe_error(TypeError(10**4000))) < 100
    with pytest.raises(ValueError, match=r"^Expecting value at line 1 column 1 \(char 0\)$"):
        decode_json(b"nope")
    with pytest.raises(ValueError, match="nested too deeply"):
        decode_json(b"[" * 100_000)


# ---- a dataset's index.json that is not an index says so ----------------------------------


def test_an_index_json_that_is_not_an_index_says_what_it_is(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "index.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(NotFound, match=r"index.json is not a dataset index \(it has no 'format'"):
        StreamingDataset(str(data), str(tmp_path / "cache"))
    (data / "index.json").write_text(json.dumps({"format": "other", "shards": []}))
    with pytest.raises(CorruptData, match="not an fmstore index: its 'format' is 'other'"):
        StreamingDataset(str(data), str(tmp_path / "cache"), format="fmstore")
    (data / "index.json").write_text(json.dumps({"shards": [{"format": "x"}]}))
    with pytest.raises(CorruptData, match="not an mds index: its 'shards' are not MDS shards"):
        StreamingDataset(str(data), str(tmp_path / "cache"), format="mds")


def test_a_dataset_index_in_utf16_is_refused(tmp_path):
    """The old code let ``json`` guess the encoding and read a UTF-16 index."""
    remote = make_dataset(tmp_path, 50)
    path = os.path.join(remote, "index.json")
    with open(path, "rb") as f:
        text = f.read().decode()
    with open(path, "wb") as f:
        f.write(text.encode("utf-16"))
    with pytest.raises(CorruptData, match="dataset index .*index.json is not JSON text"):
        StreamingDataset(remote, str(tmp_path / "cache"))
