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
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ckptstore import codec
from ckptstore.errors import CorruptData
from ckptstore.wire import encode_header
from ckptstore_service.catalog import CheckpointInfo, ChunkInfo, TensorInfo
from ckptstore_service.runtime import Runtime
from ckptstore_service.storage import BlobStore, Buffer

__all__ = [
    "CHECKSUMS_KEY",
    "ChainDecoder",
    "Piece",
    "Restore",
    "WindowReader",
    "materialize",
    "open_restore",
]

CHECKSUMS_KEY = "ckptstore.xxh3_128"
_EMPTY = xxhash.xxh3_128_digest(b"")
Piece = bytes | memoryview  # decoded data: chunks are sent as the arrays they were decoded in
_READ_BYTES = 4 << 20
_SEND_BYTES = 1 << 20
_MAX_AHEAD = 256  # chunks decoded ahead, whatever their size (each costs a future)
log = logging.getLogger("ckptstore")


@dataclass(frozen=True)
class Restore:
    info: CheckpointInfo
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
        stats = _Stats()
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


def materialize(rt: Runtime, info: CheckpointInfo, path: Path) -> None:
    """Write the checkpoint's raw data section (the base cache layout) to ``path``."""
    tensors = rt.catalog.tensors(info.id)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)  # a recycled file: overwritten
    try:
        with os.fdopen(fd, "wb", closefd=False) as out:
            for data in _data(rt, info, tensors):
                out.write(data)
    finally:
        os.close(fd)


def _fill_cache(rt: Runtime, info: CheckpointInfo, data: Iterator[Piece]) -> Iterator[Piece]:
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


@dataclass
class _Stats:
    source: str = "cache"
    fetch_s: float = 0.0  # summed over the codec threads
    decode_s: float = 0.0


def _data(
    rt: Runtime, info: CheckpointInfo, tensors: list[TensorInfo], stats: _Stats | None = None
) -> Iterator[Piece]:
    """The tensors' bytes, in order, verified."""
    stats = stats or _Stats()
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


class ChainDecoder:
    """Decodes chunks of a chunk tree (:meth:`Catalog.chunk_tree`): each one's chain back to
    a self-contained chunk, or to a chunk predicted from an fp32 master, read through one
    window reader. Thread-safe: the codec threads share one."""

    def __init__(self, rt: Runtime, closure: dict[int, ChunkInfo], stats: _Stats | None = None):
        self.closure = closure
        self.stats = stats or _Stats()
        self.reader = WindowReader(rt.store, closure.values())
        # fp32 chunks that bf16/f16 chunks are predicted from, once decoded for their own
        # tensor: kept (within a byte budget) until the copy needs them, instead of decoding
        # their chain a second time (see :meth:`keep_masters`)
        self.masters: set[int] = set()
        self._kept: dict[int, Piece] = {}
        self._kept_lock = threading.Lock()
        self._keep_budget = 2 * rt.in_flight * rt.settings.chunk_bytes

    def base_of(self, c: ChunkInfo) -> ChunkInfo:
        if c.base_id is None or c.base_id not in self.closure:
            raise CorruptData(f"the catalog's chunk {c.id} ({c.codec}) has no base chunk")
        return self.closure[c.base_id]

    def resolve(self, c: ChunkInfo) -> ChunkInfo:
        """The chunk that ``c`` is, following refs (each points at the chunk it equals)."""
        hops = 0
        while c.codec == codec.REF:
            c = self.base_of(c)
            hops += 1
            if hops > len(self.closure):
                raise CorruptData(f"the catalog's references from chunk {c.id} form a cycle")
        return c

    def fetch(self, c: ChunkInfo) -> Buffer:
        t0 = time.perf_counter()
        try:
            data = self.reader.get(c.blob_key, c.blob_offset, c.blob_offset + c.stored_len)
        except ValueError as exc:  # the store's word for a range outside the blob
            raise CorruptData(f"the catalog's chunk {c.id} is not in its blob: {exc}") from exc
        self.stats.fetch_s += time.perf_counter() - t0
        return data

    def chain(self, c: ChunkInfo) -> tuple[list[ChunkInfo], ChunkInfo]:
        """The deltas of ``c``'s chain, newest first, and the chunk they rest on: a
        self-contained one, or one predicted from an fp32 master. Every link is the same
        chunk of an earlier checkpoint (same bytes and items); a corrupt catalog whose base
        ids loop would otherwise be walked forever."""
        top = c
        c = self.resolve(c)
        deltas = []
        while codec.is_delta(c.codec):
            deltas.append(c)
            if len(deltas) > len(self.closure):
                raise CorruptData(f"the catalog's chain of chunk {top.id} forms a cycle")
            c = self.resolve(self.base_of(c))
        for link in (*deltas, c):
            if (link.raw_len, link.itemsize) != (top.raw_len, top.itemsize):
                raise CorruptData(
                    f"the catalog's chunk {link.id} ({link.raw_len} bytes of {link.itemsize}"
                    f"-byte items) cannot be in the chain of chunk {top.id} ({top.raw_len} "
                    f"bytes of {top.itemsize}-byte items)"
                )
        return deltas, c

    def master_of(self, c: ChunkInfo) -> ChunkInfo:
        """The fp32 chunk that the bf16/f16 chunk ``c`` is predicted from: as many items."""
        master = self.resolve(self.base_of(c))
        if c.itemsize != 2 or master.itemsize != 4 or master.raw_len != 2 * c.raw_len:
            raise CorruptData(
                f"the catalog's chunk {master.id} ({master.raw_len} bytes of "
                f"{master.itemsize}-byte items) cannot predict chunk {c.id} ({c.raw_len} "
                f"bytes of {c.itemsize}-byte items)"
            )
        return master

    def keep_masters(self, chunks: Iterable[ChunkInfo]) -> None:
        """Keep the fp32 masters of the copies among ``chunks`` once decoded (see
        :meth:`decode_and_keep`)."""
        for c in chunks:
            _, bottom = self.chain(c)
            if codec.split_cast(bottom.codec) is not None:
                self.masters.add(self.master_of(bottom).id)

    def decode(self, c: ChunkInfo) -> Piece:
        """The raw bytes of ``c``: its chain back to a self-contained chunk, or to a chunk
        predicted from an fp32 master (decoded first, then cast), decoded forward, checked
        against ``c``'s own checksum (a ref's is that of the bytes it refers to: a ref whose
        base id points at another chunk must not pass for it)."""
        want = c
        deltas, c = self.chain(c)
        cast = codec.split_cast(c.codec)
        if cast is None:
            links = [(c.codec, self.fetch(c))]
        else:
            master = self.master_of(c)
            with self._kept_lock:
                source = self._kept.pop(master.id, None)
            if source is None:
                source = self.decode(master)  # 4-byte items: not predicted, no recursion
            links = [(codec.RAW, codec.cast_prediction(source, cast[0]))]
            if cast[1] != codec.REF:
                links.append((cast[1], self.fetch(c)))
        links += [(d.codec, self.fetch(d)) for d in reversed(deltas)]
        t0 = time.perf_counter()
        out = codec.decode_chain(links, want.itemsize, want.raw_len, want.checksum)
        self.stats.decode_s += time.perf_counter() - t0
        return out

    def decode_and_keep(self, c: ChunkInfo) -> Piece:
        out = self.decode(c)
        resolved = self.resolve(c).id
        if resolved in self.masters:
            with self._kept_lock:
                if sum(map(len, self._kept.values())) + len(out) <= self._keep_budget:
                    self._kept[resolved] = out
        return out


def _from_storage(
    rt: Runtime, info: CheckpointInfo, tensors: list[TensorInfo], stats: _Stats
) -> Iterator[Piece]:
    wanted = {t.idx for t in tensors}
    own, closure = rt.catalog.chunk_tree(info.id)
    chunks = [c for c in own if c.tensor_idx in wanted]
    _check_tiling(tensors, chunks)
    decoder = ChainDecoder(rt, closure, stats)
    decoder.keep_masters(chunks)

    # Decoded chunks queued ahead of the one being sent, bounded in bytes rather than in
    # chunks: a state has hundreds of small tensors, and a count that keeps the codec threads
    # busy on 4 MiB chunks lets them run dry on small ones while the sender works.
    budget = rt.in_flight * rt.settings.chunk_bytes
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


@dataclass(frozen=True, eq=False)
class _Window:
    key: str
    start: int
    end: int
    data: Future[Buffer]


class WindowReader:
    """Ranged blob reads coalesced into windows: one GET serves many consecutive chunks.

    A restore decodes chunks in blob order and every chain walks its blobs in that same order,
    so reading a window ahead turns one small ranged GET per chunk and per chain link into a
    few large ones (S3 pays per request; moto, which copies the object per ranged GET, even
    more). Windows live in a small LRU bounded by ``budget`` bytes; fetches are single-flight.
    """

    def __init__(self, store: BlobStore, chunks: Iterable[ChunkInfo], budget: int = 128 << 20):
        self._store = store
        self._ends: dict[str, int] = {}
        for c in chunks:
            end = c.blob_offset + c.stored_len
            self._ends[c.blob_key] = max(self._ends.get(c.blob_key, 0), end)
        self._cap = 2 * max(1, len(self._ends))  # two windows per blob in the chains
        self._size = max(1 << 20, min(32 << 20, budget // self._cap))
        self._windows: deque[_Window] = deque()
        self._lock = threading.Lock()

    def get(self, key: str, start: int, end: int) -> Buffer:
        if start == end:
            return b""
        if end - start >= self._size:
            return self._store.view(key, start, end)
        window, mine = self._window_for(key, start, end)
        if mine:
            try:
                window.data.set_result(self._store.view(key, window.start, window.end))
            except BaseException as exc:
                window.data.set_exception(exc)
                with self._lock:
                    if window in self._windows:
                        self._windows.remove(window)
        return memoryview(window.data.result())[start - window.start : end - window.start]

    def _window_for(self, key: str, start: int, end: int) -> tuple[_Window, bool]:
        """The window holding ``[start, end)``, and whether the caller must fetch it."""
        with self._lock:
            for window in self._windows:
                if window.key == key and window.start <= start and end <= window.end:
                    return window, False
            w_end = min(max(end, start + self._size), self._ends.get(key, end))
            window = _Window(key, start, w_end, Future())
            self._windows.append(window)
            if len(self._windows) > self._cap:
                self._windows.popleft()
            return window, True
