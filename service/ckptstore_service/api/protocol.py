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
a real server.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["BodyPieces", "BodyPiecesProtocol"]


class BodyPieces:
    """A request body's pieces since the app last received; ``bytes()`` joins them."""

    __slots__ = ("pieces", "size")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.size = 0

    def append(self, piece: bytes) -> None:
        self.pieces.append(piece)
        self.size += len(piece)

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        if len(self.pieces) == 1:
            return self.pieces[0]
        return b"".join(self.pieces)


# Reading pauses once this many body bytes wait for the app. uvicorn's own mark, 64 KiB,
# paused and resumed the socket for nearly every 256 KiB piece uvloop reads (two epoll
# changes and a wake-up each): with 4 MiB, the event loop's CPU per GB saved went from
# 0.62-0.69 to 0.48-0.49 s (bench/profile_save.py, the bench's GPT, 9 saves of 70 MB).
# Memory stays bounded: at most this much and one piece per connection.
HIGH_WATER = 4 << 20


class BodyPiecesProtocol(HttpToolsProtocol):
    def on_body(self, body: bytes) -> None:
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
