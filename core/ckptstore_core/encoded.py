"""The encoded upload: a part whose chunks its writer encoded itself (``direct=True``).

A writer that runs the chunk pipeline (:mod:`ckptstore_core.pipeline`) against a plan from
the service sends what it stored, not the raw tensors, as one body
(``Content-Type: application/vnd.ckptstore.encoded``)::

    body   := header frame* end tail
    header := u64 LE N | N bytes of JSON: the safetensors header of the part's raw tensors,
              exactly as a plain upload's (its data_offsets describe the raw data section
              the chunks are cut from)
    frame  := u32 LE n (n < 0xFFFFFFFF) | n bytes: one chunk's stored bytes (n = 0: a ref)
    end    := u32 LE 0xFFFFFFFF
    tail   := u64 LE M | M bytes of JSON:
              {"parent": <the parent checkpoint id the chunks were encoded against, or null>,
               "chunks": [[tensor_idx, offset, raw_len, codec, checksum], ...],
               "tensors": [checksum, ...]}

``chunks`` holds one row per frame, in frame order: the chunk's place in its tensor, its
codec spec and the xxh3-128 of its raw bytes (32 hex digits), computed before encoding;
``tensors`` holds each header tensor's xxh3-128 in header order. A chunk's place in the blob
is its frame's: the receiver appends frames in order. Bases, depths and sibling links are
not sent: the receiver derives them from its own plan of the same parent (the writer's
``parent`` must still be the step's parent), so a writer can name no chunk but the one at
the same place in the parent.

:class:`EncodedParser` is a push parser without I/O, like :class:`ckptstore_core.wire.
StreamParser`: feed it bytes as they arrive; it yields the :class:`~ckptstore_core.wire.
Header` once, then :class:`FramePiece` objects, then the :class:`Tail`. :func:`frame` and
:func:`encode_tail` are the writer's side.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ckptstore_core import codec
from ckptstore_core.errors import InvalidStream, PayloadTooLarge
from ckptstore_core.pipeline.rows import ChunkInfo, TensorInfo
from ckptstore_core.wire import Header, StreamParser

__all__ = [
    "CONTENT_TYPE",
    "END",
    "EncodedParser",
    "FramePiece",
    "Plan",
    "Tail",
    "TailChunk",
    "chunk_cut",
    "FRAME_SLACK",
    "encode_tail",
    "frame",
    "parse_tail",
    "tail_doc",
]

CONTENT_TYPE = "application/vnd.ckptstore.encoded"
_END_MARK = 0xFFFFFFFF
FRAME_SLACK = 1 << 16  # a chunk stored raw plus its codec's headers, at most
END = struct.pack("<I", _END_MARK)


@dataclass(frozen=True, slots=True)
class TailChunk:
    tensor_idx: int
    offset: int
    raw_len: int
    codec: str
    checksum: bytes


@dataclass(frozen=True, slots=True)
class Tail:
    parent: int | None
    chunks: tuple[TailChunk, ...]
    tensors: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class FramePiece:
    """Bytes of frame ``index`` (its chunk's stored bytes); ``last``: the frame's end.
    A view into the fed buffer: copy it before feeding again."""

    index: int
    data: memoryview
    last: bool


@dataclass(frozen=True)
class Plan:
    """What a writer encodes a part against (``POST .../plan``): the step's parent
    (``parent_id``/``parent_step``, None: the run's first), whether the save is a keyframe
    (no deltas at all), ``since_keyframe``, the chain depth limit, the chunk size and zstd
    level, and the parent's tensors and chunks of the names asked for (``begin`` of a
    tensor: its place in the parent's data section)."""

    parent_id: int | None
    parent_step: int | None
    keyframe: bool
    since_keyframe: int
    max_chain_depth: int
    chunk_bytes: int
    zstd_level: int
    tensors: tuple[TensorInfo, ...]
    chunks: tuple[ChunkInfo, ...]
    #: the store takes the part's blob straight from the writer (``POST .../upload``,
    #: presigned S3 URLs), else it is sent through the service (``PUT .../encoded``)
    presigned: bool = False

    def to_json(self) -> dict[str, object]:
        """Rows as arrays, not objects: a large part's parent has many chunks."""
        return {
            "parent_id": self.parent_id,
            "parent_step": self.parent_step,
            "keyframe": self.keyframe,
            "since_keyframe": self.since_keyframe,
            "max_chain_depth": self.max_chain_depth,
            "chunk_bytes": self.chunk_bytes,
            "zstd_level": self.zstd_level,
            "presigned": self.presigned,
            "tensors": [
                [t.idx, t.name, t.dtype, list(t.shape), t.begin, t.nbytes, t.checksum.hex()]
                for t in self.tensors
            ],
            "chunks": [
                [
                    c.id,
                    c.tensor_idx,
                    c.offset,
                    c.raw_len,
                    c.itemsize,
                    c.codec,
                    c.base_id,
                    c.depth,
                    c.checksum.hex(),
                ]
                for c in self.chunks
            ],
        }

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> Plan:
        """The plan a service answered (trusted: a writer asks its own service)."""
        t_rows = doc["tensors"]
        c_rows = doc["chunks"]
        assert isinstance(t_rows, list) and isinstance(c_rows, list)
        tensors = tuple(
            TensorInfo(i, n, d, tuple(sh), b, nb, bytes.fromhex(ck))
            for i, n, d, sh, b, nb, ck in t_rows
        )
        chunks = tuple(
            ChunkInfo(ti, off, rl, its, cd, base, dp, 0, 0, bytes.fromhex(ck), cid, "", 0)
            for cid, ti, off, rl, its, cd, base, dp, ck in c_rows
        )
        return cls(
            _opt_int(doc["parent_id"]),
            _opt_int(doc["parent_step"]),
            bool(doc["keyframe"]),
            _known_int(doc["since_keyframe"]),
            _known_int(doc["max_chain_depth"]),
            _known_int(doc["chunk_bytes"]),
            _known_int(doc["zstd_level"]),
            tensors,
            chunks,
            bool(doc.get("presigned", False)),
        )


def _opt_int(value: object) -> int | None:
    return None if value is None else _known_int(value)


def _known_int(value: object) -> int:
    assert type(value) is int  # the plan comes from the writer's own service
    return value


def frame(size: int) -> bytes:
    """The prefix of a frame of ``size`` bytes."""
    if not 0 <= size < _END_MARK:
        raise ValueError(f"a frame holds at most {_END_MARK - 1} bytes, not {size}")
    return struct.pack("<I", size)


def tail_doc(
    parent: int | None, chunks: Sequence[TailChunk], tensors: Sequence[bytes]
) -> dict[str, object]:
    """The tail's JSON document (see the module's docstring)."""
    return {
        "parent": parent,
        "chunks": [[c.tensor_idx, c.offset, c.raw_len, c.codec, c.checksum.hex()] for c in chunks],
        "tensors": [t.hex() for t in tensors],
    }


def encode_tail(parent: int | None, chunks: Sequence[TailChunk], tensors: Sequence[bytes]) -> bytes:
    """``end`` followed by the tail (see the module's docstring)."""
    text = json.dumps(tail_doc(parent, chunks, tensors), separators=(",", ":")).encode()
    return END + struct.pack("<Q", len(text)) + text


def chunk_cut(header: Header, chunk_bytes: int) -> Iterator[tuple[int, int, int]]:
    """Every chunk of the header's tensors, ``(tensor, offset, length)``, in stream order:
    the cut of :class:`ckptstore_core.pipeline.Splitter` (fixed chunks of
    :func:`ckptstore_core.codec.chunk_step` bytes, the last one shorter)."""
    for i, t in enumerate(header.tensors):
        step = codec.chunk_step(t.itemsize, chunk_bytes)
        for offset in range(0, t.nbytes, step):
            yield i, offset, min(step, t.nbytes - offset)


class EncodedParser:
    """Push parser of an encoded upload (see the module's docstring): ``header`` parses its
    safetensors header, within the caller's limits; for chunks of ``chunk_bytes``, a
    frame holds at most a chunk and its codec's headers, there are as many frames as the
    header's tensors have chunks (:func:`chunk_cut`), ``max_tail`` bounds the tail's
    JSON. :meth:`close` returns the tail once the body ended exactly after it
    (InvalidStream otherwise)."""

    def __init__(self, header: StreamParser, chunk_bytes: int, max_tail: int) -> None:
        self._header = header
        self._chunk_bytes = chunk_bytes
        self._max_frame = max(codec.chunk_step(8, chunk_bytes), chunk_bytes) + FRAME_SLACK
        self.max_frames = 0  # known once the header is
        self._max_tail = max_tail
        self.header: Header | None = None
        self._fed = 0  # bytes fed before the header was complete
        self._state = "prefix"  # what comes next: prefix, frame, tail_len, tail, done
        self._buf = bytearray()  # a frame's prefix, the tail's length, or the tail
        self._frames = 0
        self._left = 0  # bytes of the current frame still to come
        self._tail_len = 0
        self.tail: Tail | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[Header | FramePiece | Tail]:
        view = memoryview(data).cast("B")
        if self.header is None:
            for event in self._header.feed(view):
                assert isinstance(event, Header)  # the header is yielded first, alone
                self.header = event
                self.max_frames = sum(1 for _ in chunk_cut(event, self._chunk_bytes))
                yield event
                break
            if self.header is None:
                self._fed += len(view)
                return
            view = view[self.header.header_len - self._fed :]
        while len(view):
            if self._state == "frame":
                take = min(self._left, len(view))
                self._left -= take
                yield FramePiece(self._frames - 1, view[:take], self._left == 0)
                view = view[take:]
                if not self._left:
                    self._state = "prefix"
                continue
            if self._state == "done":
                raise InvalidStream("the encoded body goes on after its tail")
            need = self._need() - len(self._buf)
            self._buf += view[:need]
            view = view[need:]
            if len(self._buf) == self._need():
                yield from self._complete()

    def _need(self) -> int:
        return {"prefix": 4, "tail_len": 8}.get(self._state, self._tail_len)

    def _complete(self) -> Iterator[FramePiece | Tail]:
        """The bytes of a prefix, the tail's length or the tail are all in ``_buf``."""
        buf, self._buf = bytes(self._buf), bytearray()
        if self._state == "tail_len":
            (self._tail_len,) = struct.unpack("<Q", buf)
            if self._tail_len > self._max_tail:
                raise PayloadTooLarge(
                    f"a tail of {self._tail_len} bytes exceeds the limit of {self._max_tail}"
                )
            self._state = "tail"
            if self._tail_len:
                return
            buf = b""
        if self._state == "tail":
            self.tail = parse_tail(buf, self._frames)
            self._state = "done"
            yield self.tail
            return
        (n,) = struct.unpack("<I", buf)
        if n == _END_MARK:
            self._state = "tail_len"
            return
        if n > self._max_frame:
            raise PayloadTooLarge(f"a frame of {n} bytes exceeds the limit of {self._max_frame}")
        if self._frames >= self.max_frames:
            raise InvalidStream(f"more than the {self.max_frames} frames the header allows")
        self._frames += 1
        self._left = n
        if n:
            self._state = "frame"
        else:
            yield FramePiece(self._frames - 1, memoryview(b""), True)

    def close(self) -> Tail:
        if self.tail is None:
            raise InvalidStream("the encoded body ended before its tail")
        return self.tail


def _checksum(value: object) -> bytes:
    if not isinstance(value, str) or len(value) != 32:
        raise InvalidStream(f"a checksum must be 32 hex digits, not {value!r:.40}")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise InvalidStream(f"a checksum must be 32 hex digits, not {value!r:.40}") from None


def _int(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise InvalidStream(f"{what} must be a non-negative integer, not {value!r:.40}")
    return value


def parse_tail(text: bytes, frames: int) -> Tail:
    """The tail's JSON ``text`` of a part of ``frames`` chunks (InvalidStream if it is not
    one)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidStream(f"the encoded body's tail is not JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"parent", "chunks", "tensors"}:
        raise InvalidStream('the tail must be {"parent": ..., "chunks": [...], "tensors": [...]}')
    parent = doc["parent"]
    if parent is not None:
        parent = _int(parent, "parent")
    rows, tensors = doc["chunks"], doc["tensors"]
    if not isinstance(rows, list) or not isinstance(tensors, list):
        raise InvalidStream("the tail's chunks and tensors must be lists")
    if len(rows) != frames:
        raise InvalidStream(f"the tail describes {len(rows)} chunks for {frames} frames")
    chunks = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 5 or not isinstance(row[3], str):
            raise InvalidStream(
                f"a chunk row must be [tensor, offset, length, codec, checksum]: {row!r:.80}"
            )
        idx, off, n = (_int(v, "a chunk's place") for v in row[:3])
        if len(row[3]) > 200:
            raise InvalidStream("a chunk's codec spec is longer than 200 characters")
        chunks.append(TailChunk(idx, off, n, row[3], _checksum(row[4])))
    return Tail(parent, tuple(chunks), tuple(_checksum(t) for t in tensors))
