"""The daemon's HTTP endpoint under slow and silent clients (slowloris).

Every wait is bounded by an event (the server closing a socket, a count of open connections,
an answer arriving); the long timeouts only turn a hang into a failure.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import urllib.request

from tiering_helpers import posix_config

from fmstore.tiering.service import endpoint as ep
from fmstore.tiering.service.daemon import Daemon, DaemonSettings
from fmstore.tiering.service.endpoint import Endpoint

HANG = 60.0  # turns a hang into a failure; never reached when the endpoint works


def _closed_by_server(s: socket.socket) -> bool:
    """Block until the server closes ``s`` (EOF or reset); False if it answered instead."""
    s.settimeout(HANG)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _drip(socks: list[socket.socket], stop: threading.Event, every: float = 0.05) -> None:
    """Send each socket one more byte of an endless request head, again and again."""
    head = b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 100_000
    i = 0
    while not stop.wait(every):
        for s in socks:
            with contextlib.suppress(OSError):
                s.send(head[i : i + 1])
        i += 1


def test_healthz_is_answered_while_dripping_clients_hold_every_slot(tmp_path, monkeypatch):
    """24 connections dripping a request head (faster than any per-read timeout) against
    16 slots: the probe still gets its answer, because a newcomer closes the oldest
    connection still sending its head."""
    monkeypatch.setattr(ep, "MAX_CONNECTIONS", 16)
    d = Daemon(posix_config(str(tmp_path), {}), settings=DaemonSettings(port=0, interval=0.1))
    port = d.start_http()
    assert d.server is not None
    stop = threading.Event()
    socks = [socket.create_connection(("127.0.0.1", port), timeout=HANG) for _ in range(24)]
    dripper = threading.Thread(target=_drip, args=(socks, stop), daemon=True)
    dripper.start()
    try:
        assert d.server.wait_open(16, HANG)  # every slot is held by a dripping client
        for _ in range(3):  # the probe, repeatedly, while the drip goes on
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=HANG).read()
            assert json.loads(body)["status"] == "ok"
        assert d.server.open_connections() <= 16
    finally:
        stop.set()
        dripper.join(HANG)
        for s in socks:
            s.close()
        d.close()


def test_a_dripped_request_head_is_cut_at_its_deadline_not_renewed_by_each_byte():
    server = Endpoint(
        "127.0.0.1", 0, {"/": lambda: (200, "text/plain", b"hi\n")}, head_deadline=0.5
    )
    port = server.start()
    stop = threading.Event()
    s = socket.create_connection(("127.0.0.1", port), timeout=HANG)
    dripper = threading.Thread(target=_drip, args=([s], stop, 0.02), daemon=True)
    dripper.start()
    try:
        assert _closed_by_server(s)  # a byte every 20 ms, yet closed at the head's deadline
    finally:
        stop.set()
        dripper.join(HANG)
        s.close()
        server.close()


def test_silent_and_oversized_heads_are_closed_and_answers_are_one_per_connection():
    server = Endpoint(
        "127.0.0.1", 0, {"/x": lambda: (200, "text/plain", b"x\n")}, head_deadline=0.5
    )
    port = server.start()
    try:
        silent = socket.create_connection(("127.0.0.1", port), timeout=HANG)
        big = socket.create_connection(("127.0.0.1", port), timeout=HANG)
        big.sendall(b"GET /x HTTP/1.1\r\nX: " + b"a" * (ep.MAX_HEAD_BYTES + 10) + b"\r\n\r\n")
        assert _closed_by_server(silent)
        assert _closed_by_server(big)
        silent.close()
        big.close()

        def ask(req: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=HANG) as c:
                c.sendall(req)
                out = b""
                while chunk := c.recv(65536):
                    out += chunk
                return out

        assert ask(b"GET /x?a=1 HTTP/1.1\r\nHost: h\r\n\r\n").endswith(b"\r\n\r\nx\n")
        assert ask(b"GET /nope HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 404 ")
        assert ask(b"POST /x HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 405 ")
        assert ask(b"garbage\r\n\r\n").startswith(b"HTTP/1.0 400 ")
        assert server.open_connections() == 0
    finally:
        server.close()


def test_a_port_in_use_names_the_setting_that_gives_each_daemon_its_own():
    import pytest

    from fmstore.errors import FmstoreError

    first = Endpoint("127.0.0.1", 0, {})
    port = first.start()
    try:
        with pytest.raises(FmstoreError) as e:
            Endpoint("127.0.0.1", port, {}).start()
        assert "address already in use" in str(e.value).lower()
        assert "[daemon] port" in str(e.value) and "--port" in str(e.value), e.value
    finally:
        first.close()
