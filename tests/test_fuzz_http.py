"""Fuzzing the lean path's HTTP/1.1 client with hostile answers from a real loopback server.

Each example builds a valid response (status line, headers, a body framed by
Content-Length, chunks or the close), mutates it (bytes flipped, inserted, deleted,
duplicated; framing tokens such as ``-6`` or ``0_3`` planted; the answer cut short) and
serves it.  Whatever the server sends, the client must answer with a correct parse or an
fmstore error, within a bounded time and bounded memory.  ``FMSTORE_FUZZ_EXAMPLES`` raises
the number of examples (default: a budget of a few seconds).
"""

from __future__ import annotations

import asyncio
import os
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fmstore.errors import FmstoreError
from fmstore.stores.http1 import MAX_ERROR_BODY, Pool

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(600)]

EXAMPLES = int(os.environ.get("FMSTORE_FUZZ_EXAMPLES", "400"))
#: Most memory one request may take: the parser allocates at most a 1 MiB piece of a body
#: ahead of its bytes, plus its 64 KiB buffers.
MEMORY_BOUND = 8 << 20

TOKENS = [
    b"-",
    b"_",
    b"+",
    b"\r\n",
    b"\n",
    b"\r",
    b"\r\n\r\n",
    b"\x00",
    b" ",
    b"\t",
    b":",
    b";",
    b"0",
    b"-6",
    b"0_3",
    b"ffffffffffffffffffff",
    b"7fffffff",
    b"HTTP/1.1 ",
    b"HTTP/1.0 200 OK\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Content-Length: 99999999\r\n",
    b"Content-Length: -1\r\n",
    b"Connection: close\r\n",
    b"0\r\n\r\n",
]
NAMES = ["ETag", "Content-Type", "x-amz-meta-a", "x-amz-request-id", "Server", "Date"]
STATUSES = [(200, "OK"), (206, "Partial Content"), (204, "No Content"), (304, "Not Modified")]
STATUSES += [(404, "Not Found"), (500, "Internal Error"), (503, "Slow Down"), (100, "Continue")]


@st.composite
def responses(draw: st.DrawFn) -> tuple[bytes, int, bytes]:
    """A valid answer: its bytes on the wire, status and body."""
    status, reason = draw(st.sampled_from(STATUSES))
    headers = draw(
        st.lists(
            st.tuples(st.sampled_from(NAMES), st.text("abcdefXYZ0123456789-_ ", max_size=20)),
            max_size=4,
        )
    )
    body = draw(st.binary(max_size=2000))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    prefix = b""
    if status == 100:  # an interim answer, then the real one
        prefix, (status, reason) = b"HTTP/1.1 100 Continue\r\n\r\n", (200, "OK")
    if status in (204, 304):
        body = b""
    head = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v.strip()}" for k, v in headers]
    if framing == "length":
        head.append(f"Content-Length: {len(body)}")
        payload = body
    elif framing == "chunked":
        head.append("Transfer-Encoding: chunked")
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        payload = b"".join(b"%x;e=1\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"
    else:
        head.append("Connection: close")
        payload = body
    if status in (204, 304):
        payload = b""
    wire = prefix + ("\r\n".join(head) + "\r\n\r\n").encode() + payload
    return wire, status, body


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, int, bytes, bool]:
    wire, status, body = draw(responses())
    ops = draw(st.lists(st.sampled_from(["flip", "insert", "delete", "dup", "cut"]), max_size=4))
    data = bytearray(wire)
    for op in ops:
        at = draw(st.integers(0, len(data)))
        if op == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.sampled_from(TOKENS) | st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif op == "dup":
            data[at:at] = data[at : at + draw(st.integers(1, 64))]
        elif op == "cut":
            del data[at:]
    return bytes(data), status, body, bool(ops)


async def _exchange(wire: bytes, method: str) -> object:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(wire)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool("127.0.0.1", port, limit=1, connect_timeout=5, read_timeout=5)
    try:
        return await asyncio.wait_for(pool.request(method, "/k", {"host": "x"}), 20)
    except FmstoreError as e:
        return e
    finally:
        await pool.close()
        server.close()


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=mutated(), head=st.booleans())
def test_any_answer_parses_or_fails_with_an_fmstore_error_in_bounded_time_and_memory(case, head):
    wire, status, body, changed = case
    method = "HEAD" if head else "GET"
    tracemalloc.start()
    try:
        got = asyncio.run(_exchange(wire, method))  # a hang fails: wait_for, not a stall
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, peak
    if isinstance(got, FmstoreError):
        assert changed, f"a valid answer was refused: {got!r}"
        return
    assert 100 <= got.status <= 999
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in got.headers.items())
    got_body = got.body()
    assert got.nbytes == len(got_body) <= len(wire)
    if not 200 <= got.status < 300:
        assert got.nbytes <= MAX_ERROR_BODY
    if not changed:
        assert got.status == status
        assert got_body == (b"" if head else body)
