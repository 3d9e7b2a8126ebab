"""Moving a request body from the event loop to the ingest thread, with backpressure.

The event loop reads the body (:func:`receive_body`) and :func:`pump` puts it into a
:class:`BodyPipe`, a bounded anyio memory stream; the ingest thread iterates the pipe, blocking
through ``anyio.from_thread``. Neither side borrows a worker thread to wait, so stalled
uploads cannot starve the thread pool the other routes use, and a consumer that stops early
(a rejected body) closes the pipe, which stops the producer at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request

from ckptstore_core.errors import InvalidRequest, InvalidStream
from ckptstore_service.handoff import unbatched

__all__ = [
    "BodyPipe",
    "consume_body",
    "content_length_of",
    "drain",
    "pump",
    "receive_body",
]

T = TypeVar("T")

_BATCH = 1 << 20  # body bytes handed over at a time while the consumer is busy
_DRAIN_LIMIT = 16 << 20  # read at most this much of a rejected body before answering
_DRAIN_SECONDS = 5.0
_END = object()


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

    def idle(self) -> bool:
        """True when nothing is queued: the consumer is waiting for bytes."""
        return self._send.statistics().current_buffer_used == 0

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

    def __iter__(self) -> Iterator[bytes]:
        def received() -> Iterator[object]:
            while True:
                yield from anyio.from_thread.run(self._receive_all)

        return unbatched(received(), _END)


async def receive_body(request: Request, ended: list[bool]) -> AsyncIterator[bytes]:
    """The request body, like ``request.stream()``; appends to ``ended`` at its last piece."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        more = message.get("more_body", False)
        if not more:
            ended.append(True)
        if message.get("body"):
            yield message["body"]
        if not more:
            return


async def pump(body: AsyncIterator[bytes], pipe: BodyPipe) -> None:
    """Move ``body`` into ``pipe``; a client that disconnects becomes an InvalidStream.

    The first pieces are passed on at once while the consumer waits (a slow sender's header
    is parsed as soon as it arrives); after the first ~1 MiB they are batched to ~1 MiB. Each
    hand-off wakes two threads: passing every 64 KiB piece of a fast upload to a waiting
    consumer cost ~1,000 hand-offs per 70 MB. A batch is a list of the pieces, not their
    concatenation: no copy on the event loop.
    """
    batch: list[bytes] = []
    size = 0
    sent = 0
    try:
        async for piece in body:
            batch.append(piece)
            size += len(piece)
            if size >= _BATCH or (sent < _BATCH and pipe.idle()):
                if not await pipe.put(batch):
                    return
                sent += size
                batch, size = [], 0
        if batch and not await pipe.put(batch):
            return
        await pipe.put(_END)
    except ClientDisconnect:
        await pipe.put(InvalidStream("client disconnected in the middle of the upload"))


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
    limiter: anyio.CapacityLimiter,
    consume: Callable[[Iterable[bytes], int | None], T],
) -> T:
    """Run ``consume(body, content_length)`` in a worker thread (one of ``limiter``'s) while
    the event loop streams the request body into it; returns what it returns, or raises
    what it raised once a little more of a rejected body is read (see :func:`drain`)."""
    content_length = content_length_of(request)
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

    ended: list[bool] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(pump, receive_body(request, ended), pipe)
        await anyio.to_thread.run_sync(run, limiter=limiter)
        if failure:
            tg.cancel_scope.cancel()  # rejected: stop waiting for the rest of the body
    if failure:
        if not ended:
            await drain(request)
        raise failure[0]
    return outcome[0]


def content_length_of(request: Request) -> int | None:
    """The request's Content-Length, if it sent one (InvalidRequest if it is no number)."""
    value = request.headers.get("content-length")
    if value is None:
        return None
    if not value.isascii() or not value.isdigit() or len(value) > 19:
        raise InvalidRequest(f"invalid Content-Length {value!r}")
    return int(value)
