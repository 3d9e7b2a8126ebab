"""``Transport``: the client's HTTP to one ckptstore service, shared by every client module.

It owns the service's base URL and bearer token, the timeouts, the keep-alive connections
(``http.client``, one per concurrent request), the retries with their back-off, streamed
request bodies and responses, and the mapping of error responses to the core error tree
(:mod:`ckptstore_core.errors`). :class:`~ckptstore.CheckpointClient` (``client.transport``),
:mod:`ckptstore.parts`, :mod:`ckptstore.files`, :mod:`ckptstore.tokens` and the ``ckptstore``
command send through it; none of them touches a connection.

The HTTP layer is the standard library's ``http.client``: with ``sendall`` of memoryviews and
``readinto`` of preallocated buffers it moves 2+ GB/s on loopback, where httpx (h11) topped out
near 0.5 GB/s in our measurements, and the transfer speed is what a trainer waits on.

Retries (:meth:`Transport.retry`): connection errors, a response cut short, and the answers
``503 storage_unavailable`` (``lock_lost`` too), ``503 too_many_uploads`` and ``408
request_timeout`` are retried with exponential backoff and jitter, up to ``retries`` times,
each retry logged as a warning on the ``ckptstore`` logger. Until this transport has
connected to the service once, a failed connection is retried for ``first_contact`` seconds
only: a wrong URL, or a service that is not running, fails within a few seconds with a
message naming the URL and ``CKPTSTORE_URL``, while a service that answered before and then
went away (a restarting replica) gets every retry. Every other error answer is raised at
once, typed.

Torch-free; imports nothing of ``ckptstore`` (the bottom of the client's modules).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import random
import re
import select
import socket
import ssl
import threading
import time
import urllib.error
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeVar
from urllib.parse import quote, urlsplit

import xxhash

from ckptstore_core.errors import (
    CkptStoreError,
    CorruptData,
    Forbidden,
    InvalidRequest,
    InvalidStream,
    NotFound,
    RequestTimeout,
    ServiceUnavailable,
    StorageUnavailable,
    TooManyUploads,
    UrlExpired,
    error_from_code,
)
from ckptstore_core.names import check_run_name
from ckptstore_core.wire import Header, StreamParser

__all__ = [
    "CHECKSUMS_KEY",
    "DEFAULT_URL",
    "FIRST_CONTACT_S",
    "PIECE",
    "Progress",
    "Transport",
    "UsesTransport",
    "check_tensor",
    "checkpoint_path",
    "checksums_of",
    "digest",
    "read_header",
    "read_into",
    "run_path",
    "store_error",
    "transport_of",
]

#: The service a transport with no ``url`` talks to when ``CKPTSTORE_URL`` is not set.
DEFAULT_URL = "http://127.0.0.1:8000"
#: Seconds a failed connection is retried before the service has been reached once.
FIRST_CONTACT_S = 2.0
#: Bytes per socket write/read while streaming.
PIECE = 8 << 20
#: The response metadata key of the tensors' checksums (xxh3-128, hex, by name).
CHECKSUMS_KEY = "ckptstore.xxh3_128"
_TRANSIENT = (OSError, http.client.HTTPException)
_RETRIED = (*_TRANSIENT, StorageUnavailable, RequestTimeout, TooManyUploads)


class RetriedOut(StorageUnavailable):
    """A StorageUnavailable retried already where it happened, up to its own bound (a part
    PUT straight to S3 past its attempts): :meth:`Transport.retry` raises it at once
    instead of repeating the whole call, whose attempts would multiply the first ones."""


T = TypeVar("T")
logger = logging.getLogger("ckptstore")


class Progress:
    """A tqdm bar when asked for, else nothing."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError as exc:
                raise ImportError(
                    "progress bars need tqdm: pip install 'ckptstore[progress]'"
                ) from exc
            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _Pool:
    """Keep-alive connections to one service, one per concurrent request, thread-safe."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"service URL must be http(s)://host[:port][/base], got {url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self.base = parts.path.rstrip("/")
        self._timeout = timeout
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def get(self) -> http.client.HTTPConnection:
        """An idle connection the service has not closed, else a new one (not connected)."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            if not _dropped(conn):
                return conn
            conn.close()  # the service closed it while idle (its keep-alive timeout)
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def put(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.append(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class Transport:
    """HTTP to the ckptstore service at ``url`` (``http(s)://host[:port][/base]``; without
    one, ``CKPTSTORE_URL`` from the environment, else :data:`DEFAULT_URL`). ``ValueError``
    for another kind of URL.

    ``token`` is the bearer token sent with every request (default: ``CKPTSTORE_TOKEN``; none
    if unset). ``timeout`` applies to each socket operation, not to a whole transfer.
    ``retries`` bounds the attempts after the first of a retried call (:meth:`retry`), with
    ``backoff * 2**n`` seconds (times a jitter of 0.5-1.5) before retry ``n + 1``; until a
    connection to the service succeeded once, failed connections are retried for
    ``first_contact`` seconds only (then ServiceUnavailable naming the URL). Safe to
    share between threads; :meth:`close` frees the idle connections (a later call opens new
    ones).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 120.0,
        retries: int = 5,
        backoff: float = 0.5,
        first_contact: float = FIRST_CONTACT_S,
    ) -> None:
        self._url_source = "was given"
        if url is None:
            url = os.environ.get("CKPTSTORE_URL") or None
            self._url_source = "is from CKPTSTORE_URL" if url else "is the default"
        if url is None:
            url = DEFAULT_URL
        if token is None:
            token = os.environ.get("CKPTSTORE_TOKEN") or None
        self.url = url.rstrip("/")
        # the header, not the token, is kept: no attribute shows the secret by its name
        self._authorization = f"Bearer {token.strip()}" if token else None
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.first_contact = first_contact
        self._pool = _Pool(self.url, timeout)
        self._reached = False  # a connection to the service succeeded once (never reset)

    def close(self) -> None:
        """Close the idle connections; the transport stays usable."""
        self._pool.close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls ------------------------------------------------------------------------------

    def call(self, method: str, path: str, payload: Any = None, *, retried: bool = True) -> Any:
        """``method path`` with ``payload`` as its JSON body (if not None); the answer's
        JSON. Retried (:meth:`retry`) unless ``retried`` is false: only for idempotent
        requests."""
        body = None if payload is None else json.dumps(payload).encode()

        def attempt() -> Any:
            pieces = None if body is None else [body]
            length = 0 if body is None else len(body)
            return self.send(method, path, pieces, length, content_type="application/json")

        return self.retry(attempt) if retried else attempt()

    def send(
        self,
        method: str,
        path: str,
        body: Iterable[memoryview | bytes] | None = None,
        length: int | None = 0,
        sent: Callable[[int], None] | None = None,
        content_type: str = "application/octet-stream",
    ) -> Any:
        """One attempt of ``method path`` with ``body`` (``length`` bytes, streamed piece
        by piece; ``sent(n)`` after each piece; ``length`` None: a body of unknown length,
        sent chunked); the answer's JSON, or its typed error."""
        conn, response = self._request(method, path, body, length, sent, content_type)
        data = response.read()
        self._done(conn, response)
        _raise_for(response.status, data)
        return json.loads(data)

    def post(
        self,
        path: str,
        body: Iterator[memoryview | bytes],
        length: int,
        sent: Callable[[int], None],
    ) -> Any:
        """One attempt of a streamed POST (a save's body); the answer's JSON."""
        return self.send("POST", path, body, length, sent)

    def delete(self, path: str) -> None:
        """DELETE ``path``, retried; a 404 after a first attempt that may have deleted it
        (its answer lost) is success."""
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            try:
                with self.stream("DELETE", path) as response:
                    response.read()  # no JSON to parse: a 204
            except NotFound:
                if tries == 1:
                    raise

        self.retry(attempt)

    @contextlib.contextmanager
    def stream(
        self,
        method: str,
        path: str,
        body: Iterable[memoryview | bytes] | None = None,
        length: int = 0,
        content_type: str = "application/octet-stream",
    ) -> Iterator[http.client.HTTPResponse]:
        """One attempt of ``method path``, its successful response to read in the block
        (an error answer raises its typed error first). The connection goes back to the
        pool if the block read the response to its end, and is closed otherwise (an error
        in the block, a response left unread)."""
        conn, response = self._request(method, path, body, length, None, content_type)
        try:
            if response.status >= 300:
                _raise_for(response.status, response.read())
            yield response
        except BaseException:
            conn.close()
            raise
        self._done(conn, response)

    # -- retries ----------------------------------------------------------------------------

    def retry(self, attempt: Callable[[], T]) -> T:
        """``attempt()``, again after each transient failure (up to ``retries`` times, each
        logged as a warning), backing off exponentially with jitter. Before the service was
        reached once, a failed connection is retried for ``first_contact`` seconds only."""
        start = time.monotonic()
        for n in range(self.retries + 1):
            try:
                return attempt()
            except RetriedOut:
                raise
            except _RETRIED as exc:
                delay = self.backoff * 2**n * (0.5 + random.random())
                # an OSError before any connection succeeded is a connection that failed
                unreached = not self._reached and isinstance(exc, OSError)
                if unreached and (
                    n == self.retries or time.monotonic() + delay - start > self.first_contact
                ):
                    raise self._unreachable(exc) from exc
                if n == self.retries:
                    raise _final(self.url, exc) from exc
                logger.warning(
                    "%s; retrying in %.1f s (retry %d of %d)",
                    _failure(self.url, exc),
                    delay,
                    n + 1,
                    self.retries,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _unreachable(self, exc: BaseException) -> ServiceUnavailable:
        """The error of a first contact that failed: what, where, and how to point
        elsewhere."""
        return ServiceUnavailable(
            f"cannot reach the ckptstore service at {self.url}: {_reason(exc)}. Nothing has "
            "answered there yet: is the service running, and is that its URL? (the URL "
            f"{self._url_source}; CKPTSTORE_URL sets it for clients and commands)"
        )

    # -- plumbing ---------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        body: Iterable[memoryview | bytes] | None,
        length: int | None,
        sent: Callable[[int], None] | None,
        content_type: str,
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; returns the connection (give it back with ``_done``) and response."""
        conn = self._pool.get()
        try:
            if conn.sock is None:
                conn.connect()
                self._reached = True
            conn.putrequest(method, self._pool.base + path, skip_accept_encoding=True)
            if self._authorization is not None:
                conn.putheader("Authorization", self._authorization)
            if body is not None:
                conn.putheader("Content-Type", content_type)
                if length is None:
                    conn.putheader("Transfer-Encoding", "chunked")
                else:
                    conn.putheader("Content-Length", str(length))
            conn.endheaders()
            if body is not None:
                try:
                    for piece in body:
                        if length is None and len(piece):  # a chunk of length 0 ends it
                            conn.send(b"%x\r\n" % len(piece))
                            conn.send(piece)
                            conn.send(b"\r\n")
                        elif length is not None:
                            conn.send(piece)
                        if sent is not None:
                            sent(len(piece))
                    if length is None:
                        conn.send(b"0\r\n\r\n")
                except OSError:
                    # The service may have answered early (a 4xx after the header) and
                    # closed; read that answer if there is one, else retry the transport.
                    response = conn.getresponse()
                    if response.status < 400:
                        raise
                    return conn, response
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def _done(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        if response.isclosed() and not response.will_close:
            self._pool.put(conn)
        else:
            conn.close()


class UsesTransport(Protocol):
    """What sends through a :class:`Transport` (a :class:`~ckptstore.CheckpointClient`)."""

    @property
    def transport(self) -> Transport: ...


def transport_of(via: Transport | UsesTransport) -> Transport:
    """``via`` if it is a :class:`Transport`, else its ``transport``."""
    return via if isinstance(via, Transport) else via.transport


def run_path(run: str) -> str:
    """The run's path; InvalidRequest for a name the service would refuse."""
    return f"/v1/runs/{quote(check_run_name(run), safe='')}"


def checkpoint_path(run: str, step: int | str) -> str:
    """The checkpoint's path; InvalidRequest for a run name the service would refuse
    (the same rule), before anything is sent."""
    return f"{run_path(run)}/checkpoints/{quote(str(step), safe='')}"


def read_into(
    response: http.client.HTTPResponse, view: memoryview, progress: Callable[[int], None]
) -> None:
    """Fill ``view`` from ``response``; IncompleteRead (retried) if it ends first."""
    got = 0
    while got < len(view):
        n = response.readinto(view[got : got + PIECE])
        if not n:
            raise http.client.IncompleteRead(bytes(0), len(view) - got)
        got += n
        progress(n)


def read_header(response: http.client.HTTPResponse) -> Header:
    """The safetensors header at the start of ``response``."""
    parser = StreamParser(max_header_bytes=1 << 30)
    prefix = bytearray(8)
    read_into(response, memoryview(prefix), lambda n: None)
    list(parser.feed(prefix))
    text = bytearray(int.from_bytes(prefix, "little"))
    read_into(response, memoryview(text), lambda n: None)
    events = list(parser.feed(text))
    if not events or not isinstance(events[0], Header):
        raise InvalidStream("response header did not parse")
    return events[0]


def check_tensor(name: str, digest: str, checksums: Mapping[str, str]) -> None:
    """CorruptData if tensor ``name`` has a checksum in ``checksums`` (a response's, by
    name) other than ``digest`` (the xxh3-128 hex of the bytes received)."""
    want = checksums.get(name)
    if want is not None and digest != want:
        raise CorruptData(f"tensor {name!r} arrived corrupted (checksum mismatch)")


def checksums_of(header: Header) -> dict[str, str]:
    """The checksums a response's header carries, by tensor name (none: ``{}``)."""
    raw = header.metadata.get(CHECKSUMS_KEY)
    return {} if raw is None else dict(json.loads(raw))


def digest(data: memoryview | bytes) -> str:
    """The xxh3-128 hex of ``data``, as the service records it."""
    return xxhash.xxh3_128_hexdigest(data)


def _raise_for(status: int, data: bytes) -> None:
    if status < 300:
        return
    try:
        err = json.loads(data)["error"]
        code, message = err["code"], err["message"]
    except (ValueError, KeyError, TypeError) as exc:
        plain = CkptStoreError(f"HTTP {status}: {data[:500]!r}")  # not the service's error
        plain.status = status
        raise plain from exc
    raise error_from_code(code, message, status)


def _final(url: str, exc: BaseException) -> BaseException:
    """What a call raises when its last retry failed with ``exc``."""
    if isinstance(exc, CkptStoreError):
        return exc
    if isinstance(exc, http.client.IncompleteRead):
        # the status line and headers came: the service failed mid-stream
        return ServiceUnavailable(
            f"the ckptstore service at {url} cut its response short "
            f"({exc!r}): it failed while sending; its log says why"
        )
    return ServiceUnavailable(f"cannot reach the ckptstore service at {url}: {_reason(exc)}")


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle keep-alive connection was closed by its peer: its socket is readable
    (an EOF, or bytes no request asked for) or gone. Without this check, the next request on
    it would fail once (``RemoteDisconnected``) and cost a retry with its back-off."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _failure(url: str, exc: BaseException) -> str:
    """What a transient failure of a request to ``url`` was, in one line for a log."""
    if isinstance(exc, CkptStoreError):
        return f"{url} answered {exc.status} {exc.code}: {exc.message}"
    if isinstance(exc, http.client.IncompleteRead):
        return f"{url} cut its response short"
    return f"cannot reach {url}: {_reason(exc)}"


def _reason(exc: BaseException) -> str:
    """A network failure in a few words ("connection refused", "timed out"), else its repr."""
    if isinstance(exc, socket.gaierror):
        return f"host not found ({exc.strerror})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return repr(exc)


def store_error(exc: urllib.error.HTTPError, what: str) -> CkptStoreError:
    """The typed error of a store's answer to a presigned request."""
    text = _store_text(exc.read()[:300].decode(errors="replace"))
    if exc.code == 403 and "expired" in text.lower():
        return UrlExpired(f"the store refused a {what}: its URL expired ({text})")
    if exc.code == 403:
        return Forbidden(f"the store refused a {what} ({exc.code}): {text}")
    if exc.code == 404 and "NoSuchUpload" in text:  # swept meanwhile: the next try plans again
        return StorageUnavailable(f"the store's upload is gone (aborted) at a {what}: {text}")
    if exc.code >= 500 or exc.code == 429:
        return StorageUnavailable(f"the store answered {exc.code} to a {what}: {text}")
    return InvalidRequest(f"the store answered {exc.code} to a {what}: {text}")


def _store_text(text: str) -> str:
    """An S3 error document as ``Code: Message`` on one line (else the text, on one line)."""
    code, message = (
        re.search(r"<Code>(.*?)</Code>", text),
        re.search(r"<Message>(.*?)</Message>", text),
    )
    if code and message:
        return f"{code[1]}: {message[1]}"
    return " ".join(text.split())
