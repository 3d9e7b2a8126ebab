"""Streaming safetensors framing (stdlib only).

A checkpoint travels as one safetensors file, both as the POST body and the GET response::

    u64 little-endian N | N bytes of JSON header (space-padded to 8) | tensor bytes

The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the first byte after the header) plus ``"__metadata__"``: a str -> str
map holding ``"format": "ckptstore/1"`` and ``"skeleton"`` (the tagged JSON of the nested
state). Tensors are laid out back to back in header order, no gaps, no overlap.

As in safetensors, the header must start with ``{``. A body that starts like another format
(a zip archive, as ``torch.save`` writes, or a pickle) is refused as such, not as a header of
absurd length, so whoever posted a ``torch.save`` file learns what went wrong.

``encode_header`` computes a header from dtypes and shapes before any data exists, so a writer
can stream; ``StreamParser`` is a push parser (sans-IO): feed it bytes as they arrive and it
hands back validated pieces of tensor data, so the same code serves the sync client and the
service without ever holding a whole checkpoint.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass

from ckptstore_core.errors import InvalidStream, PayloadTooLarge, UnsupportedDtype

__all__ = [
    "DTYPE_SIZES",
    "FORMAT",
    "Header",
    "StreamParser",
    "TensorPiece",
    "TensorSpec",
    "encode_header",
    "tensor_nbytes",
]

FORMAT = "ckptstore/1"

#: safetensors dtype code -> element size in bytes. The only dtypes that travel.
DTYPE_SIZES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

_MAX_DIMS = 64
_MAX_INT = 2**63 - 1  # sizes and offsets are int64 in torch and in the catalog

#: What other files start with, for the error a body of that format gets. Looked up only once
#: a stream has failed (its length prefix over the limit, or its header not starting with
#: ``{``), so a signature never turns away a valid stream, and a genuine safetensors header
#: that is merely too long stays a PayloadTooLarge.
_FOREIGN_FORMATS: Sequence[tuple[bytes, str]] = (
    (b"PK\x03\x04", "a torch.save file (a zip archive)"),
    *(
        (
            bytes([0x80, protocol]),
            f"a pickle (protocol {protocol}), as legacy torch.save and pickle.dump write",
        )
        for protocol in range(2, 6)
    ),
    (b"\x1f\x8b", "a gzip-compressed file"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file"),
    (b"\x93NUMPY", "a NumPy .npy file"),
)
# A multipart/form-data body (``curl -F file=@x.safetensors``, an HTML form) starts with
# ``--`` and its boundary (RFC 2046: letters, digits and ``'()+_,-./:=?`` and space): 8 such
# bytes read as a length are over 2**61, so a stream that starts so has failed already.
_BOUNDARY_CHARS = frozenset(
    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? "
)
# what no header's length reaches, and most other formats' first 8 bytes do: 256 TiB
_IMPLAUSIBLE_HEADER = 1 << 48
_MULTIPART = (
    "a multipart form upload (as curl -F or an HTML form sends): send the file itself as the "
    "raw body instead (curl --data-binary @model.safetensors)"
)
_EXPECTED = (
    "ckptstore takes safetensors streams (a u64 little-endian header length, a JSON header, "
    "tensor bytes), such as CheckpointClient.save sends"
)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor's place in the stream: bytes ``[begin, end)`` after the header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


@dataclass(frozen=True, slots=True)
class Header:
    tensors: tuple[TensorSpec, ...]  # in data order
    metadata: Mapping[str, str]
    header_len: int  # the 8-byte length prefix plus the JSON

    @property
    def data_len(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @property
    def total_len(self) -> int:
        return self.header_len + self.data_len


@dataclass(frozen=True, slots=True)
class TensorPiece:
    """Bytes ``[offset, offset + len(data))`` of tensor ``index`` (relative to the tensor)."""

    index: int
    offset: int
    data: memoryview


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    size = DTYPE_SIZES.get(dtype)
    if size is None:
        raise UnsupportedDtype(f"unsupported dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}")
    return size * math.prod(shape)


def encode_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]], metadata: Mapping[str, str]
) -> tuple[bytes, Header]:
    """Frame ``(name, dtype, shape)`` tensors laid out in order; returns the prefix bytes."""
    obj: dict[str, object] = {"__metadata__": dict(metadata)}
    specs = []
    offset = 0
    for name, dtype, shape in tensors:
        if name == "__metadata__" or name in obj:
            raise ValueError(f"duplicate or reserved tensor name {name!r}")
        end = offset + tensor_nbytes(dtype, shape)
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        specs.append(TensorSpec(name, dtype, tuple(shape), offset, end))
        offset = end
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data section to 8 bytes
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, Header(tuple(specs), dict(metadata), len(prefix))


def _as_int(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise InvalidStream(f"{what} must be an integer from 0 to 2**63-1, got {value!r}")
    return value


def _foreign_format(start: bytes) -> InvalidStream | None:
    """The error for a body that starts like another format's file, if it does."""
    if start.startswith(b"--") and len(start) >= 8 and _BOUNDARY_CHARS.issuperset(start[:8]):
        what = _MULTIPART
    else:
        what = next((what for magic, what in _FOREIGN_FORMATS if start.startswith(magic)), "")
    if not what:
        return None
    return InvalidStream(f"the body is not a safetensors stream: it looks like {what}; {_EXPECTED}")


def _not_a_length(n: int) -> InvalidStream | None:
    """The error for a first 8 bytes that no safetensors stream starts with: a header
    length of 256 TiB or more (a PNG, a text file, any other format's first bytes read as
    one) is no header's, where one just over the limit is a header too large (413)."""
    if n < _IMPLAUSIBLE_HEADER:
        return None
    return InvalidStream(
        f"the body is not a safetensors stream: its first 8 bytes read as a header length of "
        f"{n} bytes; {_EXPECTED}"
    )


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """json object hook: a key given twice (two tensors of one name) makes the header ambiguous."""
    obj = dict(pairs)  # in C: the check costs a length comparison unless a key repeats
    if len(obj) != len(pairs):
        twice = next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise InvalidStream(f"header names {twice!r} twice")
    return obj


_INFO_KEYS = ("dtype", "shape", "data_offsets")
_DTYPES = {d: d for d in DTYPE_SIZES}  # one string object per dtype, shared by every tensor


class _Info:
    """A tensor's ``{"dtype", "shape", "data_offsets"}`` object as the JSON parser hands it
    back when its types are right (values are checked later, where the name is known): a
    fraction of the dict, lists and strings it would otherwise keep until the end."""

    __slots__ = ("begin", "dims", "dtype", "end")

    def __init__(self, dtype: str, dims: tuple[int, ...], begin: int, end: int) -> None:
        self.dtype, self.dims, self.begin, self.end = dtype, dims, begin, end


class _Objects:
    """The json object hook of one header: each tensor's object shrunk to an :class:`_Info`
    as soon as it is parsed, and PayloadTooLarge as soon as the header holds more objects
    than ``max_tensors`` tensors need (each, the metadata and the header itself: one), so
    an oversized header is refused before it costs more memory than the allowed one."""

    def __init__(self, max_tensors: int | None, limit_name: str) -> None:
        self._left = None if max_tensors is None else max_tensors + 2
        self._max_tensors = max_tensors
        self._limit_name = f" ({limit_name})" if limit_name else ""

    def __call__(self, pairs: list[tuple[str, object]]) -> object:
        if self._left is not None:
            self._left -= 1
            if self._left < 0:
                self.refuse()
        if len(pairs) == 3 and tuple(sorted(k for k, _ in pairs)) == _SORTED_INFO_KEYS:
            info = _shrunk(dict(pairs))
            if info is not None:
                return info
        return _unique_keys(pairs)

    def check_count(self, tensors: int) -> None:
        """The exact check, once the header is parsed (the count above allows 2 more)."""
        if self._max_tensors is not None and tensors > self._max_tensors:
            self.refuse()

    def refuse(self) -> None:
        raise PayloadTooLarge(
            f"the header declares more than {self._max_tensors} tensors, the most one "
            f"checkpoint (or part) may hold{self._limit_name}"
        )


_SORTED_INFO_KEYS = tuple(sorted(_INFO_KEYS))


def _shrunk(obj: dict[str, object]) -> _Info | None:
    """``obj`` as an :class:`_Info` if its values have the right types, else None (then the
    dict stays, and :func:`_parse_header_json` says what is wrong with it)."""
    dtype, shape, offsets = obj["dtype"], obj["shape"], obj["data_offsets"]
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list):
        return None
    if len(offsets) != 2 or not all(type(v) is int for v in (*shape, *offsets)):
        return None
    return _Info(_DTYPES.get(dtype, dtype), tuple(shape), offsets[0], offsets[1])


def _is_text(value: str) -> bool:
    """Whether ``value`` is Unicode text: JSON's \\u escapes can also spell lone surrogates,
    which no UTF-8 database column, JSON encoder or file name takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_extent(name: str, dims: tuple[int, ...]) -> None:
    """Refuse a shape whose nonzero dimensions multiply to 2^63 or more: an empty tensor of
    it would be stored, but torch cannot make one (``[2^32, 2^32, 0]``: its size arithmetic
    overflows), so the checkpoint could never be loaded."""
    count = 1
    for d in dims:
        count *= max(d, 1)
        if count > _MAX_INT:
            raise InvalidStream(
                f"tensor {name!r}: the nonzero dimensions of shape {list(dims)} multiply to "
                "2^63 or more: no tensor can have it"
            )


def _parse_header_json(
    raw: bytearray, header_len: int, max_tensors: int | None, limit_name: str = ""
) -> Header:
    """The header of ``raw`` (its JSON), holding at most ``max_tensors`` tensors. Memory: a
    small multiple of ``len(raw)`` (each tensor's object is shrunk as it is parsed, and too
    many are refused as soon as they are counted)."""
    try:
        # as json.loads decodes bytes; then the bytes go, before the objects come
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        raw.clear()
        objects = _Objects(max_tensors, limit_name)
        obj = json.loads(text, object_pairs_hook=objects)
        del text
    except (ValueError, RecursionError) as exc:  # bad JSON/UTF-8, 4300+ digit ints, nesting
        raise InvalidStream(f"header is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidStream("header must be a JSON object")
    meta = obj.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise InvalidStream("__metadata__ must map strings to strings")
    if not all(_is_text(k) and _is_text(v) for k, v in meta.items()):
        raise InvalidStream("__metadata__ holds a lone surrogate (\\ud800-\\udfff), not text")
    objects.check_count(len(obj))
    specs = []
    while obj:
        name, info = obj.popitem()  # from the end: each object is freed once it is a spec
        specs.append(_spec(name, info))
    specs.reverse()  # the header's order, which the sort keeps among empty tensors
    specs.sort(key=lambda s: (s.begin, s.end))
    position = 0
    for spec in specs:
        if spec.begin != position:
            kind = "overlap" if spec.begin < position else "gap"
            raise InvalidStream(f"tensor {spec.name!r}: data_offsets {kind} at byte {position}")
        position = spec.end
    return Header(tuple(specs), meta, header_len)


def _spec(name: str, info: object) -> TensorSpec:
    """The checked :class:`TensorSpec` of tensor ``name``'s object (InvalidStream naming it)."""
    if not name:
        raise InvalidStream("empty tensor name")
    if not _is_text(name):
        raise InvalidStream(f"tensor name {name!r} holds a lone surrogate")
    if isinstance(info, _Info):
        dtype, shape, offsets = info.dtype, info.dims, [info.begin, info.end]
    elif not isinstance(info, dict) or set(info) != set(_INFO_KEYS):
        raise InvalidStream(f"tensor {name!r}: expected keys dtype, shape, data_offsets")
    else:
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise InvalidStream(f"tensor {name!r}: dtype must be a string")
    if not isinstance(shape, (list, tuple)) or len(shape) > _MAX_DIMS:
        raise InvalidStream(f"tensor {name!r}: shape must be a list of at most 64 dims")
    dims = tuple(_as_int(d, f"tensor {name!r}: dimension") for d in shape)
    _check_extent(name, dims)
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise InvalidStream(f"tensor {name!r}: data_offsets must be [begin, end]")
    begin = _as_int(offsets[0], f"tensor {name!r}: data_offsets")
    end = _as_int(offsets[1], f"tensor {name!r}: data_offsets")
    expected = tensor_nbytes(dtype, dims)
    if end - begin != expected:
        raise InvalidStream(
            f"tensor {name!r}: data_offsets span {end - begin} bytes but dtype {dtype} "
            f"x shape {list(dims)} needs {expected}"
        )
    return TensorSpec(name, dtype, dims, begin, end)


class StreamParser:
    """Push parser for a safetensors stream.

    Call :meth:`feed` with each piece of bytes as it arrives; it yields the
    :class:`Header` once (as soon as it is complete and valid), then :class:`TensorPiece`
    objects in stream order. Call :meth:`close` at the end of the input: it raises
    :class:`InvalidStream` if the stream stopped early. Bytes past the promised end raise
    at once. Pieces are views into the fed buffer: copy them before feeding again.

    A header longer than ``max_header_bytes``, or declaring more than ``max_tensors``
    tensors, is PayloadTooLarge (its message names ``limit_name``, the setting, if given);
    reading one costs a small multiple of its length (about 5x: its bytes, their text, the
    tensors' objects), and one declaring too many tensors about 2x.
    """

    def __init__(
        self,
        max_header_bytes: int = 100 << 20,
        max_total_bytes: int | None = None,
        max_tensors: int | None = None,
        limit_name: str = "",
    ):
        self._limit_name = limit_name
        self._max_header = max_header_bytes
        self._max_total = max_total_bytes
        self._max_tensors = max_tensors
        self._buf = bytearray()  # only holds the length prefix and the header
        self._header_len: int | None = None
        self._prefix = b""  # the length prefix, for the error if the header is no JSON object
        self.header: Header | None = None
        self._pos = 0  # bytes of tensor data consumed
        self._tensor = 0  # index of the tensor being filled

    @property
    def received(self) -> int:
        """Bytes of the stream consumed so far (prefix + header + data)."""
        if self.header is None:
            return len(self._buf)
        return self.header.header_len + self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[Header | TensorPiece]:
        view = memoryview(data).cast("B")
        if self.header is None:
            view = yield from self._feed_header(view)
            if self.header is None:
                return
        header = self.header
        while len(view):
            if self._tensor >= len(header.tensors):
                raise InvalidStream(
                    f"body longer than the header promises ({header.total_len} bytes)"
                )
            spec = header.tensors[self._tensor]
            take = min(len(view), spec.end - self._pos)
            if take:
                yield TensorPiece(self._tensor, self._pos - spec.begin, view[:take])
                view = view[take:]
                self._pos += take
            if self._pos == spec.end:
                self._tensor += 1
                # skip empty tensors so that the "too long" check above sees the true end
                while (
                    self._tensor < len(header.tensors) and not header.tensors[self._tensor].nbytes
                ):
                    self._tensor += 1

    def _feed_header(self, view: memoryview) -> Generator[Header, None, memoryview]:
        if self._header_len is None:
            need = 8 - len(self._buf)
            self._buf += view[:need]
            view = view[need:]
            if len(self._buf) < 8:
                return view
            (n,) = struct.unpack("<Q", self._buf)
            if n > self._max_header:
                raise (
                    _foreign_format(bytes(self._buf))
                    or _not_a_length(n)
                    or PayloadTooLarge(
                        f"header length {n} exceeds the limit of {self._max_header} bytes"
                    )
                )
            if n < 2:
                raise InvalidStream(f"header length {n} is too small for a JSON object")
            self._header_len = n
            self._prefix = bytes(self._buf)
            self._buf.clear()
        need = self._header_len - len(self._buf)
        fresh = not self._buf
        self._buf += view[:need]
        view = view[need:]
        if fresh and self._buf and self._buf[0] != 0x7B:  # fail fast, not after N bytes
            raise _foreign_format(self._prefix + self._buf[:8]) or InvalidStream(
                f"the body is not a safetensors stream: its header must be a JSON object, "
                f"starting with '{{', not {bytes(self._buf[:1])!r}; {_EXPECTED}"
            )
        if len(self._buf) < self._header_len:
            return view
        raw, self._buf = self._buf, bytearray()  # the parse frees it once it is text
        header = _parse_header_json(raw, 8 + self._header_len, self._max_tensors, self._limit_name)
        if self._max_total is not None and header.total_len > self._max_total:
            raise PayloadTooLarge(
                f"checkpoint of {header.total_len} bytes exceeds the limit of "
                f"{self._max_total} bytes"
            )
        self._buf = bytearray()
        self._pos = 0
        self.header = header
        self._tensor = 0
        while self._tensor < len(header.tensors) and not header.tensors[self._tensor].nbytes:
            self._tensor += 1
        yield header
        return view

    def close(self) -> Header:
        """End of input: the header and every promised byte must have arrived."""
        if self.header is None:
            have = len(self._buf) + (8 if self._header_len is not None else 0)
            raise InvalidStream(f"stream ended inside the header after {have} bytes")
        if self._pos != self.header.data_len:
            raise InvalidStream(
                f"stream truncated: {self.received} of {self.header.total_len} bytes received"
            )
        return self.header
