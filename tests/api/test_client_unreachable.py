"""The client when the service is down: typed errors importable from ``ckptstore``."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore import CheckpointClient, CkptStoreError, ServiceUnavailable
from ckptstore.transport import FIRST_CONTACT_S
from ckptstore_core.errors import _all_subclasses
from support.serviceproc import Service, free_port
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


@pytest.mark.timing
@pytest.mark.parametrize("from_env", [False, True])
def test_a_url_where_nothing_listens_fails_within_seconds(
    from_env: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default retries (5, backoff 0.5 s: 12-20 s in all) are not spent on a first
    contact: a wrong port or a service not started fails in about FIRST_CONTACT_S, and says
    which URL and how to set it."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("CKPTSTORE_URL", url if from_env else "http://127.0.0.1:9")
    with CheckpointClient(None if from_env else url) as client:
        t0 = time.perf_counter()
        with pytest.raises(ServiceUnavailable) as info:
            client.runs()
        took = time.perf_counter() - t0
    assert took < 5, f"failed after {took:.1f} s"
    message = str(info.value)
    assert url in message and "CKPTSTORE_URL" in message, message
    assert "connection refused" in message
    assert ("from CKPTSTORE_URL" in message) == from_env, message


def test_a_service_that_answered_then_restarts_is_waited_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the service has answered, a call made while it is down keeps retrying (well past
    the first-contact grace) and succeeds when it is back on the same port: a restarting
    replica must not fail a training job."""
    svc = Service(tmp_path / "data").start()
    try:
        # more retries than the default (5, 0.5 s: at least ~8 s in all) leave room for
        # a slow restart on a loaded machine; the rule under test is the same
        with CheckpointClient(svc.url, retries=8, backoff=0.25) as client:
            client.save("restart", 1, {"w": torch.arange(4.0)})
            svc.stop()
            t0 = time.monotonic()
            result: list[object] = []
            call = threading.Thread(target=lambda: result.append(client.list("restart")))
            with caplog.at_level("WARNING", logger="ckptstore"):
                call.start()
                wait_until(
                    lambda: time.monotonic() - t0 > FIRST_CONTACT_S + 0.5 and retries(caplog),
                    timeout=30,
                    what="the call retried past the first-contact grace",
                )
                assert call.is_alive(), f"the call ended: {result}"
                svc.start()
                call.join(60)
            assert [c.step for c in result[0]] == [1]  # type: ignore[attr-defined]
    finally:
        svc.stop()


def retries(caplog: pytest.LogCaptureFixture) -> int:
    return sum("retrying" in r.getMessage() for r in caplog.records)


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
