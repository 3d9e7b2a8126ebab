"""The wire format: exact bytes, validity as safetensors, and the streaming parser."""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from ckptstore_core.errors import InvalidStream, PayloadTooLarge, UnsupportedDtype
from ckptstore_core.wire import DTYPE_SIZES, Header, StreamParser, TensorPiece, encode_header


def _parse(data: bytes, piece: int = 1 << 20) -> tuple[Header, dict[int, bytearray]]:
    parser = StreamParser(max_header_bytes=1 << 20)
    out: dict[int, bytearray] = {}
    for i in range(0, len(data), piece):
        for ev in parser.feed(data[i : i + piece]):
            if isinstance(ev, TensorPiece):
                buf = out.setdefault(ev.index, bytearray())
                assert ev.offset == len(buf)
                buf += ev.data
    return parser.close(), out


def test_header_exact_bytes() -> None:
    prefix, header = encode_header(
        [("w", "F32", (2,)), ("b", "BF16", ())], {"format": "ckptstore/1"}
    )
    text = (
        b'{"__metadata__":{"format":"ckptstore/1"},'
        b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"BF16","shape":[],"data_offsets":[8,10]}}'
    )
    padded = text + b" " * (-len(text) % 8)
    assert prefix == struct.pack("<Q", len(padded)) + padded
    assert len(prefix) % 8 == 0
    assert header.header_len == len(prefix)
    assert header.data_len == 10
    assert [(t.name, t.begin, t.end) for t in header.tensors] == [("w", 0, 8), ("b", 8, 10)]


def test_exact_bytes_of_a_whole_file() -> None:
    prefix, _ = encode_header([("x", "U8", (3,))], {})
    body = prefix + bytes([1, 2, 3])
    assert body == (
        struct.pack("<Q", 72)
        + b'{"__metadata__":{},"x":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}'.ljust(72)
        + b"\x01\x02\x03"
    )


def test_output_is_valid_safetensors() -> None:
    arrays = {
        "a/b": np.arange(12, dtype=np.float32).reshape(3, 4),
        "i": np.array([-1, 2**40], dtype=np.int64),
        "flag": np.array(True),
        "empty": np.zeros((0, 5), dtype=np.float16),
    }
    codes = {"float32": "F32", "int64": "I64", "bool": "BOOL", "float16": "F16"}
    prefix, _ = encode_header(
        [(k, codes[v.dtype.name], v.shape) for k, v in arrays.items()], {"k": "v"}
    )
    data = prefix + b"".join(v.tobytes() for v in arrays.values())
    loaded = st_load(data)
    assert set(loaded) == set(arrays)
    for k, v in arrays.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape
        assert loaded[k].tobytes() == v.tobytes()


def test_parses_files_written_by_safetensors() -> None:
    arrays = {"z": np.ones((2, 2), np.float64), "a": np.arange(5, dtype=np.int32)}
    header, pieces = _parse(st_save(arrays, metadata={"m": "1"}), piece=7)
    assert header.metadata == {"m": "1"}
    got = {t.name: bytes(pieces.get(i, b"")) for i, t in enumerate(header.tensors)}
    assert got == {k: v.tobytes() for k, v in arrays.items()}


@given(
    st.lists(
        st.tuples(
            st.sampled_from(sorted(DTYPE_SIZES)),
            st.lists(st.integers(0, 4), max_size=3),
        ),
        max_size=6,
    ),
    st.integers(1, 50),
)
def test_roundtrip_any_piece_size(tensors: list[tuple[str, list[int]]], piece: int) -> None:
    specs = [(f"t{i}", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(tensors)]
    prefix, header = encode_header(specs, {"skeleton": "{}"})
    data = bytes(range(256)) * (header.data_len // 256 + 1)
    body = prefix + data[: header.data_len]
    parsed, pieces = _parse(body, piece)
    assert parsed.tensors == header.tensors
    assert parsed.metadata == {"skeleton": "{}"}
    assert b"".join(bytes(pieces.get(i, b"")) for i in range(len(specs))) == body[len(prefix) :]


def _raw_header(obj: object) -> bytes:
    text = json.dumps(obj).encode()
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"\x01\x02", InvalidStream),  # ends inside the length prefix
        (struct.pack("<Q", 1 << 40), PayloadTooLarge),
        # another format's first 8 bytes read as a length: no header's (a PNG's, a text's)
        (b"\x89PNG\r\n\x1a\n" + bytes(8), InvalidStream),
        (b"hello, world", InvalidStream),
        (struct.pack("<Q", 1), InvalidStream),
        (struct.pack("<Q", 10) + b"{}", InvalidStream),  # ends inside the header
        (struct.pack("<Q", 4) + b"nope", InvalidStream),
        (_raw_header([1, 2]), InvalidStream),
        (
            _raw_header({"x": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}),
            UnsupportedDtype,
        ),
        (
            _raw_header({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}),
            InvalidStream,
        ),
        (
            _raw_header({"x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}),
            InvalidStream,
        ),
        (
            _raw_header({"x": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}),
            InvalidStream,
        ),
        (_raw_header({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}), InvalidStream),
        (_raw_header({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}), InvalidStream),
        (_raw_header({"x": {"dtype": "F32", "shape": [1]}}), InvalidStream),
        (
            _raw_header(
                {
                    "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                }
            ),
            InvalidStream,
        ),
        (_raw_header({"__metadata__": {"a": 1}}), InvalidStream),
    ],
    ids=[
        "short-prefix",
        "huge-header",
        "png",
        "text",
        "tiny-header",
        "ends-in-header",
        "not-json",
        "not-object",
        "unknown-dtype",
        "negative-dim",
        "bool-dim",
        "float-dim",
        "size-mismatch",
        "gap",
        "missing-key",
        "overlap",
        "bad-metadata",
    ],
)
def test_rejects_malformed(body: bytes, error: type[Exception]) -> None:
    parser = StreamParser(max_header_bytes=1 << 20)
    with pytest.raises(error) as info:
        list(parser.feed(body))
        parser.close()
    assert str(info.value)


def test_truncated_and_overlong_bodies() -> None:
    prefix, _ = encode_header([("x", "F32", (4,))], {})
    parser = StreamParser()
    list(parser.feed(prefix + b"\0" * 10))
    with pytest.raises(InvalidStream, match="truncated"):
        parser.close()
    parser = StreamParser()
    with pytest.raises(InvalidStream, match="longer"):
        list(parser.feed(prefix + b"\0" * 17))


def test_total_size_limit() -> None:
    prefix, _ = encode_header([("x", "F32", (1 << 20,))], {})
    with pytest.raises(PayloadTooLarge):
        list(StreamParser(max_total_bytes=1 << 20).feed(prefix))


def _many_tensors(n: int) -> bytes:
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    text = json.dumps({f"model.layers.{i}.mlp.weight": empty for i in range(n)}).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _peak_of(parse: Callable[[], object]) -> int:
    """The most memory ``parse`` held at once (tracemalloc: Python's allocations)."""
    tracemalloc.start()
    try:
        parse()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_header_costs_a_small_multiple_of_its_size() -> None:
    # a header's JSON became ~900 bytes of Python objects per tensor (9-10x the header):
    # 78 MB announcing 10^6 tensors took 0.9 GB before its 413
    body = _many_tensors(50_000)

    def parse() -> None:
        (header,) = StreamParser(max_header_bytes=1 << 30).feed(body)
        assert isinstance(header, Header) and len(header.tensors) == 50_000

    assert _peak_of(parse) < 6 * len(body)  # 4.9x: bytes + text at once, then objects


def test_too_many_tensors_are_refused_before_they_cost_memory() -> None:
    body = _many_tensors(100_000)

    def parse() -> None:
        with pytest.raises(PayloadTooLarge, match="more than 1000 tensors"):
            list(StreamParser(max_header_bytes=1 << 30, max_tensors=1000).feed(body))

    assert _peak_of(parse) < 2.5 * len(body)  # the bytes and their text
