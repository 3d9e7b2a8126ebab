"""Moving a request body from the event loop to the ingest thread, with backpressure.

The event loop reads the body (:func:`receive_body`) and :func:`pump` puts it into a
:class:`BodyPipe`, a bounded anyio memory stream; the ingest thread iterates the pipe, blocking
through ``anyio.from_thread``. Neither side borrows a worker thread to wait, so stalled
uploads cannot starve the thread pool the other routes use, and a consumer that stops early
(a rejected body) closes the pipe, which stops the producer at once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar, cast

import anyio
from starlette.requests import ClientDisconnect, Request

from ckptstore_core.codec import Buffer
from ckptstore_core.errors import InvalidRequest, InvalidStream, RequestTimeout, TooManyUploads
from ckptstore_service.api.protocol import PIECES, Received
from ckptstore_service.handoff import unbatched

__all__ = [
    "BodyLimits",
    "BodyPipe",
    "Uploads",
    "client_of",
    "consume_body",
    "content_length_of",
    "drain",
    "pump",
    "receive_body",
]

T = TypeVar("T")

_BATCH = 1 << 20  # body bytes handed over at a time, after the first ones
_DRAIN_LIMIT = 16 << 20  # read at most this much of a rejected body before answering
_DRAIN_SECONDS = 5.0
_END = object()


@dataclass(frozen=True)
class BodyLimits:
    """How slow a body may be: ``idle_s`` without a byte, or fewer than ``min_rate`` bytes
    per second over any ``window_s`` (0: no minimum), and the upload is cut
    (:class:`RequestTimeout`), releasing its slot and the run's lock."""

    idle_s: float
    min_rate: float
    window_s: float


@dataclass
class Uploads:
    """The uploads' worker slots (apart from the pool other routes share) and limits: at
    most ``per_client`` of them (0: no cap) taken or waited for by one client (its token's
    name, or its address when it sends none), so one client cannot hold them all. Used on
    the event loop only. Likewise the header bytes a client's uploads in flight announce
    together (``header_bytes_per_client``)."""

    limiter: anyio.CapacityLimiter
    limits: BodyLimits
    per_client: int = 0
    #: the most header bytes one client's uploads in flight may announce together (0: no
    #: cap): a header costs a multiple of its size from its parse to its upload's end
    header_bytes_per_client: int = 0
    _by_client: dict[str, int] = field(default_factory=dict)
    _headers: dict[str, int] = field(default_factory=dict)

    def take(self, client: str) -> None:
        """Count one more upload of ``client`` (give it back with :meth:`give_back`);
        TooManyUploads (503, with Retry-After) if it holds its share already."""
        n = self._by_client.get(client, 0)
        if self.per_client and n >= self.per_client:
            raise TooManyUploads(
                f"{client} has {n} uploads in progress, its share of this replica's "
                f"{self.limiter.total_tokens:g} upload slots "
                "(CKPTSTORE_MAX_UPLOADS_PER_CLIENT): retry once one is done"
            )
        self._by_client[client] = n + 1

    def give_back(self, client: str) -> None:
        _count_down(self._by_client, client, 1)

    def take_header(self, client: str, header_bytes: int) -> None:
        """Count ``header_bytes`` more of ``client``'s headers in flight (give them back with
        :meth:`give_back_header`); TooManyUploads if they would pass its share. A client
        with none in flight may always send one: the parser refuses one over the limit."""
        held = self._headers.get(client, 0)
        cap = self.header_bytes_per_client
        if cap and held and held + header_bytes > cap:
            raise TooManyUploads(
                f"{client} has uploads in progress whose headers announce {held} bytes; one "
                f"more of {header_bytes} would pass its share of {cap} "
                "(CKPTSTORE_MAX_HEADER_BYTES): retry once one is done"
            )
        if header_bytes:
            self._headers[client] = held + header_bytes

    def give_back_header(self, client: str, header_bytes: int) -> None:
        if header_bytes:
            _count_down(self._headers, client, header_bytes)

    def in_use(self, client: str) -> int:
        """The slots ``client`` holds or waits for now."""
        return self._by_client.get(client, 0)


def _count_down(counts: dict[str, int], client: str, n: int) -> None:
    left = counts[client] - n
    if left:
        counts[client] = left
    else:
        del counts[client]


def client_of(request: Request) -> str:
    """Who an upload counts against: its token's name, else its address."""
    principal = getattr(request.state, "principal", None)  # set by api.auth's middleware
    name = getattr(principal, "name", None)
    if name:
        return f"token {name!r}"
    peer = request.client
    return f"client {peer.host if peer else 'unknown'}"


class BodyPipe:
    """Bounded hand-off: async producer on the event loop, sync consumer in a worker thread."""

    def __init__(self, maxsize: int = 8) -> None:
        self._send, self._recv = anyio.create_memory_object_stream[object](maxsize)

    async def put(self, item: object) -> bool:
        """False once the consumer is gone."""
        try:
            await self._send.send(item)
            return True
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False

    def close(self) -> None:
        """Consumer side, from its worker thread: stop the producer."""
        anyio.from_thread.run_sync(self._recv.close)

    async def _receive_all(self) -> list[object]:
        """Wait for one item, then take whatever else is queued: one thread hop for all."""
        items = [await self._recv.receive()]
        while True:
            try:
                items.append(self._recv.receive_nowait())
            except anyio.WouldBlock:
                return items

    def __iter__(self) -> Iterator[Buffer]:
        def received() -> Iterator[object]:
            while True:
                yield from anyio.from_thread.run(self._receive_all)

        return unbatched(received(), _END)


async def receive_body(
    request: Request, ended: list[bool], limits: BodyLimits
) -> AsyncIterator[Buffer]:
    """The request body's pieces, like ``request.stream()``; appends to ``ended`` at its
    last message. RequestTimeout when it stalls past ``limits``."""
    receive = _pieces_receiver(request)
    window_start, window_bytes = time.monotonic(), 0
    while True:
        with anyio.move_on_after(limits.idle_s) as idle:
            got = await receive()
        if idle.cancelled_caught:
            raise RequestTimeout(f"the upload sent no byte for {limits.idle_s:g} s: cut")
        if got is None:
            raise ClientDisconnect()
        pieces, more = got
        if not more:
            ended.append(True)
        window_bytes += sum(map(len, pieces))
        now = time.monotonic()
        if more and limits.min_rate and now - window_start >= limits.window_s:
            rate = window_bytes / (now - window_start)
            if rate < limits.min_rate:
                raise RequestTimeout(
                    f"the upload sent {rate:.0f} bytes/s over {now - window_start:.0f} s, "
                    f"under the minimum of {limits.min_rate:g}: cut"
                )
            window_start, window_bytes = now, 0
        for piece in pieces:
            if piece:
                yield piece
        if not more:
            return


def _pieces_receiver(request: Request) -> Callable[[], Awaitable[Received]]:
    """What receives the body's pieces: the server's :func:`~.protocol.receive_pieces`
    (no join of the pieces that arrived together) where it offers it, else ASGI's
    ``receive`` (another server, an in-process transport)."""
    take = request.scope.get("extensions", {}).get(PIECES, {}).get("receive")
    if take is not None:
        return cast(Callable[[], Awaitable[Received]], take)

    async def receive() -> Received:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return None
        piece = message.get("body", b"")
        return ([piece] if piece else []), message.get("more_body", False)

    return receive


async def pump(body: AsyncIterator[Buffer], pipe: BodyPipe) -> None:
    """Move ``body`` into ``pipe``; a client that disconnects becomes an InvalidStream.

    The pieces of the first ~1 MiB are passed on one by one, as they arrive: the consumer
    must see a slow sender's header and first tensor bytes even if nothing follows for a
    while (a writer takes its run's lock only once data flows; holding a piece back until
    the consumer was idle left the first tensor's bytes here whenever they arrived before
    the consumer's thread had taken the header). After that, pieces are batched to ~1 MiB:
    each hand-off wakes two threads, and passing every 64 KiB piece of a fast upload cost
    ~1,000 hand-offs per 70 MB. A batch is a list of the pieces, not their concatenation:
    no copy on the event loop.
    """
    batch: list[Buffer] = []
    size = 0
    sent = 0
    try:
        async for piece in body:
            batch.append(piece)
            size += len(piece)
            if size >= _BATCH or sent < _BATCH:
                if not await pipe.put(batch):
                    return
                sent += size
                batch, size = [], 0
        if batch and not await pipe.put(batch):
            return
        await pipe.put(_END)
    except ClientDisconnect:
        await pipe.put(InvalidStream("client disconnected in the middle of the upload"))
    except RequestTimeout as exc:
        await pipe.put(exc)


async def drain(request: Request) -> None:
    """Read a little more of a rejected body so the client sees our answer, not a reset."""
    seen = 0
    with anyio.move_on_after(_DRAIN_SECONDS):
        while seen <= _DRAIN_LIMIT:
            message = await request.receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


async def consume_body(
    request: Request,
    uploads: Uploads,
    consume: Callable[[Iterable[Buffer], int | None], T],
) -> T:
    """Run ``consume(body, content_length)`` in a worker thread (one of ``uploads``' slots)
    while the event loop streams the request body into it; returns what it returns, or
    raises what it raised once a little more of a rejected body is read (see
    :func:`drain`). The slot is taken once the body's first bytes arrived: a client that
    sends only its request's headers holds none (and is cut after the idle timeout); a
    client holding its share of the slots already is refused then (TooManyUploads)."""
    content_length = content_length_of(request)
    ended: list[bool] = []
    body = receive_body(request, ended, uploads.limits)
    first = await _first_piece(body, content_length)
    first = await _with_length_prefix(first, body)
    client = client_of(request)
    header_bytes = _announced_header(first, uploads.header_bytes_per_client)
    try:
        uploads.take(client)
    except TooManyUploads:
        await drain(request)
        raise
    try:
        try:
            uploads.take_header(client, header_bytes)
        except TooManyUploads:
            await drain(request)
            raise
        try:
            return await _consume(request, uploads, consume, content_length, ended, body, first)
        finally:
            uploads.give_back_header(client, header_bytes)
    finally:
        uploads.give_back(client)


async def _with_length_prefix(first: Buffer | None, body: AsyncIterator[Buffer]) -> Buffer | None:
    """``first`` and as many pieces after it as make the body's 8-byte header length (all
    of a shorter body)."""
    if first is None or len(first) >= 8:
        return first
    pieces = [first]
    async for piece in body:
        pieces.append(piece)
        if sum(map(len, pieces)) >= 8:
            break
    return b"".join(pieces)


def _announced_header(first: Buffer | None, cap: int) -> int:
    """The header length a safetensors body announces in its first 8 bytes; 0 for a body
    too short to say, or for one over ``cap`` (0: no cap): the parser refuses that one on
    its first 8 bytes (413), before buffering any of it."""
    if first is None or len(first) < 8:
        return 0
    n = int.from_bytes(first[:8], "little")
    return 0 if cap and n > cap else n  # over the cap: the parser's 413, never buffered


async def _consume(
    request: Request,
    uploads: Uploads,
    consume: Callable[[Iterable[Buffer], int | None], T],
    content_length: int | None,
    ended: list[bool],
    body: AsyncIterator[Buffer],
    first: Buffer | None,
) -> T:
    pipe = BodyPipe()
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(consume(pipe, content_length))
        except BaseException as exc:
            failure.append(exc)
        finally:
            pipe.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(pump, _chained(first, body), pipe)
        await anyio.to_thread.run_sync(run, limiter=uploads.limiter)
        if failure:
            tg.cancel_scope.cancel()  # rejected: stop waiting for the rest of the body
    if failure:
        if not ended and not isinstance(failure[0], RequestTimeout):  # a stalled client
            await drain(request)  # would only stall the answer
        raise failure[0]
    return outcome[0]


async def _first_piece(body: AsyncIterator[Buffer], content_length: int | None) -> Buffer | None:
    """The body's first bytes (None: it has none); a client that disconnects or stalls
    before sending any gets its error here, before it takes a slot."""
    if content_length == 0:
        return None
    try:
        return await anext(body)
    except StopAsyncIteration:
        return None
    except ClientDisconnect:
        raise InvalidStream("client disconnected before sending its body") from None


async def _chained(first: Buffer | None, rest: AsyncIterator[Buffer]) -> AsyncIterator[Buffer]:
    if first is not None:
        yield first
    async for piece in rest:
        yield piece


def content_length_of(request: Request) -> int | None:
    """The request's Content-Length, if it sent one (InvalidRequest if it is no number)."""
    value = request.headers.get("content-length")
    if value is None:
        return None
    if not value.isascii() or not value.isdigit() or len(value) > 19:
        raise InvalidRequest(f"invalid Content-Length {value!r}")
    return int(value)
