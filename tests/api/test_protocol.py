"""The body-pieces protocol under a real uvicorn server: bodies arrive whole and in order."""

from __future__ import annotations

import gc
import hashlib
import http.client
import json
import os
import socket
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from ckptstore_service.api.protocol import PIECES, BodyPieces, BodyPiecesProtocol
from ckptstore_service.handoff import SealedBuffer
from support.serviceproc import free_port
from support.waiting import wait_until


def test_one_piece_is_passed_on_as_it_is() -> None:
    body = BodyPieces()
    piece = os.urandom(1000)
    body.append(piece)
    assert len(body) == 1000
    assert bytes(body) is piece  # no copy


def test_pieces_are_joined_in_order() -> None:
    body = BodyPieces()
    for piece in (b"ab", b"", b"cde"):
        body.append(piece)
    assert len(body) == 5
    assert bytes(body) == b"abcde"
    assert bytes(BodyPieces()) == b""


_RECEIVERS: list[weakref.ref[Any]] = []  # each /pieces request's receive, held weakly
_PIECE_TYPES: list[type] = []  # the type of every piece /pieces received


async def _echo_digest(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that answers each request with its body's SHA-256 and size; on path
    ``/pieces`` it receives the body through the protocol's pieces extension."""
    if scope["type"] != "http":
        return
    digest, size, more = hashlib.sha256(), 0, True
    take = scope["extensions"][PIECES]["receive"] if scope["path"] == "/pieces" else None
    if take is not None:
        _RECEIVERS.append(weakref.ref(take))
    while more:
        if take is not None:
            got = await take()
            if got is None:
                return  # the client left mid-body
            pieces, more = got
        else:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left mid-body
            assert message["type"] == "http.request"
            pieces, more = [message["body"]], message.get("more_body", False)
        for piece in pieces:
            if take is None:
                assert isinstance(piece, bytes)  # ASGI's receive: bytes, as the spec says
            else:
                assert memoryview(piece).readonly
                # a view of a buffer the server never writes again: passed on uncopied
                assert isinstance(piece, bytes) or isinstance(piece.obj, SealedBuffer)
                _PIECE_TYPES.append(type(piece))
            digest.update(piece)
            size += len(piece)
    out = json.dumps({"sha256": digest.hexdigest(), "size": size}).encode()
    headers = [(b"content-length", str(len(out)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def server(request: pytest.FixtureRequest) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        _echo_digest,
        host="127.0.0.1",
        port=port,
        http=BodyPiecesProtocol,
        loop=request.param,
        log_level="error",
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_until(lambda: srv.started, 10, "uvicorn started", interval=0.01)
    yield port
    srv.should_exit = True
    thread.join(10)


def _post(port: int, body: bytes, *, chunked: bool, path: str = "/") -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        if chunked:
            pieces = (body[i : i + 100_000] for i in range(0, len(body), 100_000))
            conn.request("POST", path, body=pieces, encode_chunked=True)
        else:
            conn.request("POST", path, body=body)
        response = conn.getresponse()
        assert response.status == 200
        result: dict[str, Any] = json.loads(response.read())
        return result
    finally:
        conn.close()


@pytest.mark.parametrize("path", ["/", "/pieces"])
@pytest.mark.parametrize("size", [0, 1, 65_537, 3_000_001])
@pytest.mark.parametrize("chunked", [False, True])
def test_bodies_arrive_whole(server: int, size: int, chunked: bool, path: str) -> None:
    body = os.urandom(size)
    got = _post(server, body, chunked=chunked, path=path)
    assert got == {"sha256": hashlib.sha256(body).hexdigest(), "size": size}


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_with_a_length_is_read_into_the_protocols_buffers(
    server: int, chunked: bool
) -> None:
    # its bytes after the first read (which holds the headers) land in the buffers the
    # protocol offers the event loop, as views of them; a chunked body's are copied out
    _PIECE_TYPES.clear()
    body = os.urandom(3_000_001)
    assert _post(server, body, chunked=chunked, path="/pieces")["size"] == len(body)
    assert (memoryview in _PIECE_TYPES) is not chunked
    assert set(_PIECE_TYPES) <= {bytes, memoryview}


def _answers(sock: socket.socket, count: int) -> list[dict[str, Any]]:
    """The JSON bodies of ``count`` answers read from ``sock`` (each with a Content-Length)."""
    data, out = b"", []
    while len(out) < count:
        head, sep, rest = data.partition(b"\r\n\r\n")
        length = None
        if sep:
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
        if length is not None and len(rest) >= length:
            out.append(json.loads(rest[:length]))
            data = rest[length:]
            continue
        more = sock.recv(65536)
        assert more, "connection closed before the answers"
        data += more
    return out


@pytest.mark.parametrize("path", ["/", "/pieces"])
def test_a_request_sent_right_after_a_body_is_parsed_on_its_own(server: int, path: str) -> None:
    # the body's end and the next request's head arrive in one read: the protocol passes
    # the body on without the parser, so the next request must reach a fresh parser whole
    first, second = os.urandom(700_001), os.urandom(5)
    requests = [
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        for body in (first, second)
    ]
    with socket.create_connection(("127.0.0.1", server), timeout=30) as sock:
        sock.sendall(requests[0][:1000])  # the head and the body's start
        sock.sendall(requests[0][1000:] + requests[1])  # its rest and the next request
        answers = _answers(sock, 2)
    assert [a["sha256"] for a in answers] == [
        hashlib.sha256(first).hexdigest(),
        hashlib.sha256(second).hexdigest(),
    ]


def test_requests_on_one_connection_keep_their_bodies_apart(server: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    try:
        for size in (200_000, 10, 1_000_000):
            body = os.urandom(size)
            conn.request("POST", "/", body=body)
            response = conn.getresponse()
            assert json.loads(response.read())["sha256"] == hashlib.sha256(body).hexdigest()
    finally:
        conn.close()


def test_expect_100_continue(server: int) -> None:
    body = os.urandom(300_000)
    with socket.create_connection(("127.0.0.1", server), timeout=30) as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body)
        answer = b""
        while b"}" not in answer:
            data = sock.recv(65536)
            assert data, "connection closed before the answer"
            answer += data
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["sha256"] == hashlib.sha256(body).hexdigest()


def test_a_client_that_leaves_mid_body_does_not_disturb_the_next(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server), timeout=30) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
        sock.sendall(os.urandom(400_000))  # then gone
    body = os.urandom(500_000)
    assert _post(server, body, chunked=False)["sha256"] == hashlib.sha256(body).hexdigest()


def _raw(port: int, *sends: bytes, answers: int) -> list[dict[str, Any]]:
    """What ``sends``, written one after the other on one connection, are answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for data in sends:
            sock.sendall(data)
        return _answers(sock, answers)


def test_an_upgrade_requests_body_is_left_to_the_parser(server: int) -> None:
    # httptools skips the body of a request asking for an upgrade (here one the server does
    # not do), so it must not be counted as the body's bytes: they would be the next
    # request's first ones
    upgrade = (
        b"POST /pieces HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
        b"Content-Length: 5\r\n\r\nhello"
    )
    body = os.urandom(1000)
    after = f"POST /pieces HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server), timeout=30) as sock:
        sock.sendall(upgrade)
        _answers(sock, 1)
        sock.sendall(after.encode() + body)
        [answer] = _answers(sock, 1)
    assert answer["sha256"] == hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize("path", ["/", "/pieces"])
def test_bytes_after_a_last_requests_body_are_ignored(server: int, path: str) -> None:
    # Connection: close: the parser ignores what follows the body (as uvicorn's does); a
    # fresh parser would answer it with a 400 before the request's own answer
    body = os.urandom(300_000)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    request = head.encode() + body
    [answer] = _raw(server, request[:1000], request[1000:] + b"garbage\r\n\r\n", answers=1)
    assert answer["sha256"] == hashlib.sha256(body).hexdigest()


def test_a_finished_request_is_freed_without_the_garbage_collector(server: int) -> None:
    # the cycle holds the scope, which holds the pieces' receive: that must not hold the
    # cycle back, or every request (its body pieces too) waits for a full gc pass
    _RECEIVERS.clear()
    gc.disable()
    try:
        body = os.urandom(100_000)
        assert _post(server, body, chunked=False, path="/pieces")["size"] == len(body)
        wait_until(
            lambda: all(r() is None for r in _RECEIVERS) and bool(_RECEIVERS),
            10,
            "the request's receive freed once its connection closed",
            interval=0.01,
        )
    finally:
        gc.enable()
