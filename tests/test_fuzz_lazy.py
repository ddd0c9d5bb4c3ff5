"""Property-based fuzzing of the lazy-staging index (``.fmstore-lazy.jsonl``).

A real index, written by ``fmstore stage --lazy`` from a POSIX tier, is mutated: fields of
its head and entries replaced by hostile values (sources naming other protocols, a live
loopback HTTP server, paths outside the tiers; keys that climb out; sizes, versions and
checksums of the wrong type), bytes flipped, truncated or extended, lines duplicated,
dropped, reordered or replaced by binary or over-long ones, and the modes of the index and
its directory changed.  Then ``hydrate``, ``release``, ``ls``, ``fmstore.open`` and reads
through ``fmstore://`` must each succeed or raise an fmstore error (one ``error:`` line on
the command line), within a hard address-space limit, write nothing outside the lazily
staged directory and the state directory, and never send a request to the HTTP server.
Time stays bounded by construction: the index is at most a few hundred KiB, and nothing
that can block (a FIFO, a device) is ever opened.

Budget: ``FMSTORE_FUZZ_EXAMPLES`` examples (15 by default, derandomized; ``make fuzz``: 2000).
"""

from __future__ import annotations

import contextlib
import copy
import http.server
import io
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzz_support import address_space_limit, files_below
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import DrawFn
from stage_data import fm_here

import fmstore
from fmstore.cli.main import main
from fmstore.config import set_config
from fmstore.errors import FmstoreError
from fmstore.fsspec import FmstoreFileSystem
from fmstore.tiering.copy.transfer import TransferOptions
from fmstore.tiering.staging import lazy
from fmstore.tiering.staging.lazy import INDEX_NAME

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("FMSTORE_FUZZ_EXAMPLES", "15"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)  # fmt: skip
#: Address space the operations of one example may take beyond the process's size.
HEADROOM = 2 << 30
#: What may change below the test's directory: the lazily staged one, the state directory.
ALLOWED = ("nvme/ds", "state")
KEYS = ["a.bin", "d/b.bin", "d/e/c.bin", "big.bin"]


# ---- guards ---------------------------------------------------------------------------------


def _only_fmstore_errors(op: Callable[[], Any]) -> None:
    with contextlib.suppress(FmstoreError):
        op()


def _cli(*args: str) -> None:
    """The console entry in-process: an fmstore error ends in exit 1 with one line."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            assert e.code in (0, 1, 3, None), (e.code, err.getvalue()[-2000:])
    text = err.getvalue()
    assert "Traceback" not in text, text[-2000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) <= 1, text[-2000:]


# ---- the world: a tier holding the source, a lazily staged directory, a loopback server ------


@pytest.fixture
def http_hits() -> Iterator[tuple[str, list[str]]]:
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(b"{}")

        do_HEAD = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", hits
    server.shutdown()
    server.server_close()
    t.join()


@pytest.fixture
def staged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, bytes]]:
    """``lustre:src`` staged lazily into ``nvme:ds``; (the test's directory, the index)."""
    src = tmp_path / "lustre" / "src"
    for i, key in enumerate(KEYS):
        (src / key).parent.mkdir(parents=True, exist_ok=True)
        (src / key).write_bytes(os.urandom(100 + i * 7 if key != "big.bin" else 200_000))
    (tmp_path / "secret").mkdir(mode=0o700)
    (tmp_path / "secret" / "a.bin").write_bytes(b"not to be copied")
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
        f'[tiers.lustre]\nurl = "{tmp_path / "lustre"}"\n'
    )
    monkeypatch.setenv("FMSTORE_CONFIG", str(cfg))
    monkeypatch.setenv("FMSTORE_HOME", str(tmp_path / "home"))
    set_config(None)
    r = fm_here("stage", "--lazy", "lustre:src", "nvme:ds", "--no-progress")
    assert r.returncode == 0, r.stderr
    yield tmp_path, (tmp_path / "nvme" / "ds" / INDEX_NAME).read_bytes()
    set_config(None)


# ---- mutations --------------------------------------------------------------------------------


def _deep(n: int) -> Any:
    v: Any = 0
    for _ in range(n):
        v = [v]
    return v


HOSTILE = st.one_of(
    st.integers(-(2**70), -1),
    st.sampled_from([0, 1, 2**31, 2**62, 2**63, 2**64 + 7, 10**30, True, False, None]),
    st.sampled_from([float("nan"), float("inf"), -1.5, 1e308, 0.5]),
    st.sampled_from(["", "../../escape", "/etc/passwd", "a//b", ".", ".fmstore-lazy.jsonl",
                     ".fmstore-tmp.x", "d/../../x", "\x00", "a\\b", "9" * 40, "x" * 5000,
                     "zz", "1a2b3c4d", "1a2b3c4d5"]),
    st.sampled_from([[], {}, [1, -1], {"k": "a"}, _deep(60), _deep(200)]),
)  # fmt: skip


def _sources(tmp: Path, http: str) -> list[Any]:
    return [
        "lustre:src", "lustre:", "nvme:", "nvme:ds", "lustre:../secret", "lustre:src/../..",
        "nope:x", f"{http}/latest/meta-data", f"simplecache::{http}/x",
        f"simplecache::file://{tmp / 'secret'}", f"file://{tmp / 'secret'}", str(tmp / "secret"),
        f"local://{tmp / 'secret'}", f"{tmp / 'lustre'}/../secret", "secret", "memory://x",
        "s3://no-such-bucket/x", f"file://{tmp / 'lustre' / 'src'}", str(tmp / "lustre" / "src"),
        "", 5, None, ["lustre:src"], "x" * 5000,
    ]  # fmt: skip


@st.composite
def mutated_index(draw: DrawFn, original: bytes, sources: list[Any]) -> bytes:
    lines = original.split(b"\n")
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["field", "field", "source", "bytes", "line"]))
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        if op in ("field", "source"):
            try:
                doc = json.loads(lines[i])
            except (ValueError, RecursionError):
                continue
            if op == "source" or not isinstance(doc, dict):
                doc = {"fmstore_lazy": 1, "source": draw(st.sampled_from(sources))}
                i = 0
            else:
                field = draw(st.sampled_from(sorted(doc) + ["k", "s", "v", "c", "fmstore_lazy"]))
                if draw(st.booleans()) and field in doc and draw(st.booleans()):
                    del doc[field]
                else:
                    doc[field] = copy.deepcopy(draw(HOSTILE))
            lines[i] = json.dumps(doc).encode()
        elif op == "bytes":
            blob = b"\n".join(lines)
            pos = draw(st.integers(0, max(0, len(blob) - 1)))
            kind = draw(st.sampled_from(["flip", "truncate", "extend"]))
            payload = draw(st.binary(min_size=1, max_size=64))
            if kind == "flip":
                blob = blob[:pos] + bytes([blob[pos] ^ 0xFF]) + blob[pos + 1 :] if blob else blob
            elif kind == "truncate":
                blob = blob[:pos]
            else:
                blob = blob[:pos] + payload + blob[pos:]
            lines = blob.split(b"\n")
        else:
            what = draw(st.sampled_from(["dup", "drop", "swap", "binary", "long", "deep", "many"]))
            if what == "dup" and lines:
                lines.insert(i, lines[i])
            elif what == "drop" and lines:
                del lines[i]
            elif what == "swap" and len(lines) > 1:
                lines[0], lines[i] = lines[i], lines[0]
            elif what == "binary":
                lines.insert(i, draw(st.binary(min_size=1, max_size=200)))
            elif what == "long":
                lines.insert(i, b'{"k":"' + b"a" * 70_000 + b'","s":1}')
            elif what == "deep":  # deeper than the JSON decoder recurses
                lines.insert(i, b'{"k":"a","s":' + b"[" * 20_000 + b"]" * 20_000 + b"}")
            else:  # many entries, each a real key of another size
                lines += [json.dumps({"k": f"n/{j}", "s": j}).encode() for j in range(2000)]
    return b"\n".join(lines)


# ---- the property -------------------------------------------------------------------------------


def _reset(tmp: Path, index: bytes, modes: tuple[int, int]) -> Path:
    dst = tmp / "nvme" / "ds"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    (dst / INDEX_NAME).write_bytes(index)
    (dst / INDEX_NAME).chmod(modes[0])
    dst.chmod(modes[1])
    return dst


def _operations(tmp: Path, dst: Path) -> None:
    fs = FmstoreFileSystem()
    for key in ("a.bin", "d/b.bin", "n/5"):
        _only_fmstore_errors(lambda k=key: fmstore.open(str(dst / k)).close())
        _only_fmstore_errors(lambda k=key: fs.cat_file(f"nvme/ds/{k}"))
    _only_fmstore_errors(lambda: fs.ls("nvme/ds"))
    _only_fmstore_errors(lambda: fs.info("nvme/ds/d"))
    _only_fmstore_errors(lambda: lazy.hydrate(str(dst), TransferOptions(concurrency=4)))
    _cli("ls", "-r", str(dst))
    _cli("hydrate", str(dst / "d"), "--no-progress")
    event("some file fetched" if any(dst.rglob("*.bin")) else "nothing fetched")
    _cli("release", str(dst))


@FUZZ
@given(data=st.data())
def test_a_mutated_lazy_index_gives_only_fmstore_errors(staged, http_hits, data):
    tmp, original = staged
    http, hits = http_hits
    index = data.draw(mutated_index(original, _sources(tmp, http)))
    modes = data.draw(
        st.tuples(
            st.sampled_from([0o644, 0o644, 0o644, 0o600, 0o664, 0o666]),
            st.sampled_from([0o755, 0o755, 0o755, 0o700, 0o775, 0o777, 0o1777]),
        )
    )
    dst = _reset(tmp, index, modes)
    before = files_below(tmp)
    with address_space_limit(HEADROOM):
        _operations(tmp, dst)
    new = {p for p in files_below(tmp) - before if not any(p.startswith(a) for a in ALLOWED)}
    assert not new, f"files written outside {ALLOWED}: {sorted(new)[:5]}"
    assert hits == [], f"the index's source was fetched over HTTP: {hits[:3]}"
    assert (
        not (dst / "a.bin").exists()
        or (dst / "a.bin").read_bytes() == (tmp / "lustre" / "src" / "a.bin").read_bytes()
    ), "a.bin was fetched from somewhere other than the source tier"
