"""A part PUT straight to the store (``ckptstore.direct.put_part``) is retried by itself, to
the same URL with the same bytes, for the answers S3 documents as retriable (``503
SlowDown``, ``500 InternalError``, ``503 ServiceUnavailable``) and failed connections, a
bounded number of times with back-off; never for a ``403`` (an expired URL, a signature
mismatch) or another ``4xx``; an URL that expires during the back-off ends as
``UrlExpired``. Against a real HTTP server that answers as scripted (the save-level tests,
through moto, are in tests/integration/test_direct_s3.py)."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ckptstore import Forbidden, InvalidRequest, UrlExpired
from ckptstore.direct import PUT_ATTEMPTS, put_part
from ckptstore_core.errors import StorageUnavailable
from support.faultproxy import SLOWDOWN_BODY
from support.presign import s3_error

OK = ("200 OK", b"")
SLOWDOWN = ("503 Slow Down", SLOWDOWN_BODY)
INTERNAL = ("500 Internal Server Error", s3_error("InternalError", "We encountered an error"))
UNAVAILABLE = ("503 Service Unavailable", s3_error("ServiceUnavailable", "Reduce your rate"))
EXPIRED = ("403 Forbidden", s3_error("AccessDenied", "Request has expired"))
MISMATCH = ("403 Forbidden", s3_error("SignatureDoesNotMatch", "The signature does not match"))
NO_UPLOAD = ("404 Not Found", s3_error("NoSuchUpload", "The upload does not exist"))
BAD = ("400 Bad Request", s3_error("InvalidArgument", "Part number must be 1-10000"))
RESET = ("reset", b"")  # the connection closed with a RST, no answer
DATA = bytes(range(256)) * 1024
URL_QUERY = "?uploadId=U&partNumber=3&X-Amz-Signature=0123secret"


class Store:
    """An HTTP server answering each PUT with the next answer of :attr:`script` (then
    200s), recording each body it read."""

    def __init__(self) -> None:
        self.script: list[tuple[str, bytes]] = []
        self.bodies: list[bytes] = []
        store = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_PUT(self) -> None:
                store.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                status, body = store.script.pop(0) if store.script else OK
                if status == "reset":
                    linger = struct.pack("ii", 1, 0)  # close with a RST
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                    self.connection.close()
                    self.close_connection = True
                    return
                code, _, reason = status.partition(" ")
                self.send_response(int(code), reason)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/b/k{URL_QUERY}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store()
    yield s
    s.close()


@pytest.mark.parametrize(
    "failures",
    [[SLOWDOWN], [SLOWDOWN, SLOWDOWN], [INTERNAL, UNAVAILABLE, RESET], [RESET]],
    ids=["slowdown", "slowdown-twice", "internal-unavailable-reset", "reset"],
)
def test_retriable_failures_are_retried_with_the_same_bytes(
    store: Store, failures: list[tuple[str, bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    store.script = list(failures)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        put_part(store.url, DATA, 5, backoff=0.01)
    assert len(store.bodies) == len(failures) + 1
    assert all(b == DATA for b in store.bodies)
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == len(failures), retries
    assert f"(retry 1 of {PUT_ATTEMPTS - 1})" in retries[0]
    assert "(part 3)" in retries[0]
    assert "secret" not in caplog.text  # the URL's signature is never logged
    assert all("\n" not in r for r in retries)
    if failures[0] == SLOWDOWN:
        assert retries[0].startswith(
            "the store answered 503 to a PUT of a part: SlowDown: Please reduce your request"
        ), retries[0]


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (EXPIRED, UrlExpired),
        (MISMATCH, Forbidden),
        (NO_UPLOAD, StorageUnavailable),  # the upload swept: the caller plans again
        (BAD, InvalidRequest),
    ],
    ids=["expired", "signature", "no-such-upload", "bad-request"],
)
def test_4xx_answers_are_not_retried(
    store: Store, answer: tuple[str, bytes], error: type[Exception]
) -> None:
    store.script = [answer]
    with pytest.raises(error) as caught:
        put_part(store.url, DATA, 5, backoff=0.01)
    assert len(store.bodies) == 1
    if error is Forbidden:
        assert not isinstance(caught.value, UrlExpired)


def test_an_url_that_expires_during_the_back_off_raises_url_expired(store: Store) -> None:
    store.script = [SLOWDOWN, EXPIRED]
    with pytest.raises(UrlExpired, match="expired"):
        put_part(store.url, DATA, 5, backoff=0.01)
    assert len(store.bodies) == 2


def test_the_attempts_are_bounded_then_storage_unavailable(store: Store) -> None:
    store.script = [SLOWDOWN] * 10
    with pytest.raises(StorageUnavailable, match="503") as caught:
        put_part(store.url, DATA, 5, attempts=3, backoff=0.01)
    assert not isinstance(caught.value, UrlExpired)
    assert len(store.bodies) == 3
    store.script = [SLOWDOWN] * 10
    with pytest.raises(StorageUnavailable):
        put_part(store.url, DATA, 5, attempts=1, backoff=0.01)  # one attempt: no retry
    assert len(store.bodies) == 4


@pytest.mark.timing
def test_a_store_that_is_down_is_retried_then_storage_unavailable() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/b/k{URL_QUERY}"
    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match="did not take a part"):
        put_part(url, DATA, 5, attempts=3, backoff=0.05)
    # two back-offs of 0.05 and 0.1 s, each times a jitter of 0.5-1.5: at least 0.075 s
    assert time.monotonic() - started >= 0.07


def test_stop_ends_a_back_off_at_once(store: Store) -> None:
    """The uploader sets ``stop`` once the part failed elsewhere: a PUT waiting to retry
    raises its last failure instead of waiting out its back-off."""
    store.script = [SLOWDOWN] * 10
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match="503"):
        put_part(store.url, DATA, 5, attempts=5, backoff=30, stop=stop)
    assert time.monotonic() - started < 10
    assert len(store.bodies) == 1
