"""A small HTTP/1.1 client for the lean S3 request path (:mod:`.s3.lean`).

S3's hot calls need very little of HTTP: one request, one response with a
``Content-Length`` (or, for listings and errors, a chunked body), kept-alive connections.
aiohttp's general client spends about 0.3 ms of CPU on each such request (request and
response objects, multidicts, stream readers, tracing hooks); for the 4 KiB objects of a
dataset that is most of the cost of a copy.  :class:`Pool` does only what S3 needs, on an
:class:`asyncio.Protocol`: a request is its head and body (one buffer or pieces, never
joined), the response head is split by hand, and the body arrives as the pieces the
socket delivered (big GETs hand them to ``pwritev``).

Errors are fmstore's (:class:`~fmstore.errors.StoreUnavailable`) and also the built-in ones
the retrier already knows: ``ConnectionError`` subclasses for refused, reset and truncated
connections and for answers that break HTTP/1.1, ``TimeoutError`` for a connect or a
silence longer than the read timeout.  A certificate that fails verification is
:class:`CertificateError`, never retried.  Proxies are not handled: :mod:`.s3.lean` leaves
those to botocore.

The server is not trusted: status line, header lines, ``Content-Length`` and chunk-size
lines are parsed strictly (a plain decimal, strict hex), every line and head is bounded, a
chunked or close-delimited body is bounded, and an error answer's body is cut at
:data:`MAX_ERROR_BODY` (the connection is then dropped).  Nothing a server sends can make
the client loop without reading, or buffer more than these bounds.
"""

from __future__ import annotations

import asyncio
import collections
import re
import socket
import ssl as _ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..errors import FmstoreError, InvalidKey, StoreUnavailable
from .types import Pieces, views_of

#: A kept-alive connection idle longer than this is closed rather than reused (servers
#: close theirs after a few seconds to a minute; aiohttp's default is 15 s too).
KEEPALIVE_S = 15.0
#: Response heads larger than this are refused (S3's are about 1 KiB).
_MAX_HEAD = 64 << 10
#: Each connection's buffer for heads and small bodies.  Small, so that a big body's first
#: read brings little of it along to be copied: the rest is received in place.
_SCRATCH = 64 << 10
#: Request bodies up to this size go out with their head in one send.
_COALESCE = 64 << 10
#: Bigger request bodies are written in slices of this size.
_SLICE = 1 << 20
#: Bodies of known length are received in pieces of at most this size.
_PIECE = 1 << 20

#: An error answer's body is kept up to this size; the rest is not read (the connection
#: is dropped): S3's error documents are well under 1 KiB.
MAX_ERROR_BODY = 64 << 10
#: A successful chunked or close-delimited body (listings: S3's are about 250 KiB for
#: 1000 keys) larger than this is refused.
MAX_CHUNKED_BODY = 64 << 20
#: Longest chunk-size line (size, extensions) or trailer section accepted.
_MAX_LINE = 4096

Buffer = bytes | bytearray | memoryview
_STATUS = re.compile(r"HTTP/1\.([01]) ([1-9][0-9]{2})(?: ([\t\x20-\x7e\x80-\xff]*))?")
_DECIMAL = re.compile(r"[0-9]{1,18}")
#: A chunk-size line: hex digits (at most 15: under 2**60), optional extensions.
_CHUNK = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[\t\x20-\x7e\x80-\xff]*)?")
#: What a request header's name and value may hold (no CR, LF or NUL: header injection).
_NAME_OK = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VALUE_BAD = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class ProtocolError(StoreUnavailable):
    """The server's answer breaks HTTP/1.1 (or a bound of ours); the connection is dropped."""


class ConnectionClosed(StoreUnavailable, ConnectionResetError):
    """The server closed the connection before its answer was complete."""


class Timeout(StoreUnavailable, TimeoutError):
    """No connection, or no byte of the answer, within the time allowed."""


class Unresolvable(StoreUnavailable):
    """The server's host name (``host``) did not resolve."""

    host = ""


class CertificateError(FmstoreError):
    """The server's TLS certificate failed verification (misconfiguration or attack)."""


def check_header(name: str, value: str) -> None:
    """Refuse a request header that would break the request's framing (CR, LF, NUL: header
    injection) or is no HTTP token; raises :class:`~fmstore.errors.InvalidKey`."""
    if not _NAME_OK.fullmatch(name):
        raise InvalidKey(f"header name {name!r} is not an HTTP token")
    if _VALUE_BAD.search(value):
        raise InvalidKey(f"header {name!r}: line breaks and control characters are not allowed")


def _fields(lines: list[str]) -> dict[str, str]:
    """Header lines as a dict (names lower-cased; a repeated name keeps its last value,
    but ``Content-Length`` and ``Transfer-Encoding`` may not differ between repeats)."""
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not _NAME_OK.fullmatch(name):
            raise ValueError(f"bad header line {line[:80]!r}")
        value = value.strip(" \t")
        if _VALUE_BAD.search(value):
            raise ValueError(f"bad header value in {line[:80]!r}")
        name = name.lower()
        if name in ("content-length", "transfer-encoding") and headers.get(name, value) != value:
            raise ValueError(f"conflicting {name} headers")
        headers[name] = value
    return headers


class Response:
    """One response: status, reason, headers (names lower-cased) and body: its pieces, or
    ``filled`` when it went into the caller's buffer (see :meth:`Pool.request`)."""

    __slots__ = ("status", "reason", "headers", "pieces", "nbytes", "filled")

    def __init__(self, status: int, reason: str, headers: dict[str, str]) -> None:
        self.status, self.reason, self.headers = status, reason, headers
        self.pieces: list[bytes | bytearray] = []
        self.nbytes = 0
        self.filled = False

    def body(self) -> bytes:
        return b"".join(self.pieces)


class Sink:
    """Where a streamed 2xx body goes (see :meth:`Pool.request`).

    The body is received into ``ring`` and handed to ``take`` each time the ring is full
    and at the body's end, so it passes through a few hundred KiB that stay in the CPU's
    cache rather than through memory the size of the body.  ``take`` returns None when it
    is done with the bytes, or an awaitable: nothing more is received until it completes.
    What ``take`` raises (or its awaitable) fails the request.  ``accept``, when given,
    sees the status and headers first; a body it refuses comes back as pieces.
    """

    __slots__ = ("ring", "take", "accept")

    def __init__(
        self,
        ring: memoryview,
        take: Callable[[memoryview], Awaitable[None] | None],
        accept: Callable[[int, Mapping[str, str]], bool] | None = None,
    ) -> None:
        if ring.nbytes < _SCRATCH:
            raise ValueError(f"a sink's ring must hold at least {_SCRATCH} bytes")
        self.ring, self.take, self.accept = ring, take, accept


class _Conn(asyncio.BufferedProtocol):
    """One connection; carries one request at a time.

    A buffered protocol, so that a body of known length is received straight where it
    goes (``recv_into``): into the caller's buffer, or into pieces of up to 1 MiB allocated
    at their exact size.  Heads and other bytes land in a scratch buffer first.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._buf = bytearray()  # head bytes, or a chunked body, not yet parsed
        self._resp: Response | None = None
        self._waiter: asyncio.Future[Response] | None = None
        self._head_only = False
        self._left = 0  # body bytes still expected; -1: until close; -2: chunked
        self._limit = MAX_ERROR_BODY  # most bytes of a chunked or close-delimited body
        self._keep = True
        self._progress = False
        self._paused: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.received = False  # any byte of the current response
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._into: memoryview | None = None  # where the caller wants a 2xx body
        self._fill: memoryview | None = None  # the current body's place in ``_into``
        self._pos = 0
        self._chunk: bytearray | None = None  # the piece being received
        self._sink: Sink | None = None  # where the caller streams a 2xx body
        self._taking: asyncio.Future[None] | None = None  # the sink's unfinished take

    # ---- protocol callbacks -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        if self._waiter is not None and not self._waiter.done():
            if self._resp is not None and self._left == -1 and exc is None:
                self._finish()  # a body delimited by the close
            else:
                err = ConnectionClosed(
                    "connection closed before the response was complete"
                    if self.received
                    else "connection closed before a response"
                )
                if exc is not None:
                    err.__cause__ = exc
                self._waiter.set_exception(err)

    def pause_writing(self) -> None:
        if self._paused is None or self._paused.done():
            self._paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._resp is not None and self._left > 0:
            if self._fill is not None:
                return self._fill[self._pos : self._pos + self._left]
            if self._chunk is None:
                self._chunk = bytearray(min(self._left, _PIECE))
                self._pos = 0
            return memoryview(self._chunk)[self._pos :]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        resp = self._resp
        if resp is None or self._left <= 0:
            self.data_received(bytes(self._scratch[:nbytes]))
            return
        # Body bytes, received in place (``_left`` bounded the buffer: never past the body).
        self._progress = True
        self._pos += nbytes
        self._left -= nbytes
        resp.nbytes += nbytes
        if self._sink is not None and self._fill is not None:
            self._to_sink()
            return
        if self._chunk is not None and self._pos == len(self._chunk):
            resp.pieces.append(self._chunk)
            self._chunk = None
        if self._left == 0:
            self._finish()

    def data_received(self, data: bytes) -> None:
        self._progress = self.received = True
        if self._waiter is None or self._waiter.done():
            self._keep = False  # bytes nobody asked for: the connection is out of step
            return
        try:
            if self._resp is None:
                self._buf += data
                self._parse_head()
            else:
                self._body(data)
        except ValueError as e:
            self._keep = False
            self._waiter.set_exception(ProtocolError(f"malformed HTTP response: {e}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close; connection_lost settles the waiter

    # ---- parsing ------------------------------------------------------------------------

    def _parse_head(self) -> None:
        while self._resp is None:
            end = self._buf.find(b"\r\n\r\n", 0, _MAX_HEAD)
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    raise ValueError("response head too large")
                return
            text = self._buf[:end].decode("latin-1")
            rest = bytes(self._buf[end + 4 :])
            self._buf.clear()
            first, *lines = text.split("\r\n")
            m = _STATUS.fullmatch(first)
            if m is None:
                raise ValueError(f"bad status line {first[:80]!r}")
            minor, status, reason = m.group(1), int(m.group(2)), m.group(3) or ""
            headers = _fields(lines)
            cl = headers.get("content-length")
            if cl is not None and not _DECIMAL.fullmatch(cl):
                raise ValueError(f"bad Content-Length {cl[:40]!r}")
            if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
                if status == 101:
                    raise ValueError("the server switched protocols")
                self._buf += rest
                continue
            self._resp = Response(status, reason, headers)
            ok = 200 <= status < 300
            self._limit = MAX_CHUNKED_BODY if ok else MAX_ERROR_BODY
            conn = headers.get("connection", "").lower()
            if conn == "close" or (minor == "0" and conn != "keep-alive"):
                self._keep = False
            te = headers.get("transfer-encoding")
            if self._head_only or status in (204, 304):
                self._left = 0
            elif te is not None:
                if te.lower() != "chunked":
                    raise ValueError(f"unsupported Transfer-Encoding {te[:40]!r}")
                if cl is not None:
                    raise ValueError("both Transfer-Encoding and Content-Length")
                self._left = -2
            elif cl is not None:
                self._left = int(cl)
                if not ok and self._left > MAX_ERROR_BODY:
                    # Only the start of an error answer is read; the connection is dropped.
                    self._left, self._keep = MAX_ERROR_BODY, False
            else:
                self._left, self._keep = -1, False
            into, sink = self._into, self._sink
            if ok and self._left > 0:
                if sink is not None:
                    if sink.accept is None or sink.accept(status, headers):
                        self._fill, self._pos, self._resp.filled = sink.ring, 0, True
                elif into is not None and self._left <= into.nbytes:
                    self._fill, self._pos, self._resp.filled = into[: self._left], 0, True
            if self._left == 0:
                self._keep = self._keep and not rest
                self._finish()
            elif rest:
                self._body(rest)

    def _body(self, data: bytes) -> None:
        if self._left >= 0:
            self._take(data)
        elif self._left == -1:
            assert self._resp is not None
            room = self._limit - self._resp.nbytes
            cut = len(data) > room
            if cut:
                self._over_limit()
                data = data[:room]
            self._resp.pieces.append(data)
            self._resp.nbytes += len(data)
            if cut:
                self._finish()
        else:
            self._buf += data
            self._parse_chunks()

    def _over_limit(self) -> None:
        """A body past its bound: an error answer is cut there (and the connection dropped);
        a successful one is refused."""
        assert self._resp is not None
        if 200 <= self._resp.status < 300:
            raise ValueError(f"body larger than {self._limit} bytes")
        self._keep = False

    def _take(self, data: bytes) -> None:
        assert self._resp is not None
        n = len(data)
        if n > self._left:  # bytes past the body: the server is out of step
            data, n, self._keep = data[: self._left], self._left, False
        if self._fill is not None:
            self._fill[self._pos : self._pos + n] = data
            self._pos += n
        else:
            self._resp.pieces.append(data)
        self._resp.nbytes += n
        self._left -= n
        if self._sink is not None and self._fill is not None:
            self._to_sink()  # the ring holds at least the scratch buffer: ``data`` fitted
        elif self._left == 0:
            self._finish()

    def _to_sink(self) -> None:
        """Hand the ring to the sink once it is full or the body complete."""
        assert self._sink is not None and self._fill is not None
        if self._pos < self._fill.nbytes and self._left > 0:
            return
        view, self._pos = self._fill[: self._pos], 0
        try:
            pending = self._sink.take(view)
        except Exception as e:
            self._fail(e)
            return
        if pending is None:
            if self._left == 0:
                self._finish()
            return
        assert self.transport is not None
        self.transport.pause_reading()  # the ring is the sink's until it is done
        self._taking = asyncio.ensure_future(pending)
        self._taking.add_done_callback(self._taken)

    def _taken(self, fut: asyncio.Future[None]) -> None:
        self._taking = None
        self._progress = True
        if self._waiter is None or self._waiter.done() or self.closed:
            return  # the request failed meanwhile; the connection is closed
        err: BaseException | None = (
            ConnectionClosed("the body's consumer was cancelled")
            if fut.cancelled()
            else fut.exception()
        )
        if err is not None:
            self._fail(err)
            return
        assert self.transport is not None
        self.transport.resume_reading()  # for the rest of the body, or the next response
        if self._left == 0:
            self._finish()

    def _fail(self, err: BaseException) -> None:
        self._keep = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(err)
        self.close()

    def _parse_chunks(self) -> None:
        resp = self._resp
        assert resp is not None
        buf = self._buf
        pos = 0  # start of what is not yet consumed
        try:
            while True:
                line_end = buf.find(b"\r\n", pos, pos + _MAX_LINE + 2)
                if line_end < 0:
                    if len(buf) - pos > _MAX_LINE:
                        raise ValueError("chunk-size line too long")
                    return
                m = _CHUNK.fullmatch(buf, pos, line_end)
                if m is None:
                    line = bytes(buf[pos:line_end])[:40]
                    raise ValueError(f"bad chunk-size line {line!r}")
                size = int(m.group(1), 16)
                start = line_end + 2
                if size == 0:
                    # Trailer lines (rare, ignored) end with an empty line, as the last chunk.
                    end = buf.find(b"\r\n\r\n", line_end, line_end + _MAX_HEAD)
                    if end < 0:
                        if len(buf) - line_end > _MAX_HEAD:
                            raise ValueError("chunked trailer too large")
                        return
                    pos = len(buf)
                    self._keep = self._keep and end + 4 == len(buf)
                    self._finish()
                    return
                room = self._limit - resp.nbytes
                if size > room:
                    self._over_limit()  # an error answer: keep what fits, then stop
                    if len(buf) - start < room:
                        return
                    resp.pieces.append(bytes(buf[start : start + room]))
                    resp.nbytes += room
                    pos = len(buf)
                    self._finish()
                    return
                if len(buf) < start + size + 2:
                    return
                if buf[start + size : start + size + 2] != b"\r\n":
                    raise ValueError("chunk data not followed by CRLF")
                resp.pieces.append(bytes(buf[start : start + size]))
                resp.nbytes += size
                pos = start + size + 2
        finally:
            del buf[:pos]

    def _finish(self) -> None:
        resp, self._resp = self._resp, None
        self._fill = self._into = self._chunk = self._sink = None
        assert resp is not None and self._waiter is not None
        if not self._waiter.done():
            self._waiter.set_result(resp)

    # ---- one exchange -------------------------------------------------------------------

    async def exchange(
        self,
        head: bytes,
        body: list[memoryview],
        head_only: bool,
        read_timeout: float,
        into: memoryview | None,
        sink: Sink | None = None,
    ) -> Response:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        self._head_only, self._resp, self._left, self.received = head_only, None, 0, False
        self._into, self._fill, self._chunk, self._sink = into, None, None, sink
        self._buf.clear()
        self._progress = False
        self._timer = loop.call_later(read_timeout, self._check_silence, read_timeout)
        try:
            n = sum(v.nbytes for v in body)
            if 0 < n <= _COALESCE:
                self.transport.write(b"".join((head, *body)))  # one send
            else:
                self.transport.write(head)
                for view in body:
                    await self._send_body(view)
            resp = await self._waiter
        except BaseException:
            # Aborting stops every further receive at once: nothing more lands in ``into``
            # once the caller has seen the request fail.
            self._keep = False
            self.close()
            if self._taking is not None:
                # The sink is still busy with the ring: once the request has failed,
                # nothing of it may still be under way.
                await asyncio.wait([self._taking])
            raise
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._waiter = None
            self._fill = self._into = self._chunk = self._sink = None
        if self.transport.get_write_buffer_size():
            self._keep = False  # answered before our body was sent: the stream is out of step
        return resp

    async def _send_body(self, view: memoryview) -> None:
        """Write a big body slice by slice, each once the socket took the last: what the
        socket cannot take at once is copied into the transport's buffer, so a body written
        whole would be copied almost whole (and into fresh memory)."""
        assert self.transport is not None and self._waiter is not None
        for pos in range(0, view.nbytes, _SLICE):
            if self._paused is not None and not self._paused.done():
                await asyncio.shield(self._paused)
            if self.closed or self._waiter.done():
                self._keep = False  # answered (an error) or gone before the body was sent
                return
            self.transport.write(view[pos : pos + _SLICE])
            self._progress = True  # the server is taking the body: not a silence
        if self._paused is not None and not self._paused.done():
            await asyncio.shield(self._paused)

    def _check_silence(self, timeout: float) -> None:
        if self._waiter is None or self._waiter.done():
            return
        if self._progress:
            self._progress = False
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(timeout, self._check_silence, timeout)
            return
        self._waiter.set_exception(Timeout(f"no data from the server for {timeout:g} s"))
        self.close()

    def reusable(self) -> bool:
        t = self.transport
        return self._keep and not self.closed and t is not None and not t.is_closing()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Pool:
    """Kept-alive connections to one origin, at most ``limit`` at a time."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        limit: int,
        connect_timeout: float,
        read_timeout: float,
        ssl: _ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        socket_factory: Callable[[Any], Any] | None = None,
    ) -> None:
        self.host, self.port = host, port
        self._limit = asyncio.Semaphore(limit) if limit > 0 else None
        self._connect_timeout, self._read_timeout = connect_timeout, read_timeout
        self._ssl, self._server_hostname = ssl, server_hostname
        self._socket_factory = socket_factory
        self._idle: collections.deque[_Conn] = collections.deque()
        self._busy: set[_Conn] = set()
        self._closed = False

    async def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: Buffer | Pieces | None = None,
        *,
        into: memoryview | None = None,
        sink: Sink | None = None,
        resend: bool = True,
    ) -> Response:
        """Send one request and read its whole response.  ``body``: a buffer, or pieces sent
        one after the other, never joined.  ``into``: a successful (2xx) body that fits goes
        there, in place (``filled``); any other body comes back as pieces.  ``sink``: a
        successful body of known length is streamed to it instead (see :class:`Sink`);
        once this returns or raises, nothing more goes to either, and no ``take`` runs.

        A kept-alive connection the server closed while idle fails before any byte of the
        answer arrives; such a request is sent once more on a new connection, unless
        ``resend`` is False (a call whose retries the caller must see)."""
        parts = [f"{method} {target} HTTP/1.1\r\n"]
        for k, v in headers.items():
            check_header(k, v)
            parts.append(f"{k}: {v}\r\n")
        views = views_of(body or b"")
        n = sum(v.nbytes for v in views)
        if n or method in ("PUT", "POST"):
            parts.append(f"content-length: {n}\r\n")
        parts.append("\r\n")
        head = "".join(parts).encode("utf-8")
        head_only = method == "HEAD"
        if self._limit is not None:
            await self._limit.acquire()
        try:
            while True:
                conn, reused = await self._connection()
                self._busy.add(conn)
                try:
                    resp = await conn.exchange(
                        head, views, head_only, self._read_timeout, into, sink
                    )
                except ConnectionError:
                    if resend and reused and not conn.received:
                        continue  # a stale kept-alive connection: once more on a fresh one
                    raise
                finally:
                    self._busy.discard(conn)
                    if conn.reusable() and not self._closed:
                        conn.idle_since = time.monotonic()
                        self._idle.append(conn)
                    else:
                        conn.close()
                return resp
        finally:
            if self._limit is not None:
                self._limit.release()

    async def _connection(self) -> tuple[_Conn, bool]:
        if self._closed:
            raise StoreUnavailable("the connection pool is closed")
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to be stale
            if conn.reusable() and now - conn.idle_since < KEEPALIVE_S:
                return conn, True
            conn.close()
        return await self._connect(), False

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()

        async def connect() -> _Conn:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            last: BaseException | None = None
            for info in infos:
                if self._socket_factory is not None:
                    sock = self._socket_factory(info)
                else:
                    sock = socket.socket(info[0], info[1], info[2])
                try:
                    sock.setblocking(False)
                    await loop.sock_connect(sock, info[4])
                    _, proto = await loop.create_connection(
                        _Conn, sock=sock, ssl=self._ssl, server_hostname=self._server_hostname
                    )
                    return proto
                except BaseException as e:
                    sock.close()
                    if not isinstance(e, OSError):
                        raise
                    last = e
            raise last or StoreUnavailable(f"cannot resolve {self.host}")

        try:
            return await asyncio.wait_for(connect(), self._connect_timeout)
        except asyncio.TimeoutError:
            raise Timeout(
                f"connecting to {self.host}:{self.port} took over {self._connect_timeout:g} s"
            ) from None
        except _ssl.SSLCertVerificationError as e:
            raise CertificateError(
                f"TLS certificate of {self.host}:{self.port} failed verification: "
                f"{e.verify_message or e}; not retried (AWS_CA_BUNDLE names a CA to trust)"
            ) from e
        except FmstoreError:
            raise
        except socket.gaierror as e:
            (err := Unresolvable(f"cannot resolve {self.host}: {e}")).host = self.host
            raise err from e
        except OSError as e:
            raise StoreUnavailable(f"cannot connect to {self.host}:{self.port}: {e}") from e

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._idle) + list(self._busy):
            conn.close()
        self._idle.clear()
