"""uvicorn's httptools protocol, minus two copies of every request body byte.

uvicorn (0.42-0.54) appends each piece of a body to a ``bytearray`` (``cycle.body += body``)
and hands it to the app as ``bytes(cycle.body)``: two copies, on the event loop and holding
the GIL, of every byte a save uploads, on top of the one httptools makes. Here the pieces are
kept as they come and ``bytes()`` of them is the piece itself when there is one (the usual
case: the app asks for more as soon as a piece arrives), their join otherwise. Measured on 9
saves of bench/'s fine-tune checkpoints (117 MB each): the event loop thread's CPU time went
from 1.0-1.1 s to 0.83-0.84 s. Flow control pauses reading above :data:`HIGH_WATER` (4 MiB)
rather than uvicorn's 64 KiB.

Pass the class as ``uvicorn.run(..., http=BodyPiecesProtocol)``: ``Config.http`` takes a
protocol class as well as a name. It relies on how uvicorn's request cycle holds the body
(``cycle.body``, read with ``bytes()`` and reset to an empty ``bytearray`` by ``receive``;
0.41 and older hand the app ``cycle.body`` itself), so pyproject.toml keeps uvicorn within
0.42-0.54, the versions whose source does that; ``tests/api/test_protocol.py`` checks it under
a real server, on uvloop and on asyncio's own loop.

Two more copies go for a body with a Content-Length (a save's): once its headers are parsed,
the bytes the socket delivers are the body's until its length is reached, so they go to the
request as they are, not through httptools (which copies each into a new ``bytes``); at its
end the connection gets a fresh parser for its next request. And the route that streams a
body takes its pieces as a list (:func:`receive_pieces`, the scope's
``extensions[PIECES]["receive"]``) where uvicorn's ``receive`` joins those that arrived
since it last asked: on the event loop, holding the GIL, while the ingest thread waits.

And one more: uvloop reads a socket 256 KiB at a time into a buffer of its own and copies
each read into a new ``bytes``, holding the GIL. :class:`BodyPiecesProtocol` is an
``asyncio.BufferedProtocol`` around uvicorn's (uvloop reads into a protocol's own buffers
only for one that is no ``asyncio.Protocol``): such a body is read into 1 MiB buffers and
its pieces are read-only memoryviews of them, up to 1 MiB each (anything else is read as
uvloop would and copied out). The buffers are sealed (``handoff.SealedBuffer``: never
written again once read), so a direct save's frames go on to the blob writer uncopied. On 9
saves of bench/'s fine-tune checkpoints through HTTP the event loop's CPU went from 0.53 to
0.40 s and the service's from 4.12 to 3.87 s (``bench/ab_saves.py``, medians of six passes).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Awaitable, Callable

import httptools
import numpy as np
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from ckptstore_core.codec import Buffer
from ckptstore_service.handoff import SealedBuffer

__all__ = ["PIECES", "BodyPieces", "BodyPiecesProtocol", "Received", "receive_pieces"]

#: The scope extension whose ``"receive"`` is a request's :func:`receive_pieces` (no argument).
PIECES = "ckptstore.body_pieces"

#: What :func:`receive_pieces` returns: the pieces (``bytes``, or read-only memoryviews
#: of the buffers a body is read into) and whether more follow, or None once the client is
#: gone.
Received = tuple[list[Buffer], bool] | None


class BodyPieces:
    """A request body's pieces since the app last received; ``bytes()`` joins them."""

    __slots__ = ("pieces", "size")

    def __init__(self) -> None:
        self.pieces: list[Buffer] = []
        self.size = 0

    def append(self, piece: Buffer) -> None:
        self.pieces.append(piece)
        self.size += len(piece)

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        if len(self.pieces) == 1:
            return bytes(self.pieces[0])  # the piece itself if it is bytes
        return b"".join(self.pieces)


# Reading pauses once this many body bytes wait for the app. uvicorn's own mark, 64 KiB,
# paused and resumed the socket for nearly every 256 KiB piece uvloop reads (two epoll
# changes and a wake-up each): with 4 MiB, the event loop's CPU per GB saved went from
# 0.62-0.69 to 0.48-0.49 s (bench/profile_save.py, the bench's GPT, 9 saves of 70 MB).
# Memory stays bounded: at most this much and one piece per connection.
HIGH_WATER = 4 << 20


# A body with a Content-Length is read into buffers of this size, each read offered what is
# left of the current one (a piece of the body: a view of it) or a new one when that is
# less than _MIN_READ; anything else is read into a buffer of _HEAD_READ per event loop
# thread and copied out, as uvloop does.
READ_BYTES = 1 << 20
_MIN_READ = 64 << 10
_HEAD_READ = 256 << 10


class _HeadBuffer(threading.local):
    def __init__(self) -> None:
        self.view = memoryview(bytearray(_HEAD_READ))


_HEAD = _HeadBuffer()


class BodyPiecesProtocol(asyncio.BufferedProtocol):
    """uvicorn's httptools protocol (:class:`_PiecesHttp`, ``self.http``) behind buffers of
    its own (see the module's docstring)."""

    def __init__(self, **kwargs: object) -> None:
        self.http = _PiecesHttp(**kwargs)  # type: ignore[arg-type]
        self._room: memoryview | None = None  # what is left of the body buffer being filled
        self._reading = _HEAD.view  # the buffer offered to the read under way

    def get_buffer(self, sizehint: int) -> memoryview:
        left = self.http.body_left
        if not left:
            self._room = None
            self._reading = _HEAD.view
        else:
            room = self._room
            if room is None or len(room) < min(left, _MIN_READ):
                size = min(left, READ_BYTES)
                room = self._room = np.empty(size, np.uint8).view(SealedBuffer).data
            self._reading = room[:left]
        return self._reading

    def buffer_updated(self, nbytes: int) -> None:
        if self._room is None:
            self.http.data_received(bytes(self._reading[:nbytes]))
            return
        piece = self._reading[:nbytes].toreadonly()
        self._room = self._room[nbytes:]
        self.http.data_received(piece)
        if not self.http.body_left:  # the body's end: an idle connection holds no buffer
            self._room = None
            self._reading = _HEAD.view

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.http.connection_made(transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self.http.connection_lost(exc)

    def eof_received(self) -> None:
        self.http.eof_received()

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()


class _PiecesHttp(HttpToolsProtocol):
    # body bytes of the current request still to come, when its Content-Length says (0:
    # the parser finds the body's end: chunked bodies, none, an upgrade's, a last request's)
    body_left = 0

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return  # an upgrade: no request cycle of its own
        extensions = self.scope.setdefault("extensions", {})
        extensions[PIECES] = {"receive": _pieces_of(cycle)}  # ASGI: a dict
        # Left to the parser: an upgrade's body (httptools skips it, never counting it down)
        # and a body after which the connection closes (the parser ignores what follows,
        # uvicorn's lenient_data_after_close; a fresh one would parse it as a request)
        if not self.parser.should_upgrade() and self.parser.should_keep_alive():
            self.body_left = _content_length(self.headers)

    def data_received(self, data: Buffer) -> None:
        left = self.body_left
        if not left:
            super().data_received(bytes(data))  # bytes: what the event loop read outside a body
            return
        # in the body: the parser has seen the headers and counts the body's bytes down;
        # they are passed on as they came, and the parser replaced at the body's end (a read
        # in the body is offered no more than what is left of it: the next request's bytes
        # come in a read of their own, BodyPiecesProtocol.get_buffer)
        assert len(data) <= left
        self._unset_keepalive_if_required()
        self.on_body(data)
        if self.body_left:
            return
        self.parser = _fresh_parser(self)
        self.on_message_complete()

    def on_body(self, body: Buffer) -> None:
        self.body_left = max(0, self.body_left - len(body))
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        pending: object = cycle.body
        if not isinstance(pending, BodyPieces):
            # a new request, or the app just took the last pieces (receive() leaves an
            # empty bytearray behind); bytes buffered some other way come first
            leftover = bytes(cycle.body)
            pending = BodyPieces()
            if leftover:
                pending.append(leftover)
            setattr(cycle, "body", pending)  # noqa: B010 - typed as uvicorn's bytearray
        pending.append(body)
        if len(pending) > HIGH_WATER:
            self.flow.pause_reading()
        cycle.message_event.set()


def _fresh_parser(protocol: HttpToolsProtocol) -> httptools.HttpRequestParser:
    """A parser for the connection's next request, set up as uvicorn's ``__init__`` sets up
    the first."""
    parser = httptools.HttpRequestParser(protocol)
    with contextlib.suppress(AttributeError):  # httptools < 0.6.3, as uvicorn's own
        parser.set_dangerous_leniencies(lenient_data_after_close=True)
    return parser


def _pieces_of(cycle: RequestResponseCycle) -> Callable[[], Awaitable[Received]]:
    """:func:`receive_pieces` of ``cycle``, holding it weakly: the cycle holds the scope that
    holds this, and a reference cycle would keep each finished request (its body pieces
    included) until the garbage collector's next full pass."""
    ref = weakref.ref(cycle)

    async def receive() -> Received:
        alive = ref()
        return None if alive is None else await receive_pieces(alive)

    return receive


def _content_length(headers: list[tuple[bytes, bytes]]) -> int:
    """A request's Content-Length, if it has one and no Transfer-Encoding, else 0
    (the parser has refused an invalid one already)."""
    length = 0
    for name, value in headers:
        if name == b"transfer-encoding":
            return 0
        if name == b"content-length" and value.isdigit():
            length = int(value)
    return length


async def receive_pieces(cycle: RequestResponseCycle) -> Received:
    """uvicorn's ``RequestResponseCycle.receive`` (0.42-0.54) for a request body, with the
    pieces that arrived since the last call as they came rather than joined: ``(pieces,
    more_body)``, or None once the client disconnected (``http.disconnect``)."""
    if cycle.waiting_for_100_continue and not cycle.transport.is_closing():
        cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        cycle.waiting_for_100_continue = False
    if not cycle.disconnected and not cycle.response_complete:
        cycle.flow.resume_reading()
        await cycle.message_event.wait()
        cycle.message_event.clear()
    if cycle.disconnected or cycle.response_complete:
        return None
    body: bytearray | BodyPieces = cycle.body
    cycle.body = bytearray()
    if isinstance(body, BodyPieces):
        return body.pieces, cycle.more_body
    return ([bytes(body)] if body else []), cycle.more_body
