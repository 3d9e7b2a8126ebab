"""The client when the service is down: typed errors importable from ``ckptstore``."""

from __future__ import annotations

import time

import pytest
import torch

import ckptstore
from ckptstore import CheckpointClient, CkptStoreError, ServiceUnavailable
from ckptstore_core.errors import _all_subclasses
from support.serviceproc import free_port
from support.waiting import wait_until


def test_every_error_of_the_tree_is_exported() -> None:
    # the README: errors are typed, ``from ckptstore import ...``; ServiceUnavailable is what
    # a trainer catches when the service stays down
    # (the service's own subclasses, such as BlobNotFound, are not the client's to export)
    tree = [c for c in _all_subclasses(CkptStoreError) if c.__module__ == "ckptstore_core.errors"]
    assert ServiceUnavailable in tree
    for cls in tree:
        assert getattr(ckptstore, cls.__name__) is cls
        assert cls.__name__ in ckptstore.__all__


def test_service_down_at_the_first_call() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with CheckpointClient(url, retries=2, backoff=0.05) as client:
        t0 = time.perf_counter()
        with pytest.raises(ServiceUnavailable, match="cannot reach the ckptstore service") as info:
            client.save("down", 1, {"w": torch.zeros(4)})
        assert time.perf_counter() - t0 >= 0.05 * (1 + 2) * 0.5  # it backed off and retried
        assert url in str(info.value) and info.value.status == 503
        with pytest.raises(ServiceUnavailable):
            client.load("down")
        with pytest.raises(ServiceUnavailable):
            client.runs()


def test_a_keep_alive_connection_the_service_closed_is_not_reused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server that answers keep-alive, then closes each connection once it is idle (as
    uvicorn does after its keep-alive timeout): with ``retries=0`` the second call still
    succeeds, on a new connection, without a retry."""
    import json
    import socket
    import threading

    body = json.dumps({"runs": []}).encode()
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n".encode()
        + body
    )
    server = socket.create_server(("127.0.0.1", 0))
    accepted = []
    closed = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.recv(65536)  # the request (small, in one piece on loopback)
            conn.sendall(answer)
            conn.close()  # idle: the server drops it
            closed.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        with CheckpointClient(url, retries=0) as client:
            assert client.runs() == []
            wait_until(lambda: len(closed) == 1, timeout=10)
            with caplog.at_level("WARNING", logger="ckptstore"):
                assert client.runs() == []  # the first connection is closed by now
        assert len(accepted) == 2
        assert not [r for r in caplog.records if "retrying" in r.getMessage()]
    finally:
        server.close()
