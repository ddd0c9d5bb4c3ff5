"""A fault-injecting HTTP/1.1 proxy on loopback, for testing S3 clients against real faults.

:class:`FaultProxy` sits between a client and an S3 server (SeaweedFS in the tests) and
forwards requests and responses byte for byte, except where its *plan* says otherwise:

* ``slowdown`` / ``error``: answer ``503 SlowDown`` (or ``500 InternalError``) with a
  proper S3 XML error body, without contacting the server;
* ``redirect``: answer ``301 PermanentRedirect`` (the bucket lives in another region, as
  AWS says it), likewise;
* ``error_200``: answer ``200 OK`` with an ``InternalError`` document as its body, likewise:
  S3 does that for a CompleteMultipartUpload (or a copy) that fails after it began to
  answer;
* ``reset``: forward the request, then send the response head and part of its body and
  reset the connection (RST);
* ``truncate``: the same, but end with an orderly close, so ``Content-Length`` promised
  more than arrived;
* ``stall``: forward the request and hold the response back for ``delay`` seconds
  (longer than the client's read timeout), or with ``after_bytes`` set, stall in the
  middle of the body;
* ``pause``: stop the response body after ``after_bytes`` for ``delay`` seconds, then send
  the rest (a slow link, or a client that gave up still receiving);
* ``reset_request``: read the request head and part of its body, then reset, so an
  upload dies mid-body and never reaches the server;
* ``corrupt_request`` / ``corrupt_response``: flip one bit in the middle of the request
  (or response) body and forward it, as a bad NIC or proxy would;
* ``strip_checksums``: forward the response without its ``x-amz-checksum-*`` headers, as
  a server without flexible checksums would answer.
* ``answer``: answer ``200 OK`` with the rule's ``answer(method, path)`` as an XML body,
  without contacting the server (a hostile listing page: :mod:`.s3pages`).

Rules match by method and path (a regular expression), fire with a probability
(``rate``) and/or a fixed number of times (``times``), and can be changed at runtime with
:meth:`FaultProxy.set_plan`, :meth:`FaultProxy.add` and :meth:`FaultProxy.clear`.
:meth:`FaultProxy.down` stops listening (connections are refused, as when S3 is down)
and :meth:`FaultProxy.up` listens again on the same port.  Counters: ``requests`` (seen,
and each one's arrival time, method, path, ``Range`` header, status and response body
bytes in ``seen``; ``calls``: each one's method and path, with
query) and ``injected`` (per fault kind); a test sums what a client fetched per object with
:meth:`FaultProxy.fetched`.  The proxy runs its own
event loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType

FAULTS = (
    "slowdown",
    "error",
    "redirect",
    "error_200",
    "reset",
    "truncate",
    "stall",
    "pause",
    "reset_request",
    "corrupt_request",
    "corrupt_response",
    "strip_checksums",
    "answer",
)
_MAX_HEAD = 64 * 1024
_CONTENT_RANGE = re.compile(r"\s*bytes\s+(\d+)-\d+/")


#: The faults the proxy answers itself, without contacting the server: status, reason,
#: S3 error code and message.
_ANSWERS = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "error": (
        500,
        "Internal Server Error",
        "InternalError",
        "We encountered an internal error. Please try again.",
    ),
    "error_200": (
        200,
        "OK",
        "InternalError",
        "We encountered an internal error. Please try again.",
    ),
    "redirect": (
        301,
        "Moved Permanently",
        "PermanentRedirect",
        "The bucket you are attempting to access must be addressed using the specified endpoint.",
    ),
}


@dataclass
class Rule:
    """One entry of a fault plan.

    ``fault``: one of :data:`FAULTS`.  ``method`` / ``path``: only requests with this
    method and a path (with query) matching this regular expression.  ``times``: fire at
    most this many times (None: unlimited).  ``rate``: probability of firing on a
    matching request.  ``after_bytes``: for ``reset`` / ``truncate`` / ``stall`` /
    ``reset_request`` / ``pause``, how many body bytes pass before the fault (None: half
    the body).  ``delay``: seconds a ``stall`` or a ``pause`` lasts.  ``skip``: the first
    ``skip`` matching requests pass untouched before the rule fires (a test that must
    interrupt a run after N requests stalls every later one, so the run cannot finish
    first however fast the machine is).  ``answer``: the body of an ``answer`` fault.
    """

    fault: str
    method: str | None = None
    path: str | None = None
    times: int | None = None
    rate: float = 1.0
    after_bytes: int | None = None
    delay: float = 3600.0
    skip: int = 0
    answer: Callable[[str, str], bytes] | None = None

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; choose from {', '.join(FAULTS)}")

    def matches(self, method: str, path: str) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.method is not None and self.method.upper() != method:
            return False
        return self.path is None or re.search(self.path, path) is not None


@dataclass
class Seen:
    """One request the proxy received: ``method``, ``path`` (with query), the ``Range``
    header asked for (None: the whole object), and the response's ``status``, ``body``
    bytes passed to the client and the object offset they start at (``Content-Range`` of a
    206; 0 otherwise).  Status and body stay 0 while it is under way or when none was sent.
    """

    method: str
    path: str
    range: str | None
    status: int = 0
    body: int = 0
    start: int = 0
    #: ``time.perf_counter()`` when the request's head arrived (a benchmark times a
    #: client's start-up up to its first request with it).
    at: float = 0.0

    @property
    def key(self) -> str:
        """The path without its query, percent-decoded (``/bucket/key`` in path style)."""
        return urllib.parse.unquote(self.path.split("?", 1)[0])

    @property
    def served(self) -> tuple[int, int]:
        """``[start, end)`` of the object's bytes the client was sent."""
        return self.start, self.start + self.body


@dataclass(frozen=True)
class RangeTally:
    """What clients read of bytes ``[lo, hi)`` of one object: ``gets``, the answered GETs
    touching them; ``bytes`` of them sent (a byte sent twice counts twice); ``once``: the
    pieces sent cover them exactly, every byte once."""

    gets: int
    bytes: int
    once: bool


def tally(seen: Iterable[Seen], lo: int, hi: int) -> RangeTally:
    """:class:`RangeTally` of ``[lo, hi)`` from one object's requests (see
    :meth:`FaultProxy.fetched`)."""
    pieces = sorted(
        (max(a, lo), min(b, hi))
        for a, b in (s.served for s in seen if s.method == "GET" and s.status in (200, 206))
        if a < hi and b > lo
    )
    at, once = lo, True
    for a, b in pieces:
        once = once and a == at
        at = max(at, b)
    return RangeTally(len(pieces), sum(b - a for a, b in pieces), once and at == hi)


@dataclass
class _Head:
    first: bytes
    headers: list[tuple[str, str]]

    def get(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def without(self, name: str) -> _Head:
        name = name.lower()
        return _Head(self.first, [(k, v) for k, v in self.headers if k.lower() != name])

    def encode(self) -> bytes:
        lines = [self.first] + [f"{k}: {v}".encode("latin-1") for k, v in self.headers]
        return b"\r\n".join(lines) + b"\r\n\r\n"


async def _read_head(reader: asyncio.StreamReader) -> _Head | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial.strip():
            raise ConnectionError("connection closed inside an HTTP head") from e
        return None
    except asyncio.LimitOverrunError as e:
        raise ConnectionError("HTTP head too large") from e
    lines = raw[:-4].split(b"\r\n")
    headers = []
    for line in lines[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        headers.append((k.strip(), v.strip()))
    return _Head(lines[0], headers)


def _slowdown_body(code: str, message: str, path: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{path}</Resource><RequestId>faultproxy</RequestId></Error>"
    ).encode()


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset instead of an orderly FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Fault(Exception):
    """Raised inside a connection handler to end the connection after a fault."""


class FaultProxy:
    """See the module docstring.  ``FaultProxy(upstream_url)`` then use ``endpoint_url``."""

    def __init__(self, upstream_url: str, *, seed: int = 0) -> None:
        m = re.match(r"^https?://([^:/]+):(\d+)", upstream_url)
        if not m:
            raise ValueError(f"upstream must be http://host:port, not {upstream_url!r}")
        self.upstream = (m.group(1), int(m.group(2)))
        self.port = 0
        self.requests = 0
        #: Every request in arrival order (see :class:`Seen`).
        self.seen: list[Seen] = []
        self.injected: collections.Counter[str] = collections.Counter()
        self._rules: list[Rule] = []
        self._rules_lock = threading.Lock()
        self._random = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()

    # ---- plan ---------------------------------------------------------------------------

    def set_plan(self, rules: Iterable[Rule]) -> None:
        """Replace the whole plan."""
        with self._rules_lock:
            self._rules = list(rules)

    def add(self, rule: Rule) -> None:
        with self._rules_lock:
            self._rules.append(rule)

    def clear(self) -> None:
        """No more faults: forward everything."""
        self.set_plan([])

    @property
    def calls(self) -> list[tuple[str, str]]:
        """(method, path with query) of every request, in arrival order."""
        return [(x.method, x.path) for x in self.seen]

    def fetched(self, method: str = "GET") -> dict[str, list[Seen]]:
        """The answered ``method`` requests by object (:attr:`Seen.key`), in arrival order:
        a test sums their ``body`` bytes to see how often each object was read."""
        out: dict[str, list[Seen]] = {}
        for s in list(self.seen):
            if s.method == method and s.status:
                out.setdefault(s.key, []).append(s)
        return out

    def _pick(self, method: str, path: str) -> Rule | None:
        with self._rules_lock:
            for rule in self._rules:
                if rule.matches(method, path) and rule.skip > 0:
                    rule.skip -= 1
                    return None
                if rule.matches(method, path) and self._random.random() < rule.rate:
                    if rule.times is not None:
                        rule.times -= 1
                    self.injected[rule.fault] += 1
                    return rule
        return None

    # ---- lifecycle ----------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        if self._thread is not None:
            return self
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=main, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        self.up()
        return self

    def _run(self, coro: object, timeout: float = 10.0) -> object:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    def up(self) -> None:
        """Listen (again, on the same port after :meth:`down`)."""

        async def listen() -> None:
            if self._server is not None:
                return
            self._server = await asyncio.start_server(
                self._handle, "127.0.0.1", self.port, reuse_address=True, limit=_MAX_HEAD
            )
            self.port = self._server.sockets[0].getsockname()[1]

        self._run(listen())

    def down(self) -> None:
        """Stop listening and drop every open connection: clients get refused connections."""

        async def close() -> None:
            server, self._server = self._server, None
            if server is not None:
                server.close()
                await server.wait_closed()
            for t in list(self._conns):
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)

        self._run(close())

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        with contextlib.suppress(Exception):
            self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- one client connection ----------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await _read_head(reader)
                if head is None:
                    return
                self.requests += 1
                parts = head.first.decode("latin-1").split(" ")
                method, path = parts[0].upper(), parts[1] if len(parts) > 1 else "/"
                seen = Seen(method, path, head.get("range"), at=time.perf_counter())
                self.seen.append(seen)
                rule = self._pick(method, path)
                if rule is not None and rule.fault in _ANSWERS:
                    await self._answer_error(writer, rule.fault, path)
                    return
                if rule is not None and rule.fault == "answer" and rule.answer is not None:
                    await self._answer(writer, 200, "OK", rule.answer(method, path))
                    return
                if (head.get("expect") or "").lower() == "100-continue":
                    # Answer the client's Expect ourselves; the server gets the body at once.
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                    head = head.without("expect")
                if rule is not None and rule.fault == "reset_request":
                    await self._partial_request(reader, head, rule)
                    _rst(writer)
                    return
                if up is None:
                    up = await asyncio.open_connection(*self.upstream, limit=_MAX_HEAD)
                ur, uw = up
                uw.write(head.encode())
                if (
                    rule is not None
                    and rule.fault == "corrupt_request"
                    and head.get("content-length")
                ):
                    body = bytearray(await reader.readexactly(int(head.get("content-length") or 0)))
                    if body:
                        body[len(body) // 2] ^= 0x01
                    uw.write(body)
                else:
                    await _relay_body(reader, uw, head, request=True, method=method)
                await uw.drain()
                resp = await _read_head(ur)
                if resp is None:
                    raise ConnectionError("server closed the connection")
                keep = await self._respond(ur, writer, resp, method, rule, seen)
                if not keep:
                    return
        except (ConnectionError, OSError, asyncio.IncompleteReadError, _Fault):
            return
        except asyncio.CancelledError:
            # down() or stop(): end quietly (a cancelled handler task gets logged).
            _rst(writer)
            return
        finally:
            self._conns.discard(task)
            if up is not None:
                up[1].transport.abort()
            if not writer.transport.is_closing():
                writer.close()

    async def _answer_error(self, writer: asyncio.StreamWriter, fault: str, path: str) -> None:
        status, reason, code, msg = _ANSWERS[fault]
        await self._answer(writer, status, reason, _slowdown_body(code, msg, path.split("?")[0]))

    async def _answer(
        self, writer: asyncio.StreamWriter, status: int, reason: str, body: bytes
    ) -> None:
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(ConnectionError, OSError):
            await writer.drain()

    async def _partial_request(self, reader: asyncio.StreamReader, head: _Head, rule: Rule) -> None:
        length = int(head.get("content-length") or 0)
        n = rule.after_bytes if rule.after_bytes is not None else length // 2
        with contextlib.suppress(asyncio.IncompleteReadError):
            await reader.readexactly(min(n, length))

    async def _respond(
        self,
        ur: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        resp: _Head,
        method: str,
        rule: Rule | None,
        seen: Seen,
    ) -> bool:
        """Forward one response, applying ``rule``; True when the connection stays usable."""
        status = int(resp.first.split(b" ")[1])
        m = _CONTENT_RANGE.match(resp.get("content-range") or "")
        seen.start = int(m.group(1)) if m and status == 206 else 0
        if rule is not None and rule.fault == "strip_checksums":
            resp = _Head(
                resp.first,
                [(k, v) for k, v in resp.headers if not k.lower().startswith("x-amz-checksum-")],
            )
        if rule is None or rule.fault in ("corrupt_request", "strip_checksums"):
            writer.write(resp.encode())
            seen.body = await _relay_body(
                ur, writer, resp, request=False, method=method, status=status
            )
            await writer.drain()
            seen.status = status
            return (resp.get("connection") or "").lower() != "close"
        if rule.fault == "stall" and rule.after_bytes is None:
            await asyncio.sleep(rule.delay)
            raise _Fault()
        # Buffer the body so the fault lands at an exact byte position.
        body = await _read_body(ur, resp, method=method, status=status)
        if rule.fault == "corrupt_response":
            out = resp.without("transfer-encoding").without("content-length")
            out.headers.append(("Content-Length", str(len(body))))
            flipped = bytearray(body)
            if flipped:
                flipped[len(flipped) // 2] ^= 0x01
            writer.write(out.encode() + flipped)
            await writer.drain()
            seen.status, seen.body = status, len(flipped)
            return (resp.get("connection") or "").lower() != "close"
        cut = rule.after_bytes if rule.after_bytes is not None else len(body) // 2
        cut = min(cut, max(len(body) - 1, 0))
        out = resp.without("transfer-encoding").without("content-length")
        out.headers.append(("Content-Length", str(len(body))))
        if body:  # with no body to cut, the fault hits before the response head
            writer.write(out.encode() + body[:cut])
            await writer.drain()
            seen.status, seen.body = status, cut
        if rule.fault == "stall":
            await asyncio.sleep(rule.delay)
            raise _Fault()
        if rule.fault == "pause":
            await asyncio.sleep(rule.delay)
            writer.write(body[cut:])
            await writer.drain()
            seen.body = len(body)
            return (resp.get("connection") or "").lower() != "close"
        if rule.fault == "reset":
            _rst(writer)
        else:  # truncate: an orderly close, short of Content-Length
            writer.close()
        raise _Fault()


async def _relay_body(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter,
    head: _Head,
    *,
    request: bool,
    method: str,
    status: int = 0,
) -> int:
    """Copy one message body from ``src`` to ``dst`` as it arrives; returns its length
    (de-chunked)."""
    if not request and (method == "HEAD" or status in (204, 304) or 100 <= status < 200):
        return 0
    te = (head.get("transfer-encoding") or "").lower()
    n = 0
    if "chunked" in te:
        while True:
            line = await src.readuntil(b"\r\n")
            dst.write(line)
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the final blank line
                    trailer = await src.readuntil(b"\r\n")
                    dst.write(trailer)
                    if trailer == b"\r\n":
                        return n
            dst.write(await src.readexactly(size + 2))
            n += size
            await dst.drain()
    cl = head.get("content-length")
    if cl is not None:
        left = int(cl)
        while left:
            chunk = await src.read(min(left, 1 << 20))
            if not chunk:
                raise ConnectionError("body ended early")
            dst.write(chunk)
            left -= len(chunk)
            n += len(chunk)
            await dst.drain()
        return n
    if request:
        return 0
    while chunk := await src.read(1 << 20):  # body delimited by the server closing
        dst.write(chunk)
        n += len(chunk)
        await dst.drain()
    return n


async def _read_body(src: asyncio.StreamReader, head: _Head, *, method: str, status: int) -> bytes:
    """Read one whole response body (de-chunked)."""
    if method == "HEAD" or status in (204, 304):
        return b""
    te = (head.get("transfer-encoding") or "").lower()
    if "chunked" in te:
        out = bytearray()
        while True:
            size = int((await src.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while await src.readuntil(b"\r\n") != b"\r\n":
                    pass
                return bytes(out)
            out += (await src.readexactly(size + 2))[:-2]
    cl = head.get("content-length")
    if cl is not None:
        return await src.readexactly(int(cl))
    return await src.read()
