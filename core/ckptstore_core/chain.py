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
from collections import OrderedDict, deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
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
    "DecodedChunks",
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
    links: int = 0  # stored links decoded (a chunk kept decoded costs none)
    kept: int = 0  # chunks served from, or started from, the decoded chunks kept


class DecodedChunks:
    """Chunks decoded from storage, kept in memory for the loads that follow: least recently
    used first out, within ``budget`` bytes (0 keeps nothing).

    A load deep in a chain decodes every link of every chunk's chain; the loads of the
    steps around it (an evaluation sweep, a loop over a run's steps, a job resumed from the
    step it just evaluated) would decode the same links again. With each chunk a load
    decodes kept (verified against its checksum), a chain is decoded from its newest kept
    link, and a second load of a step decodes nothing. The links below a chunk are not
    kept: each would be a copy into fresh memory, which cost a deep cold load twice its
    time (docs/architecture.md#decoded-chunks).

    Entries are keyed by chunk id and hold the checksum they were verified against: a chunk
    row keeps its id and raw bytes through re-roots and re-bases, and one whose bytes
    changed (a lossy re-encoding) or whose id was reused no longer matches its entry.
    ``on_decoded(links)`` counts the stored links decoded (the metrics' counter).
    """

    def __init__(self, budget: int, on_decoded: Callable[[int], None] | None = None) -> None:
        self.budget = budget
        self._entries: OrderedDict[int, tuple[bytes, memoryview]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._flights: dict[int, threading.Event] = {}  # chunk ids being decoded
        self._on_decoded = on_decoded

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, c: ChunkInfo) -> memoryview | None:
        """``c``'s bytes if they are kept (read-only), else None."""
        with self._lock:
            return self._get(c)

    def begin(self, c: ChunkInfo) -> memoryview | None:
        """``c``'s bytes if they are kept; else None, and the caller decodes ``c``, keeps it
        and calls :meth:`end`: meanwhile other threads' ``begin(c)`` wait for it rather
        than decode it too (the codec threads of one load share fp32 masters and refs)."""
        while True:
            with self._lock:
                kept = self._get(c)
                if kept is not None:
                    return kept
                flight = self._flights.get(c.id)
                if flight is None:
                    self._flights[c.id] = threading.Event()
                    return None
            flight.wait()  # then kept, or not (it failed, or it did not fit): look again

    def end(self, c: ChunkInfo) -> None:
        with self._lock:
            flight = self._flights.pop(c.id, None)
        if flight is not None:
            flight.set()

    def put(self, c: ChunkInfo, data: Piece) -> None:
        """Keep ``data``, the verified bytes of ``c`` (never written to again), evicting the
        least recently used entries to stay within the budget."""
        size = len(data)
        if not 0 < size <= self.budget:
            return
        view = memoryview(data).toreadonly()
        with self._lock:
            if c.id in self._entries:
                self._drop(c.id)
            self._entries[c.id] = (c.checksum, view)
            self._bytes += size
            while self._bytes > self.budget:
                self._drop(next(iter(self._entries)))

    def decoded(self, links: int) -> None:
        if self._on_decoded is not None and links:
            self._on_decoded(links)

    def holds(self, chunks: list[ChunkInfo]) -> bool:
        """Whether every one of ``chunks`` is kept, with its checksum and length; looks only
        (no entry moves or goes)."""
        with self._lock:
            return all(_matches(self._entries.get(c.id), c) for c in chunks)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def _get(self, c: ChunkInfo) -> memoryview | None:
        entry = self._entries.get(c.id)
        if entry is None:
            return None
        if not _matches(entry, c):
            self._drop(c.id)
            return None
        self._entries.move_to_end(c.id)
        return entry[1]

    def _drop(self, chunk_id: int) -> None:
        _, view = self._entries.pop(chunk_id)
        self._bytes -= len(view)


def _matches(entry: tuple[bytes, memoryview] | None, c: ChunkInfo) -> bool:
    """Whether a kept entry holds ``c``'s bytes: its checksum and length (an id reused or
    re-encoded does not)."""
    return entry is not None and entry[0] == c.checksum and len(entry[1]) == c.raw_len


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
        decoded: DecodedChunks | None = None,
        keep: bool = True,
    ) -> None:
        self.closure = closure
        self.stats = stats or DecodeStats()
        # chunks kept decoded across loads: chains start from their newest kept link, and
        # (``keep``) every link decoded is kept (see DecodedChunks)
        self._decoded = decoded
        self.decoded = decoded if decoded is not None and decoded.budget else None
        self._keep = keep
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
        predicted from an fp32 master (decoded first, then cast), or to its newest link kept
        decoded, decoded forward, checked against ``c``'s own checksum (a ref's is that of
        the bytes it refers to: a ref whose base id points at another chunk must not pass
        for it). With ``keep``, the result is kept decoded; the links below it are not
        (see :class:`DecodedChunks`)."""
        want = c
        deltas, bottom = self.chain(c)
        if self.decoded is None:
            return self._apply(None, deltas, want, bottom)
        top = deltas[0] if deltas else bottom
        if top.checksum != want.checksum:
            raise CorruptData(
                f"chunk checksum mismatch: the catalog's chunk {want.id} refers "
                f"to chunk {top.id}, whose bytes differ"
            )
        kept = self.decoded.begin(top) if self._keep else self.decoded.get(top)
        if kept is not None:
            self.stats.kept += 1
            return kept
        try:
            for i, link in enumerate([*deltas, bottom][1:], 1):
                kept = self.decoded.get(link)
                if kept is not None:
                    self.stats.kept += 1
                    out = self._apply(kept, deltas[:i], want, bottom)
                    break
            else:
                out = self._apply(None, deltas, want, bottom)
            if self._keep:
                self.decoded.put(top, out)
            return out
        finally:
            if self._keep:
                self.decoded.end(top)

    def _apply(
        self, state: Piece | None, deltas: list[ChunkInfo], want: ChunkInfo, bottom: ChunkInfo
    ) -> Piece:
        """``deltas`` (newest first) applied, oldest first, in one pass on one buffer, to
        ``state`` (the bytes of the link below them) or, if None, to what ``bottom`` decodes
        to; the result checked against ``want``'s checksum."""
        first = self._bottom(bottom) if state is None else [(codec.RAW, state)]
        links = first + [(d.codec, self.fetch(d)) for d in reversed(deltas)]
        stored = len(deltas) + (_stored(bottom) if state is None else 0)
        return self._decode_links(links, want, stored)

    def _bottom(self, c: ChunkInfo) -> list[tuple[str, Buffer]]:
        """The first links of a chain resting on ``c``: ``c`` itself if it is self-contained;
        for a copy predicted from an fp32 master, the master's cast (decoded first), then
        ``c``'s own residual if it has one."""
        cast = codec.split_cast(c.codec)
        if cast is None:
            return [(c.codec, self.fetch(c))]
        master = self.master_of(c)
        with self._kept_lock:
            source = self._kept.pop(master.id, None)
        if source is None:
            source = self.decode(master)  # 4-byte items: not predicted, no recursion
        links: list[tuple[str, Buffer]] = [(codec.RAW, codec.cast_prediction(source, cast[0]))]
        if cast[1] != codec.REF:
            links.append((cast[1], self.fetch(c)))
        return links

    def _decode_links(
        self, links: list[tuple[str, Buffer]], want: ChunkInfo, stored: int
    ) -> memoryview:
        """``links`` decoded and checked against ``want``'s checksum; ``stored``: how many
        of them were read from storage (counted)."""
        t0 = time.perf_counter()
        out = codec.decode_chain(links, want.itemsize, want.raw_len, want.checksum)
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.links += stored
        if self._decoded is not None:
            self._decoded.decoded(stored)
        return out

    def kept(self, c: ChunkInfo) -> Piece | None:
        """``c``'s bytes if they are kept decoded (served without decoding), else None."""
        if self.decoded is None:
            return None
        top = self.resolve(c)
        kept = self.decoded.get(top) if top.checksum == c.checksum else None
        if kept is not None:
            self.stats.kept += 1
        return kept

    def decode_and_keep(self, c: ChunkInfo) -> Piece:
        out = self.decode(c)
        resolved = self.resolve(c).id
        if resolved in self.masters:
            with self._kept_lock:
                if sum(map(len, self._kept.values())) + len(out) <= self._keep_budget:
                    self._kept[resolved] = out
        return out


def _stored(bottom: ChunkInfo) -> int:
    """The stored links a chain's bottom decodes itself (a predicted copy with no residual
    reads none; its master's chain counts apart)."""
    cast = codec.split_cast(bottom.codec)
    return 1 if cast is None or cast[1] != codec.REF else 0


_EMPTY = xxhash.xxh3_128_digest(b"")
_MAX_AHEAD = 256  # jobs decoded ahead, whatever their size (each costs a future)
_SMALL = 64 << 10  # chunks decoded together in one job of the pool...
_BATCH_BYTES = 1 << 20  # ...up to this many bytes


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
) -> Generator[Piece, None, None]:
    """The chunks' raw bytes, in order, decoded in ``pool`` at most ``budget`` bytes (and
    256 jobs) ahead of the consumer; what is queued is cancelled when it stops."""
    # Decoded chunks queued ahead of the one being sent, bounded in bytes rather than in
    # chunks: a state has hundreds of small tensors, and a count that keeps the codec
    # threads busy on 4 MiB chunks lets them run dry on small ones while the sender works.
    pending: deque[tuple[int, Future[list[Piece]]]] = deque()
    queued = 0
    try:
        for size, job in _jobs(decoder, chunks, pool):
            pending.append((size, job))
            queued += size
            while queued > budget or len(pending) > _MAX_AHEAD:
                size, fut = pending.popleft()
                queued -= size
                yield from fut.result()
        while pending:
            yield from pending.popleft()[1].result()
    finally:
        for _, fut in pending:
            fut.cancel()


def _jobs(
    decoder: ChainDecoder, chunks: Sequence[ChunkInfo], pool: Executor
) -> Iterator[tuple[int, Future[list[Piece]]]]:
    """The chunks' decodes, in order, as (bytes, future of their pieces): a chunk kept
    decoded is served at once, without a hop through the pool; runs of small chunks (a
    state's biases and norms, most of its chunks by count) go to the pool together, up to
    1 MiB a job: one hand-off each instead of one per chunk."""
    batch: list[ChunkInfo] = []
    size = 0
    for c in chunks:
        kept = decoder.kept(c)
        if kept is None and c.raw_len < _SMALL:
            batch.append(c)
            size += c.raw_len
            if size >= _BATCH_BYTES:
                yield size, pool.submit(_decode_all, decoder, batch)
                batch, size = [], 0
            continue
        if batch:
            yield size, pool.submit(_decode_all, decoder, batch)
            batch, size = [], 0
        if kept is None:
            yield c.raw_len, pool.submit(_decode_all, decoder, [c])
        else:
            done: Future[list[Piece]] = Future()
            done.set_result([kept])
            yield c.raw_len, done
    if batch:
        yield size, pool.submit(_decode_all, decoder, batch)


def _decode_all(decoder: ChainDecoder, chunks: list[ChunkInfo]) -> list[Piece]:
    return [decoder.decode_and_keep(c) for c in chunks]
