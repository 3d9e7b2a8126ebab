"""The encoded upload's framing (ckptstore_core.encoded): exact bytes pinned, the push
parser fed in every split, and what it refuses."""

from __future__ import annotations

import itertools

import pytest

from ckptstore_core.encoded import (
    END,
    EncodedParser,
    FramePiece,
    Tail,
    TailChunk,
    encode_tail,
    frame,
)
from ckptstore_core.errors import InvalidStream, PayloadTooLarge
from ckptstore_core.wire import FORMAT, Header, StreamParser, encode_header

CK = bytes(range(16))


def body(frames: list[bytes], parent: int | None = 7) -> tuple[bytes, Tail]:
    head = encode_header([("a", "F32", (4,)), ("b", "U8", (3,))], {"format": FORMAT})[0]
    rows = [TailChunk(0, 0, 16, "none/1|planes4/1|zstd/1", CK), TailChunk(1, 0, 3, "ref", CK)]
    rows = rows[: len(frames)]
    tail = Tail(parent, tuple(rows), (CK, CK))
    out = head + b"".join(frame(len(f)) + f for f in frames)
    return out + encode_tail(parent, rows, [CK, CK]), tail


def parse(data: bytes, cut: list[int], **limits: int) -> tuple[Header, dict[int, bytes], Tail]:
    p = EncodedParser(
        StreamParser(limits.get("header", 1 << 20)), 64 << 10, limits.get("tail", 1 << 20)
    )
    frames: dict[int, bytes] = {}
    ended: list[int] = []
    header = None
    bounds = [0, *cut, len(data)]
    for lo, hi in itertools.pairwise(bounds):
        for event in p.feed(data[lo:hi]):
            if isinstance(event, Header):
                header = event
            elif isinstance(event, FramePiece):
                assert event.index not in ended
                frames[event.index] = frames.get(event.index, b"") + bytes(event.data)
                if event.last:
                    ended.append(event.index)
    assert header is not None
    assert sorted(ended) == sorted(frames)
    return header, frames, p.close()


def test_exact_bytes_of_the_frames_and_the_tail() -> None:
    assert frame(5) == b"\x05\x00\x00\x00"
    assert END == b"\xff\xff\xff\xff"
    tail = encode_tail(None, [TailChunk(0, 0, 8, "ref", CK)], [CK])
    text = b'{"parent":null,"chunks":[[0,0,8,"ref","000102030405060708090a0b0c0d0e0f"]],'
    text += b'"tensors":["000102030405060708090a0b0c0d0e0f"]}'
    assert tail == END + len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_every_split_parses_the_same(step: int) -> None:
    data, tail = body([b"0123456789abcdef", b""])
    header, frames, got = parse(data, list(range(step, len(data), step)))
    assert [t.name for t in header.tensors] == ["a", "b"]
    assert frames == {0: b"0123456789abcdef", 1: b""}
    assert got == tail


def test_refused() -> None:
    data, _ = body([b"0123456789abcdef", b""])
    with pytest.raises(InvalidStream, match="ended before its tail"):
        parse(data[:-3], [])
    with pytest.raises(InvalidStream, match="after its tail"):
        parse(data + b"x", [])
    head_end = data.index(frame(16))
    with pytest.raises(PayloadTooLarge, match="frame of 200000 bytes"):
        parse(data[:head_end] + frame(200_000), [])
    third = data[: data.index(END)] + frame(1) + b"z" + data[data.index(END) :]
    with pytest.raises(InvalidStream, match="more than the 2 frames"):
        parse(third, [])
    with pytest.raises(PayloadTooLarge, match="tail of"):
        parse(data, [], tail=10)
    one_frame = data[: data.index(frame(0) + END)]
    rows = [TailChunk(0, 0, 16, "raw/1", CK), TailChunk(1, 0, 3, "ref", CK)]
    with pytest.raises(InvalidStream, match="2 chunks for 1 frames"):
        parse(one_frame + encode_tail(7, rows, [CK, CK]), [])
    bad = data.replace(CK.hex().encode(), b"zz" * 16, 1)
    with pytest.raises(InvalidStream, match="32 hex digits"):
        parse(bad, [])
