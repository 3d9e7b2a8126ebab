"""Checkpoints as safetensors files, streamed: the ``ckptstore pull`` and ``push`` transfers.

The wire format is safetensors, so a checkpoint's ``GET`` body *is* a safetensors file and a
safetensors file *is* a save's body. :func:`pull_file` copies the response into the file as
it arrives and :func:`push_file` sends the file's tensor bytes as they are read: memory is one
piece buffer, whatever the checkpoint's size, and neither side builds tensors (no torch).

A pulled file is checked against the checksums the service sends (``ckptstore.xxh3_128`` in
its metadata; the file keeps them) and is written to ``FILE.tmp``, then renamed: a failure
leaves no half file behind. Both transfers go through a :class:`~ckptstore.Transport` (or a
:class:`~ckptstore.CheckpointClient`'s: each function takes either) and its retries; a retry
starts the transfer over (a pull pinned to the step the first answer served, so ``latest``
cannot move under it).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import xxhash

from ckptstore.transport import (
    CHECKSUMS_KEY,
    PIECE,
    Progress,
    Transport,
    UsesTransport,
    check_tensor,
    checkpoint_path,
    checksums_of,
    transport_of,
)
from ckptstore_core.errors import InvalidStream
from ckptstore_core.records import CheckpointInfo
from ckptstore_core.wire import Header, StreamParser, encode_header

__all__ = ["pull_file", "push_file", "temporary_path"]

_MAX_HEADER = 1 << 30  # as the client's loads: a file's header is the caller's own
T = TypeVar("T")


def temporary_path(path: Path) -> Path:
    """Where a download to ``path`` is written before it is renamed into place."""
    return path.with_name(path.name + ".tmp")


def pull_file(
    client: Transport | UsesTransport,
    run: str,
    step: int | str,
    path: Path,
    *,
    progress: bool = False,
) -> int:
    """Write checkpoint ``run/step`` (``step`` may be ``"latest"``) to ``path`` as the
    safetensors file the service streams, checked against its checksums; returns the step
    served. ``path`` appears whole or not at all."""
    transport = transport_of(client)
    checkpoint_path(run, step)  # a bad run name fails before a file is made
    tmp = temporary_path(path)
    pinned = step

    def attempt(out: io.BufferedWriter) -> int:
        nonlocal pinned
        with transport.stream("GET", checkpoint_path(run, pinned)) as response:
            served = int(response.getheader("X-Ckptstore-Step") or pinned)
            pinned = served  # a retry fetches this very checkpoint, even if latest moved
            total = int(response.getheader("Content-Length") or 0)
            bar = Progress(progress, total, f"pull {run}/{served}")
            try:
                with _local(tmp):
                    out.seek(0)
                    out.truncate()
                _copy_verified(response, total, out, tmp, bar.update)
            finally:
                bar.close()
        return served

    try:
        with open(tmp, "wb") as out:  # opened once: a local error is not the network's
            served = _unwrap_local(lambda: transport.retry(lambda: attempt(out)))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return served


def push_file(
    client: Transport | UsesTransport,
    path: Path,
    run: str,
    step: int,
    *,
    progress: bool = False,
) -> CheckpointInfo:
    """Save the safetensors file ``path`` as checkpoint ``run/step``, its bytes streamed as
    the body (a file ``ckptstore pull`` wrote loses only the response-only checksums from
    its header, so pushing it back is the same checkpoint). Returns the stored record."""
    transport = transport_of(client)
    checkpoint_path(run, step)  # a bad run name fails before the file is read
    with open(path, "rb") as f:
        header, prefix = _file_header(f, path)
    length = len(prefix) + header.data_len

    def body(f: io.BufferedReader) -> Iterator[bytes | memoryview]:
        yield prefix
        with _local(path):
            f.seek(header.header_len)
        yield from _pieces(f, header.data_len, path)

    def attempt(f: io.BufferedReader) -> CheckpointInfo:
        bar = Progress(progress, length, f"push {run}/{step}")
        try:
            payload = transport.post(checkpoint_path(run, step), body(f), length, bar.update)
        finally:
            bar.close()
        return CheckpointInfo.from_json(payload)

    with open(path, "rb") as f:  # held open: a file that goes away mid-push still reads
        return _unwrap_local(lambda: transport.retry(lambda: attempt(f)))


class _LocalError(Exception):
    """An OSError of the local file, carried past the client's retries (which take any
    OSError for the network's) and the request's send loop; :func:`_unwrap_local` raises
    the OSError itself, naming the file."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


@contextlib.contextmanager
def _local(path: Path) -> Iterator[None]:
    """Local file I/O: an OSError in the block becomes a :class:`_LocalError` about ``path``."""
    try:
        yield
    except OSError as exc:
        raise _LocalError(OSError(exc.errno, exc.strerror, str(path))) from exc


def _unwrap_local(call: Callable[[], T]) -> T:
    try:
        return call()
    except _LocalError as exc:
        raise exc.error from exc.__cause__


def _copy_verified(
    response: http.client.HTTPResponse,
    length: int,
    out: io.BufferedWriter,
    path: Path,
    progress: Callable[[int], None],
) -> None:
    """Copy the response body (``length`` bytes, its Content-Length) to ``out`` as it
    arrives, parsing it as a safetensors stream and checking each tensor against the
    checksum in its metadata: CorruptData if one does not match, InvalidStream if the
    stream is malformed, IncompleteRead (which the client retries) if the connection closes
    before ``length`` bytes. Each tensor is checked as its last byte arrives: a service that
    finds stored data corrupt mid-stream completes that tensor wrong, then cuts the
    response."""
    parser = StreamParser(max_header_bytes=_MAX_HEADER)
    hashers: list[xxhash.xxh3_128] = []
    names: list[str] = []
    left: list[int] = []  # bytes still to come, per tensor
    expected: dict[str, str] = {}
    buf = memoryview(bytearray(PIECE))
    got = 0
    while True:
        n = response.readinto(buf)
        if not n:  # http.client returns 0, not an error, when the peer closes early
            if got < length:
                raise http.client.IncompleteRead(b"", length - got)
            break
        got += n
        for event in parser.feed(buf[:n]):
            if isinstance(event, Header):
                hashers = [xxhash.xxh3_128() for _ in event.tensors]
                names = [t.name for t in event.tensors]
                left = [t.nbytes for t in event.tensors]
                expected = checksums_of(event)
            else:
                hashers[event.index].update(event.data)
                left[event.index] -= len(event.data)
                if not left[event.index]:
                    digest = hashers[event.index].hexdigest()
                    check_tensor(names[event.index], digest, expected)
        with _local(path):
            out.write(buf[:n])
        progress(n)
    header = parser.close()
    expected = checksums_of(header)
    for spec, hasher in zip(header.tensors, hashers, strict=True):
        check_tensor(spec.name, hasher.hexdigest(), expected)


def _file_header(f: io.BufferedReader, path: Path) -> tuple[Header, bytes]:
    """The parsed header of the safetensors file ``f`` and the bytes to send before its
    tensor data: the file's own, or its header re-encoded without the checksums a pull
    wrote. InvalidStream, naming ``path``, if it is no whole safetensors file."""
    parser = StreamParser(max_header_bytes=_MAX_HEADER)
    raw = f.read(8)
    try:
        list(parser.feed(raw))
        if len(raw) == 8:
            raw += f.read(int.from_bytes(raw, "little"))
            list(parser.feed(raw[8:]))
        header = parser.header
        if header is None:
            parser.close()  # raises: the file ends inside its header
            raise AssertionError("unreachable")
    except InvalidStream as exc:
        raise InvalidStream(f"{path} is not a safetensors file: {exc.message}") from None
    size = os.fstat(f.fileno()).st_size
    if size != header.total_len:
        raise InvalidStream(
            f"{path} is not a whole safetensors file: it holds {size} bytes where its header "
            f"promises {header.total_len}"
        )
    if CHECKSUMS_KEY not in header.metadata:
        return header, raw
    metadata = {k: v for k, v in header.metadata.items() if k != CHECKSUMS_KEY}
    prefix, _ = encode_header([(t.name, t.dtype, t.shape) for t in header.tensors], metadata)
    return header, prefix


def _pieces(f: io.BufferedReader, length: int, path: Path) -> Iterator[memoryview]:
    """``length`` bytes of ``f`` from where it stands, in pieces of one reused buffer (each
    is sent before the next is read)."""
    buf = memoryview(bytearray(PIECE))
    left = length
    while left:
        with _local(path):
            n = f.readinto(buf[: min(left, PIECE)])
        if not n:
            raise InvalidStream(f"{path} became shorter while it was being sent")
        yield buf[:n]
        left -= n
