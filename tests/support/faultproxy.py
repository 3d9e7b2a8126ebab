"""A fault-injecting TCP proxy for tests: put it between the service and a peer (moto's S3
server, PostgreSQL) and break the link on demand.

    with FaultProxy("127.0.0.1", 5432) as proxy:      # listens on 127.0.0.1, a free port
        url = f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/db"
        proxy.set_latency(0.05)     # every forwarded chunk waits 50 ms first
        proxy.stall()               # nothing is forwarded; connections stay open
        proxy.resume()              # forwarding again (the held bytes go through)
        proxy.reset()               # every open connection closed with a RST, both sides
        proxy.refuse()              # new connections: accepted, then closed with a RST
        proxy.clear()               # every fault off

    FaultProxy(host, port, http=True).slowdown(3)   # S3: the next 3 requests get a 503 SlowDown
    FaultProxy(host, port, http=True).drop_answers(b"/commit", 1)   # a lost answer, below
    FaultProxy(host, port, http=True).answer(b"&partNumber=1&", 2, "503 Slow Down", xml)
    FaultProxy(host, port, http=True, check=fn)     # fn(head) -> (status, body) refuses it

One asyncio event loop in a thread of the test process serves every connection: each
accepted connection opens its own connection to the upstream and two pumps copy bytes
(at most ``chunk_bytes`` at a time), each chunk waiting for the stall to end and then for
the latency. During a stall a pump reads one chunk and holds it (:attr:`FaultProxy.held`
counts those), so the sender's socket buffers fill. The fault switches may be called from
any thread; each takes effect on the next chunk (a reset at once) and returns once the
loop has applied it.

With ``http=True`` the client-to-upstream direction is read as HTTP/1.1 requests (headers,
then a ``Content-Length`` body; a chunked body is passed through raw and ends the parsing of
that connection), so that :meth:`FaultProxy.slowdown` can answer whole requests itself, the
way S3 throttles: ``503`` with an ``<Error><Code>SlowDown</Code>`` XML body and
``Connection: close``. The request is not forwarded (its body, if sent, is read and
dropped), and the connection is then closed cleanly. :meth:`FaultProxy.drop_answers` loses
answers instead: the matching request goes through whole, the upstream does its work, and
when its answer begins the connection is reset on both sides, the answer unsent: the
window in which a service committed but its client never heard so. ``check``, called with
each request's head (request line and headers, as sent), refuses a request the way a
SlowDown does when it returns ``(status line, XML body)``, e.g. ``("403 Forbidden", ...)``:
how ``support.presign`` makes the peer check presigned URLs as S3 does.
:meth:`FaultProxy.answer` does the same to the next requests whose request line holds a
marker (a 503 to one part's PUTs only, say), and :attr:`FaultProxy.request_lines` lists
every request line read, in order (what a test counts attempts by).

:meth:`FaultProxy.stop` closes the listener and aborts every connection; it is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["SLOWDOWN_BODY", "FaultProxy"]

T = TypeVar("T")

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>faultproxy</RequestId><HostId>faultproxy</HostId></Error>"
)
_HEAD_LIMIT = 1 << 20  # longest HTTP request head read in http mode
_DRAIN_S = 2.0  # after a SlowDown: how long the dropped body is read before closing


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s connection with a RST (SO_LINGER 0), not a FIN."""
    sock = writer.transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass
class _Answer:
    """An answer :meth:`FaultProxy.answer` armed: to ``left`` more requests whose request
    line holds ``marker``."""

    marker: bytes
    left: int
    status: str
    xml: bytes


class _Link:
    """One proxied connection: the client's side and the upstream's."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.drop_answer = False  # the answer to the request in flight is to be lost

    def reset(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                _rst(writer)


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:port`` (a free port, :attr:`port` once started) to
    ``upstream_host:upstream_port`` whose faults can be switched at run time.

    ``http=True``: the upstream speaks HTTP/1.1 (S3), which :meth:`slowdown` needs.
    ``chunk_bytes``: the most bytes one read forwards, the unit the latency applies to.
    Counters: :attr:`accepted` connections, :attr:`resets` (connections closed with a RST),
    :attr:`requests` (http mode: request heads read), :attr:`slowdowns_sent`, and
    :attr:`forwarded` (bytes, both ways) and :attr:`held`: chunks read and waiting for a
    stall to end now (a request caught mid-flight by :meth:`stall`); :attr:`answered`
    (requests :meth:`answer` answered) and :attr:`request_lines` (http mode: each request's
    first line, in order).
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        http: bool = False,
        chunk_bytes: int = 64 << 10,
        check: Callable[[bytes], tuple[str, bytes] | None] | None = None,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.http = http
        if check is not None and not http:
            raise ValueError("check needs FaultProxy(..., http=True)")
        self._check = check
        self.refused = 0  # requests ``check`` answered itself
        self.chunk_bytes = chunk_bytes
        self.port = 0
        self.accepted = self.resets = self.requests = self.slowdowns_sent = 0
        self.answers_dropped = self.answered = 0
        self.request_lines: list[bytes] = []
        self._answers: list[_Answer] = []
        self._drop_marker = b""
        self._drops = 0
        self.held = self.forwarded = 0
        self._latency = 0.0
        self._refusing = False
        self._slowdowns = 0
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._stopped = False

    # -- life ---------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        """Listen, and serve in a thread of this process; returns once accepting."""
        self._thread.start()
        self._call_async(self._listen)
        return self

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", 0, limit=_HEAD_LIMIT, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``: the proxy as an HTTP endpoint."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        """Connections open through the proxy now."""
        return self._call(lambda: len(self._links))

    def stop(self) -> None:
        """Stop listening, abort every connection and the loop's thread. Idempotent."""
        if self._stopped or not self._thread.is_alive():
            self._stopped = True
            return
        self._stopped = True
        self._call_async(self._shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        pumps = [task for link in self._links for task in link.tasks]
        for link in list(self._links):
            link.reset()
        for task in pumps:
            task.cancel()
        # each connection's handler ends with its pumps (cancelling it instead makes
        # asyncio log the cancellation as an error); one still connecting is cancelled
        if self._handlers:
            _, pending = await asyncio.wait(set(self._handlers), timeout=5)
            for task in pending:
                task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- faults -------------------------------------------------------------------------------

    def set_latency(self, seconds: float) -> None:
        """Every chunk forwarded from now on, either way, waits ``seconds`` first."""
        self._call(lambda: setattr(self, "_latency", seconds))

    def stall(self) -> None:
        """Stop forwarding, either way, on open and new connections; they stay open (the
        peers see silence, not an error). Bytes already read are held until :meth:`resume`."""
        self._call(lambda: self._gate().clear())

    def resume(self) -> None:
        """Forward again after :meth:`stall`."""
        self._call(lambda: self._gate().set())

    def reset(self) -> int:
        """Close every open connection with a RST on both sides (the client and the upstream
        each see "connection reset"); returns how many."""

        def reset_all() -> int:
            links = list(self._links)
            for link in links:
                link.reset()
            self.resets += len(links)
            return len(links)

        return self._call(reset_all)

    def refuse(self, refusing: bool = True) -> None:
        """From now on (until ``refuse(False)`` or :meth:`clear`) close each new connection
        with a RST as soon as it is accepted: a peer that is down or restarting."""
        self._call(lambda: setattr(self, "_refusing", refusing))

    def slowdown(self, requests: int) -> None:
        """http mode: answer the next ``requests`` requests with ``503 SlowDown`` (S3's
        throttling answer) instead of forwarding them."""
        if not self.http:
            raise ValueError("slowdown() needs FaultProxy(..., http=True)")
        self._call(lambda: setattr(self, "_slowdowns", requests))

    def drop_answers(self, marker: bytes, requests: int) -> None:
        """http mode: of the next ``requests`` requests whose request line holds ``marker``
        (``b"/commit"``), each is forwarded whole, and its connection is reset on both sides
        when the upstream's answer begins: the upstream did the work, the client gets a
        "connection reset" instead of the answer (counted in :attr:`answers_dropped`)."""
        if not self.http:
            raise ValueError("drop_answers() needs FaultProxy(..., http=True)")

        def arm() -> None:
            self._drop_marker, self._drops = marker, requests

        self._call(arm)

    def answer(self, marker: bytes, requests: int, status: str, xml: bytes) -> None:
        """http mode: answer the next ``requests`` requests whose request line holds
        ``marker`` (``b"&partNumber=1&"``: one part's PUTs) with ``status`` (``"503 Slow
        Down"``) and the ``xml`` error, as :meth:`slowdown` does, instead of forwarding
        them (counted in :attr:`answered`). Several markers may be armed at once."""
        if not self.http:
            raise ValueError("answer() needs FaultProxy(..., http=True)")
        self._call(lambda: self._answers.append(_Answer(marker, requests, status, xml)))

    def clear(self) -> None:
        """Every fault off: no latency, forwarding, accepting, no SlowDown pending, no
        answer to drop or to make."""

        def clear_all() -> None:
            self._latency, self._refusing, self._slowdowns = 0.0, False, 0
            self._drops = 0
            self._answers.clear()
            self._gate().set()

        self._call(clear_all)

    # -- the loop's side ----------------------------------------------------------------------

    def _gate(self) -> asyncio.Event:
        assert self._flowing is not None, "start() the proxy first"
        return self._flowing

    def _call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run in the loop's thread; its result once done."""
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future.result(10)

    def _call_async(self, coro: Callable[[], Coroutine[Any, Any, None]]) -> None:
        asyncio.run_coroutine_threadsafe(coro(), self._loop).result(15)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._refusing:
            self.resets += 1
            _rst(writer)
            return
        link = _Link(writer)
        self._links.add(link)
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
        try:
            try:
                up_reader, link.upstream = await asyncio.open_connection(
                    *self.upstream, limit=_HEAD_LIMIT
                )
            except OSError:
                _rst(writer)
                return
            to_upstream = (
                self._pump_requests(link, reader, link.upstream)
                if self.http
                else self._pump(reader, link.upstream)
            )
            link.tasks = [
                asyncio.ensure_future(to_upstream),
                asyncio.ensure_future(self._pump(up_reader, writer, link)),
            ]
            await asyncio.gather(*link.tasks, return_exceptions=True)
        finally:
            self._links.discard(link)
            if handler is not None:
                self._handlers.discard(handler)
            for side in (writer, link.upstream):
                if side is not None:
                    side.close()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        """Forward ``data``: after a stall ends, after the latency."""
        await self._held(self._gate().wait())
        if self._latency:
            await asyncio.sleep(self._latency)
        # a stall that began during the latency holds it too
        await self._held(self._gate().wait())
        writer.write(data)
        self.forwarded += len(data)
        await writer.drain()

    async def _held(self, stall_end: Coroutine[Any, Any, object]) -> None:
        """Await ``stall_end``, counted in :attr:`held` while it waits."""
        self.held += 1
        try:
            await stall_end
        finally:
            self.held -= 1

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        answers_of: _Link | None = None,
    ) -> None:
        """Copy until EOF (then half-close the other side) or until either side fails.
        ``answers_of``: this pump carries that link's answers; one marked to be dropped
        resets the link instead (:meth:`drop_answers`)."""
        try:
            while True:
                data = await reader.read(self.chunk_bytes)
                if not data:
                    break
                if answers_of is not None and answers_of.drop_answer:
                    self.answers_dropped += 1
                    self.resets += 1
                    answers_of.reset()
                    return
                await self._send(writer, data)
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, asyncio.IncompleteReadError):
            _rst(writer)  # a reset on one side is passed on to the other

    async def _pump_requests(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """http mode, client to upstream: one request at a time, so that a SlowDown can
        take a whole request's place."""
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        await self._send(writer, exc.partial)
                    break
                self.requests += 1
                line = head.split(b"\r\n", 1)[0]
                self.request_lines.append(line)
                length, chunked, expect = _framing(head)
                if self._drops > 0 and self._drop_marker in line:
                    self._drops -= 1
                    link.drop_answer = True
                if self._slowdowns > 0:
                    self._slowdowns -= 1
                    self.slowdowns_sent += 1
                    answer = ("503 Slow Down", SLOWDOWN_BODY)
                    await self._answer(link, reader, 0 if expect else length, *answer)
                    return
                if (made := self._made_answer(line)) is not None:
                    self.answered += 1
                    await self._answer(link, reader, 0 if expect else length, *made)
                    return
                if self._check is not None and (refusal := self._check(head)) is not None:
                    self.refused += 1
                    await self._answer(link, reader, 0 if expect else length, *refusal)
                    return
                await self._send(writer, head)
                if chunked:  # not parsed: the rest of this connection goes through raw
                    await self._pump(reader, writer)
                    return
                while length > 0:
                    data = await reader.read(min(length, self.chunk_bytes))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", length)
                    length -= len(data)
                    await self._send(writer, data)
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            _rst(writer)

    def _made_answer(self, line: bytes) -> tuple[str, bytes] | None:
        """The answer :meth:`answer` armed for a request with this first line, if any
        (one fewer left of it)."""
        for armed in self._answers:
            if armed.left > 0 and armed.marker in line:
                armed.left -= 1
                return armed.status, armed.xml
        return None

    async def _answer(
        self, link: _Link, reader: asyncio.StreamReader, body: int, status: str, xml: bytes
    ) -> None:
        """Read and drop the request's ``body`` bytes, answer ``status`` (``503 Slow Down``)
        with the ``xml`` error, close the connection (FIN) and the upstream's; whatever the
        client still sends is read first, so that the close is no RST."""
        if body:
            await reader.readexactly(body)
        head = (
            f"HTTP/1.1 {status}\r\n"
            "Content-Type: application/xml\r\n"
            f"Content-Length: {len(xml)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        link.client.write(head + xml)
        await link.client.drain()
        if link.upstream is not None:
            link.upstream.close()
        link.client.write_eof()
        try:
            async with asyncio.timeout(_DRAIN_S):
                while await reader.read(self.chunk_bytes):
                    pass
        except TimeoutError:
            pass
        link.client.close()


def _framing(head: bytes) -> tuple[int, bool, bool]:
    """A request head's body framing: (Content-Length or 0, chunked, Expect: 100-continue)."""
    length, chunked, expect = 0, False, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"expect":
            expect = value == b"100-continue"
    return length, chunked, expect
