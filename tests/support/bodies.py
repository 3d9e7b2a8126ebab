"""Safetensors bodies built by hand, sent over raw HTTP, and what a rejected one must leave.

For the tests that talk to a real service below the client: bad input (headers that lie,
bodies cut short, clients that hang up) and the exact bytes a save streams.

Building: ``framed`` puts any header (JSON or raw bytes) behind its length prefix;
``valid_body`` and ``client_body`` build valid ones (a layout of placeholder bytes, or the
exact body ``CheckpointClient.save`` streams for a state); ``W``/``B`` are the entries of
the two-tensor layout ``TENSORS`` that most malformed cases start from.

Sending: ``partial_upload`` and ``chunked_upload`` write a request on a raw socket and leave
it open (a client that stalls or hangs up), ``read_response`` reads the answer,
``wait_consumed`` waits until the service has read every byte sent, ``uploading`` lists
the uploads it has begun; ``client_for`` and ``post`` go through one keep-alive httpx
client per service.

Checking: ``assert_error`` (status, JSON error code and message), ``assert_nothing_stored``
(invariant 6: no run, no checkpoint, no blob), ``stored_data`` (the data section served).
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx

from ckptstore_core.wire import FORMAT, Header, encode_header
from support.serviceproc import Service
from support.waiting import wait_until

__all__ = [
    "B",
    "TENSORS",
    "W",
    "assert_error",
    "assert_nothing_stored",
    "chunked",
    "chunked_upload",
    "client_body",
    "client_for",
    "close_clients",
    "data_for",
    "framed",
    "meta_for",
    "partial_upload",
    "post",
    "read_response",
    "run_names",
    "skeleton",
    "stored_data",
    "uploading",
    "valid_body",
    "wait_consumed",
]

Layout = Sequence[tuple[str, str, Sequence[int]]]

TENSORS: list[tuple[str, str, list[int]]] = [("w", "F32", [2, 3]), ("b", "I64", [4])]
W = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}  # TENSORS' header entries
B = {"dtype": "I64", "shape": [4], "data_offsets": [24, 56]}
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # what a run may be called


# -- building bodies ---------------------------------------------------------------------------


def skeleton(*names: str) -> str:
    """A skeleton (ckptstore/1) whose root is a dict of the tensors ``names``."""
    items = [[n, {"t": "tensor", "n": n}] for n in names]
    return json.dumps({"v": 1, "root": {"t": "dict", "v": items}}, separators=(",", ":"))


def meta_for(*names: str) -> dict[str, str]:
    """``__metadata__`` whose skeleton is a dict of the tensors ``names`` (the service checks
    that every tensor it names is sent)."""
    return {"format": FORMAT, "skeleton": skeleton(*names)}


def data_for(n: int, seed: int = 1) -> bytes:
    """``n`` bytes of placeholder tensor data; another ``seed``, other bytes."""
    return bytes((i * 7 + seed) % 251 for i in range(n))


def valid_body(seed: int = 1, tensors: Layout | None = None) -> tuple[bytes, bytes]:
    """A valid body of ``tensors`` (default ``TENSORS``) split into (prefix, data)."""
    layout = tensors or TENSORS
    prefix, header = encode_header(layout, meta_for(*(name for name, _, _ in layout)))
    return prefix, data_for(header.data_len, seed)


def framed(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    """``header`` (JSON-encoded unless already bytes), space-padded to 8, behind its length
    (or the ``length`` given, to lie about it), then ``data``."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def client_body(state: object, metadata: dict[str, str] | None = None) -> tuple[bytes, Header]:
    """The exact bytes ``CheckpointClient.save`` streams for ``state``, and their header;
    ``metadata``: more keys of its ``__metadata__`` (``ckptstore.lossy``, say)."""
    from ckptstore.state import dtype_to_wire, flatten, tensor_bytes, upload_order  # torch

    flat = flatten(state)
    ordered = upload_order(flat.tensors)
    specs = [(n, dtype_to_wire(t.dtype), tuple(t.shape)) for n, t in ordered]
    meta = {"format": FORMAT, "skeleton": flat.skeleton, **(metadata or {})}
    prefix, header = encode_header(specs, meta)
    return prefix + b"".join(bytes(tensor_bytes(t)) for _, t in ordered), header


def chunked(body: bytes, piece: int = 16) -> Callable[[], Iterator[bytes]]:
    """Content for httpx that has no Content-Length (sent with Transfer-Encoding: chunked)."""

    def gen() -> Iterator[bytes]:
        for i in range(0, len(body), piece):
            yield body[i : i + piece]

    return gen


# -- raw HTTP ----------------------------------------------------------------------------------


def _connect(url: str, timeout: float | None) -> tuple[socket.socket, str]:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout), host


def partial_upload(
    url: str, run: str, step: int, sent: bytes, total_len: int, timeout: float | None = None
) -> socket.socket:
    """POST ``total_len`` bytes announced (Content-Length) but only ``sent`` written; the
    socket stays open (``timeout``: its connect/send/receive timeout).

    Close it to simulate a client that disconnects mid-upload, keep it open to hold the
    upload (and the run's lock) in progress, or read the answer with ``read_response``.
    """
    sock, host = _connect(url, timeout)
    sock.sendall(
        f"POST /v1/runs/{run}/checkpoints/{step} HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {total_len}\r\n\r\n".encode()
        + sent
    )
    return sock


def chunked_upload(url: str, run: str, pieces: list[bytes], end: bool) -> socket.socket:
    """A chunked POST of ``pieces`` to step 1; with ``end`` the terminating chunk follows."""
    sock, host = _connect(url, 10)
    sock.sendall(
        f"POST /v1/runs/{run}/checkpoints/1 HTTP/1.1\r\nHost: {host}\r\n"
        "Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    )
    for piece in pieces:
        sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
    if end:
        sock.sendall(b"0\r\n\r\n")
    return sock


def read_response(sock: socket.socket, timeout: float) -> tuple[int, dict[str, object]]:
    """Read one HTTP response (status, JSON body) from ``sock``."""
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        piece = sock.recv(65536)
        if not piece:
            raise ConnectionError(f"connection closed after {buf!r}")
        buf += piece
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(
        int(v) for k, _, v in (x.partition(":") for x in lines[1:]) if k.lower() == "content-length"
    )
    while len(body) < length:
        piece = sock.recv(65536)
        if not piece:
            break
        body += piece
    return status, json.loads(body[:length])


def _queues(local: tuple[str, int], remote: tuple[str, int]) -> tuple[int, int] | None:
    """(send queue, receive queue) in bytes of the IPv4 TCP socket ``local`` <-> ``remote``
    of this machine, from /proc/net/tcp; None if there is no such socket."""

    def hexed(addr: tuple[str, int]) -> str:
        return f"{socket.inet_aton(addr[0])[::-1].hex().upper()}:{addr[1]:04X}"

    want = (hexed(local), hexed(remote))
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if (fields[1], fields[2]) == want:
            tx, rx = fields[4].split(":")
            return int(tx, 16), int(rx, 16)
    return None


def wait_consumed(sock: socket.socket, timeout: float = 20.0) -> None:
    """Until the peer of ``sock`` (a service on this machine) has read every byte written to
    it: nothing in flight in our send queue, nothing unread in the service's receive queue.
    What a test waits for before it hangs up "in the middle" of a request, or checks the
    service while clients stall."""
    here, there = sock.getsockname()[:2], sock.getpeername()[:2]

    def consumed() -> bool:
        ours, theirs = _queues(here, there), _queues(there, here)
        assert ours is not None and theirs is not None, "socket not found in /proc/net/tcp"
        return ours[0] == 0 and theirs[1] == 0

    wait_until(consumed, timeout, f"the service read all that was sent on {here}")


def uploading(service: Service) -> list[str]:
    """The runs whose upload ``service`` has begun and not ended (their ``writing`` rows in
    its SQLite catalog): it has read their header, and waits for or works on their data."""
    from ckptstore_service.catalog import Catalog

    catalog = Catalog(f"sqlite:///{service.data_dir / 'catalog.sqlite3'}")
    try:
        return [run for _, run, *_ in catalog.uploads_in_progress()]
    finally:
        catalog.close()


# -- talking to a service through httpx --------------------------------------------------------

_clients: dict[str, httpx.Client] = {}


def client_for(service: Service) -> httpx.Client:
    """One keep-alive client per service (a new httpx client costs tens of ms); closed by
    ``close_clients`` (tests/api/conftest.py: after each module)."""
    client = _clients.get(service.url)
    if client is None:
        client = _clients[service.url] = httpx.Client(base_url=service.url, timeout=30)
    return client


def close_clients() -> None:
    for client in _clients.values():
        client.close()
    _clients.clear()


def post(
    service: Service, run: str, step: str, content: bytes | Callable[[], Iterator[bytes]]
) -> httpx.Response:
    body = content if isinstance(content, bytes) else content()
    return client_for(service).post(f"/v1/runs/{run}/checkpoints/{step}", content=body)


# -- what a rejected request must leave --------------------------------------------------------


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    """The typed error body: ``status``, JSON, ``code`` and a non-empty message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"].strip(), error


def run_names(service: Service) -> list[str]:
    response = client_for(service).get("/v1/runs")
    assert response.status_code == 200, response.text
    return [r["name"] for r in response.json()["runs"]]


def _leftover_blobs(service: Service, run: str) -> list[str]:
    folder = service.data_dir / "blobs" / "runs" / run
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def assert_nothing_stored(service: Service, *runs: str) -> None:
    """The service is healthy and none of ``runs`` has a checkpoint, listed or on disk."""
    assert service.healthy()
    listed = run_names(service)
    for run in runs:
        assert run not in listed
        if RUN_NAME.fullmatch(run):
            response = client_for(service).get(f"/v1/runs/{run}/checkpoints")
            assert_error(response, 404, "run_not_found")
            assert _leftover_blobs(service, run) == []


def stored_data(service: Service, run: str, step: int | str) -> bytes:
    """The tensor bytes (the section after the header) of a stored checkpoint."""
    response = client_for(service).get(f"/v1/runs/{run}/checkpoints/{step}")
    assert response.status_code == 200, response.text
    (n,) = struct.unpack("<Q", response.content[:8])
    return response.content[8 + n :]
