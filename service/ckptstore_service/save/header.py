"""The first stage of a save: the body's header, read and checked before anything is
stored, and the tensor pieces that follow it.

Nothing here does I/O but pulling from the body iterator; the parser is the core's
(:class:`~ckptstore_core.wire.StreamParser`), which checks the framing. Here: what the
service checks beyond it (no NUL in names, a skeleton the client could load back, a
Content-Length that agrees with the header), and an idempotent retry's comparison with what
is stored.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import xxhash

from ckptstore_core.codec import Buffer
from ckptstore_core.errors import CheckpointExists, InvalidStream
from ckptstore_core.lossy import ParamNames
from ckptstore_core.pipeline import TensorInfo, lossy_params
from ckptstore_core.records import (
    LOSSY_KEY,
    PARAM_NAMES_KEY,
    USER_METADATA_KEY,
    decode_user_metadata,
)
from ckptstore_core.wire import FORMAT, Header, StreamParser, TensorPiece
from ckptstore_service.settings import Settings

__all__ = [
    "Incoming",
    "check_metadata",
    "header_of",
    "open_body",
    "read_header",
    "same_content",
    "stored_metadata",
    "wait_for_data",
]


@dataclass
class Incoming:
    """A body whose header is read: the header, and its tensor pieces (an iterator that
    parses the rest of the body as it is consumed, once)."""

    header: Header
    pieces: Iterator[TensorPiece]


def body_parser(settings: Settings) -> StreamParser:
    """The parser of an upload's header (and a plain upload's tensors), within the limits:
    each tensor costs catalog rows and bookkeeping whether or not it has bytes, and the
    parser refuses too many as it counts them, before they cost memory."""
    return StreamParser(
        settings.max_header_bytes,
        settings.max_upload_bytes,
        max_tensors=settings.max_tensors,
        limit_name="CKPTSTORE_MAX_TENSORS",
    )


def header_of(text: bytes, settings: Settings) -> Header:
    """A part's safetensors header sent as JSON ``text`` (no body after it), checked as an
    upload's header is (InvalidStream, PayloadTooLarge)."""
    parser = body_parser(settings)
    body = struct.pack("<Q", len(text)) + text
    found = [e for e in parser.feed(body) if isinstance(e, Header)]
    if not found:
        raise InvalidStream("the part's header is incomplete")
    header = found[0]
    check_metadata(header)
    return header


def open_body(body: Iterable[Buffer], content_length: int | None, settings: Settings) -> Incoming:
    """Parse ``body`` up to the end of its header and check it against ``settings``' limits
    (InvalidStream, PayloadTooLarge); the tensor pieces follow lazily."""
    parser = body_parser(settings)
    it = iter(body)
    header, first = read_header(parser, it)
    check_metadata(header)
    if content_length is not None and content_length != header.total_len:
        raise InvalidStream(
            f"Content-Length {content_length} disagrees with the header, which describes "
            f"{header.total_len} bytes"
        )
    return Incoming(header, _tensor_stream(parser, first, it))


def wait_for_data(incoming: Incoming) -> Incoming:
    """``incoming`` once its first tensor bytes arrived (or its body ended): a writer takes
    its run's lock only then, so a client that sent a valid header and then nothing holds
    no lock (its upload is cut by the idle timeout, :mod:`ckptstore_service.api.body`)."""
    first = next(incoming.pieces, None)
    if first is None:
        return incoming
    return Incoming(incoming.header, itertools.chain((first,), incoming.pieces))


def read_header(parser: StreamParser, body: Iterator[Buffer]) -> tuple[Header, list[TensorPiece]]:
    """Feed ``body`` until the header is parsed; returns it with any tensor pieces after it."""
    for data in body:
        events = list(parser.feed(data))
        if events:
            header = events[0]
            assert isinstance(header, Header)
            pieces = [e for e in events[1:] if isinstance(e, TensorPiece)]
            # copy: the pieces view ``data``, which the caller does not keep alive
            return header, [
                TensorPiece(p.index, p.offset, memoryview(bytes(p.data))) for p in pieces
            ]
    parser.close()  # raises: the stream ended inside the header
    raise AssertionError("unreachable")


def check_metadata(header: Header) -> None:
    """Refuse a header whose checkpoint no client could load back (InvalidStream).

    The service does not interpret the skeleton (its tags belong to the client's state
    module), but it checks what it can without torch: no NUL in a tensor name, a
    ``ckptstore/`` format it knows (a skeleton comes with ours only), a skeleton that is JSON
    ``{"v": 1, "root": ...}``, and every tensor the skeleton refers to (``{"t": "tensor",
    "n": NAME}``, or an ``ndarray`` sent as a tensor) present in the header. A plain
    safetensors file has neither key and is stored as it is.
    """
    for t in header.tensors:
        # here, not in the wire parser the client shares: checkpoints stored on SQLite by
        # clients that sent NUL still download
        if "\x00" in t.name:
            raise InvalidStream(f"tensor name {t.name!r} holds NUL, which PostgreSQL refuses")
    meta = header.metadata
    if USER_METADATA_KEY in meta:
        try:
            decode_user_metadata(meta[USER_METADATA_KEY])
        except ValueError as exc:
            raise InvalidStream(f"{USER_METADATA_KEY!r}: {exc}") from None
    lossy_params(meta)  # InvalidRequest for parameters that are not
    if PARAM_NAMES_KEY in meta:
        ParamNames.from_json(meta[PARAM_NAMES_KEY])  # InvalidRequest for anything else
    fmt = meta.get("format", "")
    # other writers' formats ({"format": "pt"} from transformers) are plain safetensors files
    if fmt != FORMAT and (fmt.startswith("ckptstore/") or "skeleton" in meta):
        raise InvalidStream(f"unknown format {fmt!r}; this service stores {FORMAT!r}")
    skeleton = meta.get("skeleton")
    if skeleton is None:
        return
    try:
        doc = json.loads(skeleton, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise InvalidStream(f"skeleton is not JSON: {exc}") from exc
    version = doc.get("v") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or set(doc) != {"v", "root"}
        or type(version) is not int
        or version != 1
    ):
        raise InvalidStream('skeleton must be {"v": 1, "root": ...}')
    names = {t.name for t in header.tensors}
    todo: list[object] = [doc["root"]]
    while todo:  # iterative: the JSON parser allowed the nesting, so must this
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            if node.get("t") in ("tensor", "ndarray") and "n" in node:
                name = node["n"]
                if not isinstance(name, str) or name not in names:
                    raise InvalidStream(f"skeleton refers to tensor {name!r}, which is not sent")
            todo.extend(node.values())


def stored_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """A save header's metadata as the checkpoint keeps it: without ``ckptstore.lossy``
    (what was done is the checkpoint's ``lossy``, not what was asked)."""
    return {k: v for k, v in metadata.items() if k != LOSSY_KEY}


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _tensor_stream(
    parser: StreamParser, first: list[TensorPiece], it: Iterator[Buffer]
) -> Iterator[TensorPiece]:
    yield from first
    for data in it:
        for event in parser.feed(data):
            assert isinstance(event, TensorPiece)
            yield event
    parser.close()


def same_content(
    stored_tensors: list[TensorInfo],
    stored_meta: Mapping[str, str] | None,
    incoming: Incoming,
    conflict: str,
    stored_lossy: Mapping[str, object] | None = None,
) -> None:
    """Return if ``incoming`` holds what is stored (a retry: the client gets a 200), else
    raise CheckpointExists(``conflict``). Metadata is compared unless ``stored_meta`` is
    None (a part's is not kept). Tensors are compared as they were sent (a lossy tensor's
    ``sent_checksum``); a checkpoint stored lossy (``stored_lossy``) matches only a save
    asking for the same parameters, one stored bit-exact any save. Consumes the body."""
    header = incoming.header
    # by name: the order of the tensors in the stream is free (clients have changed it)
    stored = {t.name: (t.dtype, t.shape, t.sent) for t in stored_tensors}
    hashers = [xxhash.xxh3_128() for _ in header.tensors]
    for piece in incoming.pieces:
        hashers[piece.index].update(piece.data)
    sent = {
        t.name: (t.dtype, t.shape, h.digest()) for t, h in zip(header.tensors, hashers, strict=True)
    }
    asked = lossy_params(header.metadata)
    if (
        sent != stored
        or stored_meta not in (None, stored_metadata(header.metadata))
        or (stored_lossy is not None and (asked is None or asked.to_json() != stored_lossy))
    ):
        raise CheckpointExists(conflict)
