"""The parser on bodies that are no safetensors stream at all (issue 18, step 7).

A ``torch.save`` file read as safetensors has a "header length" of 5.8e17 bytes; it used to be
refused as a header over the limit (413) instead of as what it is. Exact bytes throughout: the
first bytes of each format are pinned here, not produced by the tool that writes them.
"""

from __future__ import annotations

import gzip
import json
import pickle
import struct
from collections.abc import Iterator

import pytest

from ckptstore_core.errors import InvalidStream, PayloadTooLarge
from ckptstore_core.wire import StreamParser, encode_header

LIMIT = 100 << 20  # the service's default max_header_bytes

# the first 16 bytes of torch.save({"a": torch.zeros(3)}, f) (zip) and of the same with
# _use_new_zipfile_serialization=False (a protocol 2 pickle of torch's magic number)
TORCH_ZIP = b"PK\x03\x04\x00\x00\x08\x08\x00\x00\x00\x00\x00\x00\x00\x00"
TORCH_LEGACY = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.\x80"


# the start of what ``curl -F file=@model.safetensors URL`` sends (curl 8: 24 dashes and 16
# hex digits as the boundary, after the body's "--")
MULTIPART = (
    b"--------------------------d74496d66958873e\r\n"
    b'Content-Disposition: form-data; name="file"; filename="model.safetensors"\r\n'
    b"Content-Type: application/octet-stream\r\n\r\n" + struct.pack("<Q", 2) + b"{}"
)


def _error(body: bytes, *, limit: int = LIMIT, piece: int = 1 << 20) -> Exception:
    parser = StreamParser(max_header_bytes=limit)
    with pytest.raises((InvalidStream, PayloadTooLarge)) as info:
        for i in range(0, len(body), piece):
            list(parser.feed(body[i : i + piece]))
        parser.close()
    return info.value


def _bodies() -> Iterator[tuple[str, bytes, str]]:
    yield "torch-zip", TORCH_ZIP + b"\x00" * 64, "a torch.save file (a zip archive)"
    yield "torch-legacy", TORCH_LEGACY + b"\x00" * 64, "a pickle (protocol 2)"
    for protocol in range(2, 6):
        yield (
            f"pickle-{protocol}",
            pickle.dumps({"w": list(range(100))}, protocol=protocol),
            f"a pickle (protocol {protocol})",
        )
    yield "gzip", gzip.compress(b"{}" * 100, mtime=0), "a gzip-compressed file"
    yield "zstd", b"\x28\xb5\x2f\xfd" + b"\x00" * 64, "a zstd-compressed file"
    yield "npy", b"\x93NUMPY\x01\x00v\x00{'descr': '<f4'" + b" " * 64, "a NumPy .npy file"
    yield "multipart", MULTIPART, "a multipart form upload (as curl -F or an HTML form sends)"


BODIES = {name: (body, what) for name, body, what in _bodies()}


@pytest.mark.parametrize("name", BODIES)
@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
def test_other_formats_are_named(name: str, piece: int) -> None:
    body, what = BODIES[name]
    error = _error(body, piece=piece)
    assert type(error) is InvalidStream
    message = str(error)
    assert message.startswith(f"the body is not a safetensors stream: it looks like {what}")
    assert "ckptstore takes safetensors streams" in message
    assert "CheckpointClient.save" in message


def test_torch_zip_message_exactly() -> None:
    assert str(_error(TORCH_ZIP)) == (
        "the body is not a safetensors stream: it looks like a torch.save file (a zip "
        "archive); ckptstore takes safetensors streams (a u64 little-endian header length, "
        "a JSON header, tensor bytes), such as CheckpointClient.save sends"
    )


@pytest.mark.parametrize("name", BODIES)
def test_named_under_any_header_limit(name: str) -> None:
    """With a limit that the format's "header length" passes, the first header byte (no
    ``{``) still gives it away, at once rather than after that many bytes."""
    body, what = BODIES[name]
    error = _error(body, limit=(1 << 64) - 1)
    assert type(error) is InvalidStream
    assert f"it looks like {what}" in str(error)


@pytest.mark.parametrize(
    "body",
    [
        struct.pack("<Q", 1 << 40),  # the length alone
        struct.pack("<Q", 1 << 40) + b'{"w":',
        struct.pack("<Q", LIMIT + 1) + b"{}",
        struct.pack("<Q", (1 << 48) - 1) + b"{}",  # the longest header judged a length
        struct.pack("<Q", (1 << 40) + ord("P")) + b"{}",  # starts with "P", not "PK\x03\x04"
        struct.pack("<Q", (1 << 40) + 0x80) + b"{}",  # "\x80" then no pickle protocol
    ],
    ids=[
        "length-only",
        "json-follows",
        "limit-plus-1",
        "2-48-minus-1",
        "starts-with-P",
        "starts-0x80",
    ],
)
def test_a_genuine_header_over_the_limit_is_still_413(body: bytes) -> None:
    error = _error(body)
    assert type(error) is PayloadTooLarge
    assert str(error).startswith("header length ")


@pytest.mark.parametrize(
    "body",
    [
        b"\xff" * 8 + b"{}",
        struct.pack("<Q", 1 << 48) + b"{}",
        b"\x89PNG\r\n\x1a\n" + bytes(8),  # no signature of ours: its bytes read as a length
        b"step,loss\n25,3.1\n",  # a text file
    ],
    ids=["all-ff", "2-48", "png", "text"],
)
def test_a_length_no_header_has_is_no_safetensors_stream(body: bytes) -> None:
    """8 bytes that read as a header of 256 TiB or more are not a length: a 400 that says
    so, not a 413 for a header over the limit."""
    error = _error(body)
    assert type(error) is InvalidStream
    n = int.from_bytes(body[:8], "little")
    assert str(error).startswith(
        f"the body is not a safetensors stream: its first 8 bytes read as a header length of {n}"
    )


def test_header_must_start_with_a_brace() -> None:
    text = b' {"__metadata__":{}}'
    error = _error(struct.pack("<Q", len(text)) + text)
    assert type(error) is InvalidStream
    assert str(error).startswith(
        "the body is not a safetensors stream: its header must be a JSON object, "
        "starting with '{', not b' '"
    )


@pytest.mark.parametrize("magic", [b"\x80\x02", b"\x80\x05", b"\x1f\x8b", b"PK"])
def test_a_valid_stream_whose_length_starts_like_a_signature_parses(magic: bytes) -> None:
    """Signatures are looked up only once a stream has failed: a header exactly as long as a
    signature's bytes read as a little-endian number still parses."""
    n = int.from_bytes(magic, "little")
    _, header = encode_header([("w", "U8", [3])], {"format": "ckptstore/1"})
    text = json.dumps(
        {
            "__metadata__": {"format": "ckptstore/1"},
            "w": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        }
    ).encode()
    text += b" " * (n - len(text))
    body = struct.pack("<Q", n) + text + b"abc"
    assert body.startswith(magic)
    parser = StreamParser(max_header_bytes=LIMIT)
    events = list(parser.feed(body))
    assert parser.close().tensors == header.tensors
    assert len(events) == 2


@pytest.mark.parametrize(
    "start",
    [b"--AaB03x\r\n", b"--boundary.with:odd=chars(1)?\r\n", b"-----WebKitFormBoundary7M\r\n"],
)
def test_a_multipart_form_says_to_send_the_raw_file(start: bytes) -> None:
    """curl -F, an HTML form, a browser's boundary: a 400 that says what to send instead,
    not a header length of 3e18 over the limit (413)."""
    error = _error(start + b"Content-Disposition: form-data; name=file\r\n\r\n" + b"\0" * 64)
    assert type(error) is InvalidStream
    assert "multipart form upload" in str(error)
    assert "--data-binary @model.safetensors" in str(error)


def test_dashes_in_a_length_prefix_alone_are_no_multipart_form() -> None:
    """A length whose low bytes happen to be ``--`` (0x2d2d) but whose other bytes are no
    boundary characters is judged as a length, as before: one no header has."""
    error = _error(b"--\x00\x00\x00\x00\x00\x01" + b"\0" * 64)
    assert type(error) is InvalidStream
    assert "multipart" not in str(error) and "header length of" in str(error)
