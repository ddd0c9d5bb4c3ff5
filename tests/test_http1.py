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


def test_a_call_that_must_not_be_resent_fails_on_a_dropped_reused_connection():
    """``resend=False`` (starting or completing a multipart upload): the caller's retry
    must see the failure, so the request is not sent again behind its back."""

    async def answer(n, head, body, w):
        if n == 2:
            return "close"
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n%d" % n)

    async def main():
        async with Server(answer) as s:
            p = pool(s.port)
            assert (await p.request("POST", "/", {}, b"a", resend=False)).body() == b"1"
            with pytest.raises(ConnectionResetError):
                await p.request("POST", "/", {}, b"b", resend=False)
            assert [b for _, b in s.requests] == [b"a", b"b"]
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


def _self_signed(tmp_path):
    """A self-signed certificate for localhost (made by the openssl command) and a server
    context holding it."""
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
    return cert, server_ctx


def test_tls_round_trips_in_place_in_pieces_and_in_slices(tmp_path):
    """S3 is https in production: the same framing, in-place receives and sliced sends
    over TLS (a self-signed certificate made by the openssl command)."""
    import ssl

    cert, server_ctx = _self_signed(tmp_path)
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


# ---- hostile servers: strict framing, bounded bodies --------------------------------------


def _hostile(answer_bytes: bytes):
    async def answer(n, head, body, w):
        w.write(answer_bytes)

    return answer


def _refused(answer_bytes: bytes, match: str) -> None:
    from fmstore.errors import FmstoreError
    from fmstore.stores.http1 import ProtocolError

    async def main():
        async with Server(_hostile(answer_bytes)) as s:
            p = pool(s.port)
            with pytest.raises(ProtocolError, match=match) as e:
                await asyncio.wait_for(p.request("GET", "/", {}), 10)
            assert isinstance(e.value, FmstoreError) and isinstance(e.value, ConnectionError)
            await p.close()

    go(main())


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "answer, match",
    [
        (CHUNKED + b"-6\r\nhello\r\n0\r\n\r\n", "bad chunk-size line"),
        (CHUNKED + b"0_3\r\nabc\r\n0\r\n\r\n", "bad chunk-size line"),
        (CHUNKED + b"+3\r\nabc\r\n0\r\n\r\n", "bad chunk-size line"),
        (CHUNKED + b" 3\r\nabc\r\n0\r\n\r\n", "bad chunk-size line"),
        (CHUNKED + b"3\r\nabcXY0\r\n\r\n", "not followed by CRLF"),
        (CHUNKED + b"1" * 100_000, "chunk-size line too long"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0_3\r\n\r\nabc", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: +3\r\n\r\nabc", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n\r\nabc", "bad Content-Length"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
            "conflicting content-length",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
            "both Transfer-Encoding and Content-Length",
        ),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "unsupported Transfer-Encoding"),
        (b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n", "bad status line"),
        (b"HTTP/1.1 20 OK\r\nContent-Length: 0\r\n\r\n", "bad status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad header line"),
        (b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded\r\n\r\n", "bad header line"),
        (b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n", "bad header value"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000, "response head too large"),
    ],
)
def test_malformed_framing_is_refused_at_once(answer, match):
    _refused(answer, match)


def test_a_chunked_success_body_past_the_bound_is_refused(monkeypatch):
    from fmstore.stores import http1

    monkeypatch.setattr(http1, "MAX_CHUNKED_BODY", 1 << 20)
    chunk = b"x" * (256 << 10)
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8))
    _refused(CHUNKED + body + b"0\r\n\r\n", "body larger than")


@pytest.mark.parametrize("framing", ["chunked", "content-length", "close"])
def test_a_huge_error_body_is_cut_and_the_connection_dropped(framing):
    """A 100 MiB error answer: the first 64 KiB are kept, the rest never read."""
    from fmstore.stores.http1 import MAX_ERROR_BODY

    total = 100 << 20
    piece = b"e" * (1 << 20)

    async def answer(n, head, body, w):
        if framing == "chunked":
            w.write(b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % total)
        elif framing == "content-length":
            w.write(b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\n\r\n" % total)
        else:
            w.write(b"HTTP/1.1 500 Oops\r\n\r\n")
        try:
            for _ in range(total // len(piece)):
                w.write(piece)
                await w.drain()
        except ConnectionError:
            pass
        return "close"

    async def main():
        async with Server(answer) as s:
            p = pool(s.port)
            r = await asyncio.wait_for(p.request("GET", "/", {}), 30)
            assert r.status == 500 and r.nbytes == MAX_ERROR_BODY == len(r.body())
            assert not p._idle  # the rest of the answer is not read: the connection is gone
            await p.close()

    go(main())


def test_an_unverified_certificate_fails_at_once_and_is_not_retried(tmp_path):
    import ssl

    from fmstore.errors import FmstoreError, StoreUnavailable
    from fmstore.stores import open_store
    from fmstore.stores.http1 import CertificateError

    cert, server_ctx = _self_signed(tmp_path)
    hellos: list[str] = []  # TLS handshakes begun (a failed one never reaches the server)
    server_ctx.sni_callback = lambda _sock, name, _ctx: hellos.append(name)

    async def main():
        async with Server(
            _hostile(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"), ssl=server_ctx
        ) as s:
            p = Pool(
                "localhost",
                s.port,
                limit=2,
                connect_timeout=5,
                read_timeout=5,
                ssl=ssl.create_default_context(),
                server_hostname="localhost",
            )
            with pytest.raises(CertificateError, match="failed verification"):
                await asyncio.wait_for(p.request("GET", "/", {}), 10)
            await p.close()
            return s

    go(main())

    # Through the store and its retrier: one attempt, an fmstore error that says why.
    async def through_store():
        async with Server(
            _hostile(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"), ssl=server_ctx
        ) as s:
            store = open_store(
                "s3://bucket/p",
                endpoint_url=f"https://localhost:{s.port}",
                region="us-east-1",
                access_key="a",
                secret_key="b",
                addressing_style="path",
                max_attempts=5,
                retry_base_delay=0.01,
            )
            try:
                with pytest.raises(FmstoreError) as e:
                    await asyncio.wait_for(store.get("k"), 30)
                assert not isinstance(e.value, StoreUnavailable), e.value
                assert "certificate" in str(e.value).lower()
            finally:
                await store.close()

    hellos.clear()
    runtime_run(through_store())
    assert hellos == ["localhost"]


def runtime_run(coro):
    from fmstore import runtime

    return runtime.run(coro)


LISTING = (
    b'<?xml version="1.0" encoding="UTF-8"?>'
    b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">%s'
    b'<Contents><Key>a+b%%2Bc</Key><Size>1</Size><ETag>"e"</ETag>'
    b"<LastModified>2024-01-01T00:00:00.000Z</LastModified></Contents>"
    b"<CommonPrefixes><Prefix>p+q/</Prefix></CommonPrefixes>"
    b"<IsTruncated>false</IsTruncated></ListBucketResult>"
)


@pytest.mark.parametrize(
    "encoding, key, prefix",
    [(b"", "a+b%2Bc", "p+q/"), (b"<EncodingType>url</EncodingType>", "a b+c", "p q/")],
)
def test_listing_keys_are_decoded_only_when_the_server_encoded_them(encoding, key, prefix):
    from fmstore.stores.s3.lean import Credentials
    from fmstore.stores.s3.lean import LeanTransport as S3Http

    doc = LISTING % encoding

    async def answer(n, head, body, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(doc), doc))

    async def main():
        async with Server(answer) as s:
            h = _lean(s.port, S3Http, Credentials)
            out = await asyncio.wait_for(h.list_objects_v2(Bucket="b", Prefix=""), 10)
            assert [c["Key"] for c in out["Contents"]] == [key]
            assert [c["Prefix"] for c in out["CommonPrefixes"]] == [prefix]
            await h.close()

    go(main())


def _lean(port, S3Http, Credentials):
    return S3Http(
        endpoint_url=f"http://127.0.0.1:{port}",
        region="us-east-1",
        bucket="b",
        path_style=True,
        credentials=lambda: Credentials("a", "b", None),
        sign_payload=False,
        pool=2,
        connect_timeout=5,
        read_timeout=5,
    )


@pytest.mark.parametrize(
    "meta",
    [{"k": "v\r\nx-evil: 1"}, {"k\r\nx-evil": "v"}, {"k": "v\nx"}, {"k": "a\x00b"}, {"a b": "v"}],
)
def test_metadata_that_would_inject_headers_is_refused_before_sending(meta):
    from fmstore.errors import InvalidKey
    from fmstore.stores.s3.lean import Credentials
    from fmstore.stores.s3.lean import LeanTransport as S3Http

    async def main():
        async with Server(_hostile(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")) as s:
            h = _lean(s.port, S3Http, Credentials)
            with pytest.raises(InvalidKey):
                await h.put_object(Bucket="b", Key="k", Body=b"x", Metadata=meta)
            await h.close()
            assert s.requests == []

    go(main())
