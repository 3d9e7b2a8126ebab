"""Chain decoding, shared by the service (loads, saves on a base-cache miss, re-roots, the
verifier) and by clients that load directly (``direct=True``, docs/scale.md): torch-free.

A chunk is stored whole, as a ref to an equal chunk, as a delta of the same chunk of an
earlier checkpoint, or as a bf16/f16 copy predicted from an fp32 master of its own
checkpoint. :class:`ChainDecoder` follows a chunk's chain back to what it rests on and
decodes it forward, checking every step the catalog could have got wrong (cycles, sizes, a
base id with no row, a range outside its blob) and the result against the chunk's checksum.
:class:`WindowReader` coalesces the chains' ranged blob reads into a few large ones, from
any :class:`RangeReader`: the service's blob store, or a client's ranged HTTP GETs.
:func:`decoded_ahead` decodes chunks in a pool, a bounded number of bytes ahead of the
consumer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Protocol

import xxhash

from ckptstore_core import codec
from ckptstore_core.errors import CorruptData
from ckptstore_core.pipeline.rows import ChunkInfo, TensorInfo
from ckptstore_core.pipeline.sink import Buffer

__all__ = [
    "ChainDecoder",
    "DecodeStats",
    "Piece",
    "RangeReader",
    "WindowReader",
    "check_empty",
    "check_tiling",
    "decoded_ahead",
]

Piece = bytes | memoryview  # decoded data: chunks are sent as the arrays they were decoded in


class RangeReader(Protocol):
    """Ranged reads of blobs: ``[start, end)`` of blob ``key``. A range outside the blob
    raises ``ValueError`` (the blob store's contract, ``storage/base.py``)."""

    def view(self, key: str, start: int, end: int) -> Buffer: ...


@dataclass
class DecodeStats:
    """Where a load's data came from, and the seconds its codec threads spent."""

    source: str = "cache"
    fetch_s: float = 0.0  # summed over the codec threads
    decode_s: float = 0.0


class ChainDecoder:
    """Decodes chunks of a chunk tree (:meth:`Catalog.chunk_tree`): each one's chain back to
    a self-contained chunk, or to a chunk predicted from an fp32 master, read through one
    window reader. Thread-safe: the codec threads share one. ``keep_budget``: the bytes of
    decoded fp32 masters it may keep for their bf16/f16 copies."""

    def __init__(
        self,
        store: RangeReader,
        closure: dict[int, ChunkInfo],
        keep_budget: int,
        stats: DecodeStats | None = None,
    ) -> None:
        self.closure = closure
        self.stats = stats or DecodeStats()
        self.reader = WindowReader(store, closure.values())
        # fp32 chunks that bf16/f16 chunks are predicted from, once decoded for their own
        # tensor: kept (within a byte budget) until the copy needs them, instead of decoding
        # their chain a second time (see :meth:`keep_masters`)
        self.masters: set[int] = set()
        self._kept: dict[int, Piece] = {}
        self._kept_lock = threading.Lock()
        self._keep_budget = keep_budget

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


_EMPTY = xxhash.xxh3_128_digest(b"")
_MAX_AHEAD = 256  # chunks decoded ahead, whatever their size (each costs a future)


def check_empty(tensors: list[TensorInfo]) -> None:
    """Empty tensors (no chunks, no bytes) against their recorded checksums."""
    for t in tensors:
        if t.nbytes == 0 and t.checksum != _EMPTY:
            raise CorruptData(f"tensor {t.name!r} does not match its checksum")


def check_tiling(tensors: list[TensorInfo], chunks: list[ChunkInfo]) -> None:
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
    check_empty(tensors)


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

    def __init__(self, store: RangeReader, chunks: Iterable[ChunkInfo], budget: int = 128 << 20):
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


def decoded_ahead(
    pool: Executor, decoder: ChainDecoder, chunks: Sequence[ChunkInfo], budget: int
) -> Iterator[Piece]:
    """The chunks' raw bytes, in order, decoded in ``pool`` at most ``budget`` bytes (and
    256 chunks) ahead of the consumer; what is queued is cancelled when it stops."""
    # Decoded chunks queued ahead of the one being sent, bounded in bytes rather than in
    # chunks: a state has hundreds of small tensors, and a count that keeps the codec
    # threads busy on 4 MiB chunks lets them run dry on small ones while the sender works.
    pending: deque[tuple[int, Future[Piece]]] = deque()
    queued = 0
    try:
        for c in chunks:
            pending.append((c.raw_len, pool.submit(decoder.decode_and_keep, c)))
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
