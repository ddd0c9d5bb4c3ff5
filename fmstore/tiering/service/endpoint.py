"""The daemon's HTTP endpoint (``/metrics``, ``/healthz``), safe against slow clients.

The endpoint may listen on ``0.0.0.0``, where anyone can connect, and a liveness probe
that goes unanswered gets the pod killed, so no client may hold it up:

* one thread runs an event loop of its own; a connection is a coroutine, not a thread,
  and a slow one holds nothing but its socket;
* the whole request head (request line and headers) must arrive within
  :data:`HEAD_DEADLINE_S` of the connection being accepted, however it is dripped (a
  per-read timeout is renewed by every byte), and may be at most :data:`MAX_HEAD_BYTES`;
* at most :data:`MAX_CONNECTIONS` connections are open; a new one beyond that closes the
  oldest connection still sending its head, so a probe that sends its request at once is
  answered while slow clients hold every other slot (a per-address limit would not help:
  the probe and the attacker may share an address);
* every answer is ``HTTP/1.0`` and closes the connection, written within
  :data:`WRITE_DEADLINE_S`.

The routes are plain callables run on the endpoint's thread; they must be quick (the
daemon's are a Prometheus text dump and a small JSON status).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import threading
from collections.abc import Callable, Mapping

from ...errors import FmstoreError

#: The whole request head must arrive within this many seconds of the accept.
HEAD_DEADLINE_S = 10.0
#: Longest request head accepted; a longer one closes the connection.
MAX_HEAD_BYTES = 16 * 1024
#: Connections open at once; the oldest one still sending its head makes room.
MAX_CONNECTIONS = 64
#: An answer must be taken by the client within this many seconds.
WRITE_DEADLINE_S = 10.0

#: A route answers ``(status, content type, body)``.
Route = Callable[[], tuple[int, str, bytes]]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
}


class Endpoint:
    """An HTTP/1.0 GET server for a few fixed routes, on a thread of its own."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: Mapping[str, Route],
        *,
        head_deadline: float | None = None,
        max_connections: int | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.routes = dict(routes)
        # Read at construction, not at import, so the module's limits can be tuned.
        self.head_deadline = HEAD_DEADLINE_S if head_deadline is None else head_deadline
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        #: Open connections in accept order, with whether each is still sending its head.
        self._open: dict[asyncio.StreamWriter, bool] = {}
        self._changed = threading.Condition()

    # ---- life cycle --------------------------------------------------------------------

    def start(self) -> int:
        """Bind and serve; returns the port (the one picked when ``port`` was 0)."""
        started = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(
                        self._serve, self.host, self.port, limit=MAX_HEAD_BYTES, backlog=128
                    )
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as e:  # noqa: BLE001 (handed to the starting thread)
                failure.append(e)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                for w in list(self._open):
                    w.transport.abort()
                loop.run_until_complete(_cancel_the_rest())
                loop.close()

        self._thread = threading.Thread(target=main, name="fmstore-http", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            e = failure[0]
            hint = ""
            if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
                # Two daemons on one host (nodes tried on one machine): each needs a port.
                hint = (
                    "; another process (another node's daemon on this host?) has it: set "
                    "[daemon] port in this node's fmstore.toml, or --port (0 picks a free one)"
                )
            raise FmstoreError(
                f"the daemon's endpoint could not listen on {self.host}:{self.port}: {e}{hint}"
            ) from e
        return self.port

    def close(self) -> None:
        loop, server = self._loop, self._server
        if loop is None or server is None or loop.is_closed():
            return

        def stop() -> None:
            server.close()
            loop.stop()

        with contextlib.suppress(RuntimeError):  # already closed
            loop.call_soon_threadsafe(stop)
        if self._thread is not None:
            self._thread.join(30)

    # ---- observation (tests, diagnostics) ----------------------------------------------

    def open_connections(self) -> int:
        with self._changed:
            return len(self._open)

    def wait_open(self, n: int, timeout: float) -> bool:
        """Wait until ``n`` connections are open at once; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self._open) >= n, timeout)

    def _note(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # ---- one connection ----------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._changed:
            if len(self._open) >= self.max_connections:
                # Room for the newcomer: the oldest connection still sending its head.
                oldest = next((w for w, reading in self._open.items() if reading), None)
                if oldest is None:  # every slot is writing an answer; they end on their own
                    writer.transport.abort()
                    return
                del self._open[oldest]
                oldest.transport.abort()
            self._open[writer] = True
            self._changed.notify_all()
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.head_deadline)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                return  # too slow, too long, or gone: closed without an answer
            with self._changed:
                if writer not in self._open:
                    return
                self._open[writer] = False
            writer.write(self._answer(head))
            await asyncio.wait_for(writer.drain(), WRITE_DEADLINE_S)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            with self._changed:
                self._open.pop(writer, None)
                self._changed.notify_all()
            writer.close()

    def _answer(self, head: bytes) -> bytes:
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            status, ctype, body = 400, "text/plain", b"bad request\n"
        elif parts[0] != "GET":
            status, ctype, body = 405, "text/plain", b"only GET\n"
        else:
            route = self.routes.get(parts[1].split("?", 1)[0])
            if route is None:
                status, ctype, body = 404, "text/plain", b"not found\n"
            else:
                try:
                    status, ctype, body = route()
                except Exception as e:  # noqa: BLE001 (a route's failure is the answer)
                    status, ctype, body = 500, "text/plain", f"{type(e).__name__}\n".encode()
        return _response(status, ctype, body)


async def _cancel_the_rest() -> None:
    """Cancel and wait for every other task of the loop (connections still open)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _response(status: int, ctype: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.0 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n" + ("Allow: GET\r\n" if status == 405 else "") + "\r\n"
    )
    return head.encode("latin-1") + body
