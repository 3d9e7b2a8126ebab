"""Load path: resolve ``run/step`` -> decode chains -> verify -> stream safetensors out.

The data comes from the base cache when the checkpoint is cached (``latest`` of an active
run: no decoding at all) and otherwise from storage: each chunk follows its chain back to a
self-contained chunk, decodes forward and is verified against its xxh3-128; the chunks are
checked to tile their tensors, so verified chunks make verified tensors. Chunks are decoded
in the codec pool, in order, a bounded number ahead of the one being sent. Data from the base
cache (which has no chunk checksums) is verified tensor by tensor against the checksums
recorded at save time. The response header carries those checksums
(``__metadata__["ckptstore.xxh3_128"]``) so the client can check too.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ckptstore_core.errors import CorruptData
from ckptstore_core.wire import encode_header
from ckptstore_service.catalog import CheckpointRecord, ChunkInfo, TensorInfo
from ckptstore_service.chains import ChainDecoder, DecodeStats, Piece
from ckptstore_service.runtime import Runtime

__all__ = ["CHECKSUMS_KEY", "Restore", "materialize", "open_restore"]

CHECKSUMS_KEY = "ckptstore.xxh3_128"
_EMPTY = xxhash.xxh3_128_digest(b"")
_READ_BYTES = 4 << 20
_SEND_BYTES = 1 << 20
_MAX_AHEAD = 256  # chunks decoded ahead, whatever their size (each costs a future)
log = logging.getLogger("ckptstore")


@dataclass(frozen=True)
class Restore:
    info: CheckpointRecord
    total_len: int
    body: Iterator[Piece]


def open_restore(rt: Runtime, run: str, step: int | None, prefix: str | None) -> Restore:
    """Resolve a checkpoint and start its stream (raises the not-found errors, and any error
    before the first piece, up front)."""
    info = rt.catalog.get(run, step)
    tensors = rt.catalog.tensors(info.id)
    if prefix:
        tensors = [t for t in tensors if t.name.startswith(prefix)]
    metadata = dict(info.metadata)
    metadata[CHECKSUMS_KEY] = json.dumps({t.name: t.checksum.hex() for t in tensors})
    prefix_bytes, header = encode_header([(t.name, t.dtype, t.shape) for t in tensors], metadata)

    def body() -> Iterator[Piece]:
        t0 = time.perf_counter()
        stats = DecodeStats()
        data = _data(rt, info, tensors, stats)
        if stats.source == "storage" and not prefix:
            data = _fill_cache(rt, info, data)
        yield from _coalesced(prefix_bytes, data)
        log.info(
            "loaded %s/%d: %d bytes in %.2fs from %s (fetch %.2fs, decode %.2fs, in threads)",
            info.run,
            info.step,
            header.data_len,
            time.perf_counter() - t0,
            stats.source,
            stats.fetch_s,
            stats.decode_s,
        )

    # the first piece now: what fails before it (the catalog's chunks, the first decodes)
    # is still an HTTP error; what fails later can only cut the response short
    stream = body()
    first = next(stream)
    return Restore(info, header.total_len, itertools.chain([first], stream))


def materialize(rt: Runtime, info: CheckpointRecord, path: Path) -> None:
    """Write the checkpoint's raw data section (the base cache layout) to ``path``."""
    tensors = rt.catalog.tensors(info.id)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)  # a recycled file: overwritten
    try:
        with os.fdopen(fd, "wb", closefd=False) as out:
            for data in _data(rt, info, tensors):
                out.write(data)
    finally:
        os.close(fd)


def _fill_cache(rt: Runtime, info: CheckpointRecord, data: Iterator[Piece]) -> Iterator[Piece]:
    """Pass the decoded data through, keeping a copy as the run's base cache if it is the
    latest: a cache miss (a restart, another replica's save) then costs one decode, not one
    per GET of ``latest`` plus another one at the run's next save."""
    latest = rt.catalog.find(info.run, None)
    if latest is None or latest.id != info.id:
        yield from data
        return
    before = rt.cache.current(info.run)
    tmp = rt.cache.new_file(info.run)
    size = 0
    complete = False
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as out:
            for piece in data:
                size += out.write(piece)
                yield piece
        complete = True
    finally:
        if complete:
            rt.cache.install(info.run, info.id, tmp, size, if_current=before)
        else:
            rt.cache.discard(tmp)


def _coalesced(first: bytes, pieces: Iterator[Piece]) -> Iterator[Piece]:
    """Join small pieces into ~1 MiB writes: each piece costs a thread hop and a send."""
    batch: list[Piece] = [first]
    size = len(first)
    for piece in pieces:
        if size and size + len(piece) > _SEND_BYTES:
            yield batch[0] if len(batch) == 1 else b"".join(batch)
            batch, size = [], 0
        batch.append(piece)
        size += len(piece)
    if batch:
        yield batch[0] if len(batch) == 1 else b"".join(batch)


def _verified(tensors: list[TensorInfo], pieces: Iterator[tuple[int, Piece]]) -> Iterator[Piece]:
    """Pass the pieces through, checking each tensor's whole checksum when it ends."""
    by_idx = {t.idx: t for t in tensors}
    current: TensorInfo | None = None
    hasher = xxhash.xxh3_128()
    seen = 0

    def check(t: TensorInfo) -> None:
        if seen != t.nbytes or hasher.digest() != t.checksum:
            raise CorruptData(f"tensor {t.name!r} does not match its checksum")

    for idx, data in pieces:
        if current is None or idx != current.idx:
            if current is not None:
                check(current)
            current, hasher, seen = by_idx[idx], xxhash.xxh3_128(), 0
        hasher.update(data)
        seen += len(data)
        yield data
    if current is not None:
        check(current)
    _check_empty(tensors)  # empty tensors produce no pieces


def _check_empty(tensors: list[TensorInfo]) -> None:
    """Empty tensors (no chunks, no bytes) against their recorded checksums."""
    for t in tensors:
        if t.nbytes == 0 and t.checksum != _EMPTY:
            raise CorruptData(f"tensor {t.name!r} does not match its checksum")


def _data(
    rt: Runtime, info: CheckpointRecord, tensors: list[TensorInfo], stats: DecodeStats | None = None
) -> Iterator[Piece]:
    """The tensors' bytes, in order, verified."""
    stats = stats or DecodeStats()
    fd = rt.cache.open(info.run, info.id)
    if fd is not None:
        return _verified(tensors, _from_cache(fd, tensors))
    stats.source = "storage"
    return _from_storage(rt, info, tensors, stats)


def _from_cache(fd: int, tensors: list[TensorInfo]) -> Iterator[tuple[int, Piece]]:
    try:
        for t in tensors:
            for off in range(0, t.nbytes, _READ_BYTES):
                n = min(_READ_BYTES, t.nbytes - off)
                data = os.pread(fd, n, t.begin + off)
                if len(data) != n:
                    raise CorruptData("base cache file is truncated")
                yield t.idx, data
    finally:
        os.close(fd)


def _check_tiling(tensors: list[TensorInfo], chunks: list[ChunkInfo]) -> None:
    """Check that ``chunks`` (in tensor and offset order) cover each tensor exactly, back to
    back: each chunk's bytes are verified when decoded, so its tensor's are too."""
    ends = {t.idx: 0 for t in tensors}
    for c in chunks:
        if c.offset != ends[c.tensor_idx] or c.raw_len <= 0:
            raise CorruptData(f"the catalog's chunks of tensor {c.tensor_idx} do not tile it")
        ends[c.tensor_idx] += c.raw_len
    for t in tensors:
        if ends[t.idx] != t.nbytes:
            raise CorruptData(
                f"the catalog's chunks of tensor {t.name!r} do not tile it: they hold "
                f"{ends[t.idx]} of its {t.nbytes} bytes"
            )
    _check_empty(tensors)


def _from_storage(
    rt: Runtime, info: CheckpointRecord, tensors: list[TensorInfo], stats: DecodeStats
) -> Iterator[Piece]:
    wanted = {t.idx for t in tensors}
    own, closure = rt.catalog.chunk_tree(info.id)
    chunks = [c for c in own if c.tensor_idx in wanted]
    _check_tiling(tensors, chunks)
    decoder = ChainDecoder(rt.store, closure, 2 * rt.budget.bytes_in_flight, stats)
    decoder.keep_masters(chunks)

    # Decoded chunks queued ahead of the one being sent, bounded in bytes rather than in
    # chunks: a state has hundreds of small tensors, and a count that keeps the codec threads
    # busy on 4 MiB chunks lets them run dry on small ones while the sender works.
    budget = rt.budget.bytes_in_flight
    pending: deque[tuple[int, Future[Piece]]] = deque()
    queued = 0
    try:
        for c in chunks:
            pending.append((c.raw_len, rt.pool.submit(decoder.decode_and_keep, c)))
            queued += c.raw_len
            while queued > budget or len(pending) > _MAX_AHEAD:
                size, fut = pending.popleft()
                queued -= size
                yield fut.result()
        while pending:
            yield pending.popleft()[1].result()
    finally:
        for _, fut in pending:
            fut.cancel()
