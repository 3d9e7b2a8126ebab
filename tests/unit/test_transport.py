"""``ckptstore.Transport`` against a raw socket server: what goes on the wire."""

from __future__ import annotations

import json
import socket
import threading

from ckptstore import Transport


def _serve_once(server: socket.socket, answer: bytes, got: list[bytes]) -> None:
    """Accept one connection, read the request until its body ends, answer ``answer``."""
    conn, _ = server.accept()
    with conn:
        data = b""
        while not data.endswith(b"0\r\n\r\n") and b"Content-Length: 0" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        got.append(data)
        conn.sendall(answer)


def test_a_body_of_unknown_length_is_sent_chunked() -> None:
    body = json.dumps({"ok": True}).encode()
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    got: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        thread = threading.Thread(target=_serve_once, args=(server, answer, got), daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        with Transport(url, retries=0) as transport:
            pieces = [b"abc", b"", memoryview(b"0123456789abcdef")]
            assert transport.send("PUT", "/x", iter(pieces), None) == {"ok": True}
        thread.join(10)
    head, _, sent = got[0].partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head and b"Content-Length" not in head
    assert sent == b"3\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n"  # no empty chunk inside
