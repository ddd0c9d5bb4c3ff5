"""The lean path's HTTP/1.1 client (fmstore.stores.http1) against a real loopback server
that answers exactly as each test scripts it: framing, kept-alive connections the server
drops, silences, broken answers.  SeaweedFS covers the ordinary answers (test_s3_lean,
test_store_s3, test_s3_faults); these are the answers it never gives."""

from __future__ import annotations

import asyncio

import pytest

from fmstore.stores.http1 import Pool, Sink


class Server:
    """Reads each request (head and ``content-length`` body) and lets ``answer(n, head,
    body, writer)`` reply; ``n`` counts requests across connections."""

    def __init__(self, answer, early=False, ssl=None):
        self.answer, self.early, self.ssl = answer, early, ssl
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if self.early:  # answer before reading the body, as a refusing server does
                    self.requests.append((head, b""))
                    await self.answer(len(self.requests), head, b"", writer)
                    await writer.drain()
                    await asyncio.sleep(0.2)
                    writer.close()
                    return
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                if await self.answer(len(self.requests), head, body, writer) == "close":
                    writer.close()
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ssl)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()


def pool(port, **kw):
    return Pool("127.0.0.1", port, limit=4, connect_timeout=5, read_timeout=kw.pop("rt", 10), **kw)


def go(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_content_length_body_in_many_pieces_and_keep_alive():
    body = bytes(range(256)) * 1000

    async def answer(n, head, req_body, w):
        msg = b'HTTP/1.1 200 OK\r\nETag: "e"\r\nContent-Length: %d\r\n\r\n' % len(body) + body
        for i in range(0, len(msg), 7000):  # the head itself split across writes
            w.write(msg[i : i + 7000])
            await w.drain()

    async def main():
        async with Server(answer) as s:
            p = pool(s.port)
            for _ in range(3):
                r = await p.request("GET", "/b/k", {"host": "x"})
                assert r.status == 200 and r.headers["etag"] == '"e"'
                assert r.body() == body and r.nbytes == len(body)
            await p.close()
            assert s.connections == 1  # kept alive across the three

    go(main())


def test_chunked_body_with_extensions_and_trailers():
    async def answer(n, head, body, w):
        w.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n"
            b"1\r\n \r\n"
            b"5\r\nworld\r\n"
            b"0\r\nX-Trailer: t\r\n\r\n"
        )

    async def main():
        async with Server(answer) as s:
            p = pool(s.port)
            assert (await p.request("GET", "/", {})).body() == b"hello world"
            assert (await p.request("GET", "/", {})).body() == b"hello world"
            await p.close()
            assert s.connections == 1

    go(main())


def test_head_and_interim_answers_have_no_body():
    async def answer(n, head, body, w):
        if head.startswith(b"HEAD"):
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 12345\r\n\r\n")
        else:
            w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")

    async def main():
        async with Server(answer) as s:
            p = pool(s.port)
            r = await p.request("HEAD", "/k", {})
            assert r.status == 200 and r.headers["content-length"] == "12345" and r.body() == b""
            r = await p.request("PUT", "/k", {}, b"data")
            assert r.status == 204
            assert s.requests[1][1] == b"data"
            await p.close()

    go(main())


def test_a_kept_alive_connection_the_server_dropped_is_replaced():
    """The server closes after each answer without saying so: the next request finds a
    dead connection before any answer, and goes again on a fresh one."""

    async def answer(n, head, body, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        return "close"

    async def main():
        async with Server(answer) as s:
            p = pool(s.port)
            for _ in range(3):
                await asyncio.sleep(0.05)  # let the close arrive first, now and then
                assert (await p.request("GET", "/", {})).body() == b"ok"
            await p.close()
            assert s.connections == 3

    go(main())


def test_a_request_the_server_drops_unanswered_on_a_reused_connection_goes_again():
    async def answer(n, head, body, w):
        if n == 2:
            return "close"  # idle timeout racing the request: no answer at all
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n%d" % n)

    async def main():
        async with Server(answer) as s:
            p = pool(s.port)
            assert (await p.request("PUT", "/", {}, b"a")).body() == b"1"
            assert (await p.request("PUT", "/", {}, b"b")).body() == b"3"
            assert [b for _, b in s.requests] == [b"a", b"b", b"b"]
            assert s.connections == 2
            await p.close()

    go(main())


def test_a_fresh_connection_dropped_unanswered_is_an_error():
    async def answer(n, head, body, w):
        return "close"

    async def main():
        async with Server(answer) as s:
            p = pool(s.port)
            with pytest.raises(ConnectionResetError, match="before a response"):
                await p.request("GET", "/", {})
            assert s.connections == 1
            await p.close()

    go(main())


def test_truncated_body_is_a_connection_error_not_a_short_answer():
    async def answer(n, head, body, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly-part")
        await w.drain()
        return "close"

    async def main():
        async with Server(answer) as s:
            p = pool(s.port)
            with pytest.raises(ConnectionResetError, match="before the response was complete"):
                await p.request("GET", "/", {})
            assert s.connections == 1  # answered in part: not sent again by the pool
            await p.close()

    go(main())


def test_silence_is_a_timeout():
    async def answer(n, head, body, w):
        await asyncio.sleep(30)

    async def main():
        async with Server(answer) as s:
            p = pool(s.port, rt=0.3)
            with pytest.raises(TimeoutError, match="no data from the server"):
                await p.request("GET", "/", {})
            await p.close()

    go(main())


def test_malformed_answer_is_a_connection_error():
    async def answer(n, head, body, w):
        w.write(b"SPDY/9 nonsense\r\n\r\n")

    async def main():
        async with Server(answer) as s:
            p = pool(s.port)
            with pytest.raises(ConnectionError, match="malformed HTTP response"):
                await p.request("GET", "/", {})
            await p.close()

    go(main())


def test_header_injection_is_refused_before_sending():
    async def answer(n, head, body, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    async def main():
        async with Server(answer) as s:
            p = pool(s.port)
            with pytest.raises(ValueError, match="line breaks"):
                await p.request("PUT", "/", {"x-amz-meta-a": "v\r\nx-evil: 1"}, b"")
            await p.close()
            assert s.requests == []

    go(main())


def test_dead_endpoint_is_a_connection_error():
    async def main():
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]  # bound, not listening: refused
            p = pool(port)
            with pytest.raises(ConnectionError):
                await p.request("GET", "/", {})
            await p.close()

    go(main())


def test_big_body_is_sent_in_slices_and_an_early_answer_stops_it():
    body = bytes(range(256)) * (12 << 12)  # 12 MiB: many slices

    async def echo_length(n, head, req_body, w):
        n = str(len(req_body)).encode()
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(n), n))

    async def refuse(n, head, req_body, w):
        w.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 6\r\n\r\ndenied")

    async def main():
        async with Server(echo_length) as s:
            p = pool(s.port)
            r = await p.request("PUT", "/", {}, memoryview(body))
            assert r.body() == str(len(body)).encode()
            assert s.requests[0][1] == body
            await p.close()
        async with Server(refuse, early=True) as s:
            p = pool(s.port)
            r = await p.request("PUT", "/", {}, memoryview(body))
            assert r.status == 403 and r.body() == b"denied"
            assert not p._idle  # the unsent rest makes the connection unusable
            await p.close()

    go(main())


def test_tls_round_trips_in_place_in_pieces_and_in_slices(tmp_path):
    """S3 is https in production: the same framing, in-place receives and sliced sends
    over TLS (a self-signed certificate made by the openssl command)."""
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost"],
        check=True,
        capture_output=True,
    )
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    data = bytes(range(256)) * (12 << 10)  # 3 MiB

    async def answer(n, head, req_body, w):
        body = data if head.startswith(b"GET") else str(len(req_body)).encode()
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    async def main():
        async with Server(answer, ssl=server_ctx) as s:
            p = Pool(
                "127.0.0.1",
                s.port,
                limit=2,
                connect_timeout=5,
                read_timeout=10,
                ssl=client_ctx,
                server_hostname="localhost",
            )
            out = bytearray(len(data) + 10)
            r = await p.request("GET", "/", {}, into=memoryview(out))
            assert r.filled and r.nbytes == len(data) and out[: len(data)] == data
            r = await p.request("GET", "/", {})
            assert not r.filled and r.body() == data
            r = await p.request("PUT", "/", {}, memoryview(data + data))
            assert r.body() == str(2 * len(data)).encode()
            assert s.connections == 1
            await p.close()

    go(main())


def _body_answer(body, status=b"206 Partial Content"):
    async def answer(n, head, req_body, w):
        msg = b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n" % (status, len(body)) + body
        for i in range(0, len(msg), 50_000):
            w.write(msg[i : i + 50_000])
            await w.drain()

    return answer


def test_sink_streams_through_its_ring_and_waits_for_slow_takes():
    body = bytes(range(251)) * 8000  # 2 MB: many rings of 64 KiB
    got: list[bytes] = []
    sizes: list[int] = []

    async def main():
        async with Server(_body_answer(body)) as s:
            p = pool(s.port)
            ring = memoryview(bytearray(64 << 10))

            def take(view):
                got.append(bytes(view))
                sizes.append(view.nbytes)

            r = await p.request("GET", "/", {}, sink=Sink(ring, take))
            assert r.status == 206 and r.nbytes == len(body) and r.body() == b""
            assert b"".join(got) == body and max(sizes) == len(ring)

            # A take that needs time: the connection reads nothing more meanwhile, and
            # is in order for the next request afterwards (reading resumed).
            got.clear()
            busy = []

            def slow(view):
                assert not busy  # never called again before the last one finished
                got.append(bytes(view))

                async def later():
                    busy.append(1)
                    await asyncio.sleep(0.002)
                    busy.pop()

                return later()

            r = await p.request("GET", "/", {}, sink=Sink(ring, slow))
            assert b"".join(got) == body
            r = await p.request("GET", "/", {})  # same connection, reading again
            assert r.body() == body
            assert s.connections == 1
            await p.close()

    go(main())


def test_sink_take_errors_fail_the_request_and_a_refused_body_comes_as_pieces():
    body = b"x" * 300_000
    seen = []

    async def main():
        async with Server(_body_answer(body)) as s:
            p = pool(s.port)
            ring = memoryview(bytearray(64 << 10))

            def broken(view):
                raise OSError(28, "No space left on device")

            with pytest.raises(OSError, match="No space"):
                await p.request("GET", "/", {}, sink=Sink(ring, broken))

            async def fails():
                raise ValueError("consumer gave up")

            with pytest.raises(ValueError, match="gave up"):
                await p.request("GET", "/", {}, sink=Sink(ring, lambda v: fails()))

            def refuse(status, headers):
                seen.append((status, headers["content-length"]))
                return False

            r = await p.request("GET", "/", {}, sink=Sink(ring, broken, refuse))
            assert r.body() == body and seen == [(206, str(len(body)))]
            await p.close()

    go(main())


def test_cancelled_request_waits_for_the_sinks_take_in_progress():
    body = b"y" * 200_000
    events = []

    async def main():
        async with Server(_body_answer(body)) as s:
            p = pool(s.port)
            started = asyncio.Event()

            def take(view):
                async def write():
                    events.append("take started")
                    started.set()
                    await asyncio.sleep(0.3)
                    events.append("take done")

                return write()

            task = asyncio.ensure_future(
                p.request("GET", "/", {}, sink=Sink(memoryview(bytearray(64 << 10)), take))
            )
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            events.append("request over")
            assert events == ["take started", "take done", "request over"]
            await p.close()

    go(main())


def test_sink_ring_must_hold_a_scratch_buffer():
    with pytest.raises(ValueError, match="ring"):
        Sink(memoryview(bytearray(1024)), lambda v: None)
