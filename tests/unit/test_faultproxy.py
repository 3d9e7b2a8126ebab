"""The fault-injecting proxy of the fault suite (support.faultproxy) does what it says:
forwards bytes both ways unchanged, delays by its latency, stalls without closing, resets
with a RST (seen as "connection reset", not as an EOF), refuses new connections, answers
S3's 503 SlowDown to exactly the next N HTTP requests, loses the answers of the next N
matching requests after forwarding them, answers itself the requests its ``check``
refuses and the next N requests that match an armed answer, and lists the request lines."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from support.faultproxy import SLOWDOWN_BODY, FaultProxy
from support.waiting import wait_until


class _Echo:
    """A TCP echo server on a free port, one thread per connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.peers: list[socket.socket] = []
        self.errors: list[OSError] = []  # what each connection ended with, if not an EOF
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.peers.append(conn)
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)  # an EOF for an EOF
        except OSError as exc:
            self.errors.append(exc)

    def close(self) -> None:
        self.sock.close()
        for peer in self.peers:
            peer.close()


@pytest.fixture
def echo() -> Iterator[_Echo]:
    server = _Echo()
    yield server
    server.close()


@pytest.fixture
def proxy(echo: _Echo) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", echo.port) as p:
        yield p


def _connect(proxy: FaultProxy, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        piece = sock.recv(n - len(out))
        assert piece, f"EOF after {len(out)} of {n} bytes"
        out += piece
    return out


def test_forwards_bytes_both_ways_unchanged(proxy: FaultProxy) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB, several chunks
    with _connect(proxy) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        assert _recv_exactly(sock, len(payload)) == payload
        sender.join()
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""  # the half-close went through and came back
    assert proxy.accepted == 1


def test_latency_delays_each_chunk(proxy: FaultProxy) -> None:
    with _connect(proxy) as sock:
        sock.sendall(b"warm")
        assert _recv_exactly(sock, 4) == b"warm"
        proxy.set_latency(0.2)
        start = time.monotonic()
        sock.sendall(b"slow")
        assert _recv_exactly(sock, 4) == b"slow"
        assert time.monotonic() - start >= 0.4  # 0.2 s on the way there and back
        proxy.set_latency(0)


def test_stall_keeps_the_connection_open_and_silent(proxy: FaultProxy) -> None:
    with _connect(proxy, timeout=0.5) as sock:
        proxy.stall()
        sock.sendall(b"held")
        with pytest.raises(TimeoutError):
            sock.recv(4)  # silence, not an EOF and not a reset
        proxy.resume()
        sock.settimeout(5)
        assert _recv_exactly(sock, 4) == b"held"


def test_reset_is_seen_as_a_reset_on_both_sides(proxy: FaultProxy, echo: _Echo) -> None:
    with _connect(proxy) as sock:
        sock.sendall(b"x")
        assert _recv_exactly(sock, 1) == b"x"
        assert proxy.reset() == 1
        with pytest.raises(ConnectionResetError):
            sock.recv(1)
    wait_until(lambda: echo.errors, 5, "the upstream's side ended")
    assert isinstance(echo.errors[0], ConnectionResetError), echo.errors
    wait_until(lambda: proxy.connections == 0, 5, "the proxy dropped the link")


def test_refuse_resets_new_connections_until_cleared(proxy: FaultProxy) -> None:
    proxy.refuse()
    # the reset may come on connect or on the first read
    with pytest.raises(ConnectionResetError), _connect(proxy) as sock:
        sock.sendall(b"x")
        sock.recv(1)
    proxy.clear()
    with _connect(proxy) as sock:
        sock.sendall(b"y")
        assert _recv_exactly(sock, 1) == b"y"


class _Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _upstream(got: list[bytes]) -> Iterator[int]:
    """An HTTP server on a free port (yielded) that echoes each PUT's body and records its
    path in ``got``."""

    class Recording(_Ok):
        def do_PUT(self) -> None:
            got.append(self.path.encode())
            super().do_PUT()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_slowdown_answers_the_next_n_requests_then_forwards() -> None:
    with _upstream([]) as port, FaultProxy("127.0.0.1", port, http=True) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        conn.request("PUT", "/b/k", body=b"before")  # forwarded, kept alive
        assert conn.getresponse().read() == b"before"
        proxy.slowdown(2)
        for _ in range(2):
            conn.request("PUT", "/b/k", body=b"throttled")
            response = conn.getresponse()
            assert response.status == 503
            assert response.getheader("Connection") == "close"
            assert response.read() == SLOWDOWN_BODY
            assert b"<Code>SlowDown</Code>" in SLOWDOWN_BODY
            conn.close()
        conn.request("PUT", "/b/k", body=b"after")
        assert conn.getresponse().read() == b"after"
        conn.close()
        assert (proxy.slowdowns_sent, proxy.requests) == (2, 4)


def test_check_answers_the_requests_it_refuses_and_forwards_the_others() -> None:
    """``check`` sees each request's head: what it refuses gets its answer (the body read
    and dropped, never forwarded), the rest goes to the upstream."""
    got: list[bytes] = []
    heads: list[bytes] = []

    def check(head: bytes) -> tuple[str, bytes] | None:
        heads.append(head)
        return ("403 Forbidden", b"<Error>no</Error>") if b"/refused" in head else None

    with _upstream(got) as port:
        with FaultProxy("127.0.0.1", port, http=True, check=check) as proxy:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
            conn.request("PUT", "/b/refused?x=1", body=b"dropped")
            response = conn.getresponse()
            assert (response.status, response.read()) == (403, b"<Error>no</Error>")
            assert response.getheader("Connection") == "close"
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
            conn.request("PUT", "/b/taken", body=b"kept")
            assert conn.getresponse().read() == b"kept"
            conn.close()
            assert (proxy.refused, proxy.requests) == (1, 2)
        assert got == [b"/b/taken"]
        assert heads[0].startswith(b"PUT /b/refused?x=1 HTTP/1.1\r\n")
        assert heads[0].endswith(b"\r\n\r\n")
    with pytest.raises(ValueError, match="http=True"):
        FaultProxy("127.0.0.1", 1, check=check)


def test_drop_answers_forwards_the_request_and_loses_its_answer() -> None:
    """The upstream gets the matching request whole; its answer never reaches the client,
    whose connection is reset; other requests, and the next ones, go through."""
    got: list[bytes] = []

    with _upstream(got) as port, FaultProxy("127.0.0.1", port, http=True) as proxy:
        proxy.drop_answers(b"/commit", 1)
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        conn.request("PUT", "/parts/a", body=b"part")  # not matching: forwarded
        assert conn.getresponse().read() == b"part"
        conn.request("PUT", "/commit", body=b"commit")
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            conn.getresponse().read()
        conn.close()
        assert got == [b"/parts/a", b"/commit"]  # the upstream did the work
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        conn.request("PUT", "/commit", body=b"again")  # asked again: answered
        assert conn.getresponse().read() == b"again"
        conn.close()
        assert proxy.answers_dropped == 1


def test_answer_makes_the_next_n_matching_requests_answers_and_lists_request_lines() -> None:
    """Only requests whose request line holds the marker get the armed answer (their body
    read and dropped, never forwarded), N of them; the others and the later ones go
    through; every request line is listed in order."""
    got: list[bytes] = []

    one, two = "/k?x&partNumber=1&y", "/k?x&partNumber=2&y"
    with _upstream(got) as port, FaultProxy("127.0.0.1", port, http=True) as proxy:
        proxy.answer(b"&partNumber=1&", 2, "500 Internal Server Error", b"<Error>i</Error>")
        answers = []
        for path in [two, one, one]:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
            conn.request("PUT", path, body=b"b")
            response = conn.getresponse()
            answers.append((response.status, response.read()))
            conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        conn.request("PUT", one, body=b"third")
        answers.append((conn.getresponse().status, b""))
        conn.close()
        assert answers == [
            (200, b"b"), (500, b"<Error>i</Error>"), (500, b"<Error>i</Error>"), (200, b"")
        ]  # fmt: skip
        assert proxy.answered == 2
        assert got == [two.encode(), one.encode()]
        lines = [f"PUT {p} HTTP/1.1".encode() for p in (two, one, one, one)]
        assert proxy.request_lines == lines
        proxy.answer(b"/k", 5, "503 Slow Down", SLOWDOWN_BODY)
        proxy.clear()  # disarms it
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        conn.request("PUT", "/k", body=b"clear")
        assert conn.getresponse().read() == b"clear"
        conn.close()
    with pytest.raises(ValueError, match="http=True"):
        FaultProxy("127.0.0.1", 1).answer(b"/", 1, "503 Slow Down", SLOWDOWN_BODY)
