"""The service's side of chain decoding (:mod:`ckptstore_core.chain`, which clients that
load directly run too): a checkpoint's tensors decoded from the blob store
(:class:`ChainSource`), and a save's bases decoded from it (:class:`StoredBases`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path

import numpy as np

from ckptstore_core.chain import (
    ChainDecoder,
    DecodedChunks,
    DecodeStats,
    Piece,
    WindowReader,
    check_empty,
    check_tiling,
    decoded_ahead,
)
from ckptstore_core.errors import CheckpointNotFound, CorruptData
from ckptstore_core.pipeline import BaseChunk, Budget
from ckptstore_service.cache import write_file
from ckptstore_service.catalog import Catalog, CheckpointRecord, ChunkInfo, TensorInfo
from ckptstore_service.storage import BlobStore

__all__ = [
    "ChainDecoder",
    "ChainSource",
    "DecodeStats",
    "DecodedChunks",
    "LoadChains",
    "LoadedChunks",
    "Piece",
    "StoredBases",
    "WindowReader",
    "check_empty",
    "check_tiling",
]


class ChainSource:
    """A checkpoint's tensor bytes decoded from storage, chunk by chunk along their chains,
    in the codec pool, a bounded number of bytes ahead of the consumer."""

    def __init__(
        self,
        catalog: Catalog,
        store: BlobStore,
        pool: Executor,
        budget: Budget,
        decoded: DecodedChunks | None = None,
    ):
        self._catalog = catalog
        self._store = store
        self._pool = pool
        self._budget = budget
        self.decoded = decoded or DecodedChunks(0)
        self.loaded = LoadedChunks()

    def stream(
        self,
        info: CheckpointRecord,
        tensors: list[TensorInfo],
        stats: DecodeStats | None = None,
        keep: bool = False,
    ) -> Iterator[Piece]:
        """The bytes of ``tensors`` (some or all of ``info``'s, in the order given), each chunk
        verified against its checksum, the chunks checked to tile their tensors. Chains
        start from the links kept decoded; ``keep``: what this decodes is kept too (a load;
        not a base-cache fill, whose file serves the next loads, nor the verifier)."""
        return self.ahead(*self.decoder(info, tensors, stats, keep))

    def ahead(self, decoder: ChainDecoder, chunks: list[ChunkInfo]) -> Iterator[Piece]:
        """``chunks`` decoded by ``decoder`` in the pool, within the bytes in flight."""
        return decoded_ahead(self._pool, decoder, chunks, self._budget.bytes_in_flight)

    def load(
        self, info: CheckpointRecord, tensors: list[TensorInfo], stats: DecodeStats
    ) -> LoadChains:
        """A load's chains, read from the chunks kept decoded when they hold them all, else
        from storage (keeping what they decode): one decoder, built once, for both."""
        return LoadChains(self, info, tensors, stats)

    def decoder(
        self,
        info: CheckpointRecord,
        tensors: list[TensorInfo],
        stats: DecodeStats | None,
        keep: bool,
    ) -> tuple[ChainDecoder, list[ChunkInfo]]:
        """A decoder of ``info``'s chains and the chunks of ``tensors``, in their order."""
        order = {t.idx: i for i, t in enumerate(tensors)}
        own, closure = self._catalog.chunk_tree(info.id)
        chunks = sorted(
            (c for c in own if c.tensor_idx in order),
            key=lambda c: (order[c.tensor_idx], c.offset),
        )
        try:
            check_tiling(tensors, chunks)
        except CorruptData:
            found = self._catalog.find(info.run, info.step)
            if found is None or found.id != info.id:  # deleted since its tensors were read
                raise CheckpointNotFound(
                    f"run {info.run!r} has no checkpoint at step {info.step}"
                ) from None
            raise
        decoder = ChainDecoder(
            self._store, closure, 2 * self._budget.bytes_in_flight, stats, self.decoded, keep
        )
        decoder.keep_masters(chunks)
        return decoder, chunks

    def materialize(self, info: CheckpointRecord, path: Path) -> None:
        """Write the checkpoint's raw data section (the base cache layout) to ``path``."""
        write_file(path, self.stream(info, self._catalog.tensors(info.id)))


_Tensors = tuple[tuple[int, int, bytes], ...]  # each tensor's index, size and checksum


def _tensors_key(tensors: list[TensorInfo]) -> _Tensors:
    return tuple((t.idx, t.nbytes, t.checksum) for t in tensors)


class LoadedChunks:
    """The chunks that the last loads of a few checkpoints' tensors streamed from: a
    checkpoint's tensors loaded again whose chunks are all still kept decoded are served
    from them without the catalog's chunk tree (a recursive query over every chain: 4-6 ms
    of a warm load of the bench's GPT, 361 tensors, on SQLite).

    What makes that safe is the tensors' checksums, not the chunk rows: an entry is keyed by
    the checkpoint and the index, size and checksum of each tensor it streamed, so it serves
    only the same tensors with the same checksums (a lossy archive re-encoding a tensor
    changes its checksum), each chunk's bytes being those kept under its id and verified
    against its own checksum (:class:`DecodedChunks`: an id reused or re-encoded no longer
    matches). Chunk rows keep their ids and bytes through re-roots and re-bases. A load that
    races the checkpoint's delete is served as the checkpoint was when the load began (the
    chunk tree would have said it is gone)."""

    def __init__(self, entries: int = 64) -> None:
        self._entries: OrderedDict[tuple[int, _Tensors], list[ChunkInfo]] = OrderedDict()
        self._max = entries
        self._lock = threading.Lock()

    def remember(
        self, checkpoint_id: int, tensors: list[TensorInfo], chunks: list[ChunkInfo]
    ) -> None:
        """``chunks`` (those whose kept bytes are ``tensors``' bytes, in order) streamed a
        load of ``tensors`` of checkpoint ``checkpoint_id``."""
        key = (checkpoint_id, _tensors_key(tensors))
        with self._lock:
            self._entries[key] = chunks
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def kept(
        self, checkpoint_id: int, tensors: list[TensorInfo], decoded: DecodedChunks
    ) -> list[ChunkInfo] | None:
        """The chunks a load of the same tensors of this checkpoint streamed from, in order,
        if they are all still kept decoded, else None."""
        with self._lock:
            chunks = self._entries.get((checkpoint_id, _tensors_key(tensors)))
        return chunks if chunks is not None and decoded.holds(chunks) else None


class LoadChains:
    """:meth:`ChainSource.load`: a load's chains, the decoder and its chunks built on first
    use (the catalog's chunk tree and the tiling check, once per load)."""

    def __init__(
        self,
        source: ChainSource,
        info: CheckpointRecord,
        tensors: list[TensorInfo],
        stats: DecodeStats,
    ) -> None:
        self._source = source
        self._info = info
        self._tensors = tensors
        self._stats = stats
        self._built: tuple[ChainDecoder, list[ChunkInfo]] | None = None

    def kept(self) -> Iterator[Piece] | None:
        """:meth:`stream` if every chunk is kept decoded (a step loaded again: memory,
        faster than any file, each chunk verified when it was decoded), else None; the
        chunks of the last such load when they are all still kept (:class:`LoadedChunks`),
        without the catalog's chunk tree."""
        source = self._source
        remembered = source.loaded.kept(self._info.id, self._tensors, source.decoded)
        if remembered is not None:
            return self._from_kept(remembered)
        return self.stream() if self.all_kept() else None

    def _from_kept(self, remembered: list[ChunkInfo]) -> Iterator[Piece]:
        """The kept bytes of ``remembered``, taken one at a time as they are sent (a slow
        reader holds no more of them than the decoded chunks do); from the first one
        evicted meanwhile, decoded as :meth:`stream` would."""
        decoded = self._source.decoded
        for i, c in enumerate(remembered):
            kept = decoded.get(c)
            if kept is None:
                decoder, chunks = self._decoder()
                yield from self._remembered(
                    decoder, chunks, self._source.ahead(decoder, chunks[i:])
                )
                return
            self._stats.kept += 1
            yield kept

    def all_kept(self) -> bool:
        """Whether every chunk is kept decoded (looked at only when the decoded chunks hold
        at least the tensors' bytes: a load on a fresh replica pays nothing)."""
        decoded = self._source.decoded
        if not self._tensors or decoded.nbytes < sum(t.nbytes for t in self._tensors):
            return False
        decoder, chunks = self._decoder()
        return all(decoded.get(decoder.resolve(c)) is not None for c in chunks)

    def stream(self) -> Iterator[Piece]:
        """The tensors' bytes, in order, verified; what this decodes is kept, and once they
        are all out, which chunks they came from (:class:`LoadedChunks`)."""
        decoder, chunks = self._decoder()  # now: what fails here fails the call
        return self._remembered(decoder, chunks, self._source.ahead(decoder, chunks))

    def _remembered(
        self, decoder: ChainDecoder, chunks: list[ChunkInfo], pieces: Iterator[Piece]
    ) -> Iterator[Piece]:
        yield from pieces
        tops = [decoder.resolve(c) for c in chunks]
        if all(top.checksum == c.checksum for top, c in zip(tops, chunks, strict=True)):
            self._source.loaded.remember(self._info.id, self._tensors, tops)

    def _decoder(self) -> tuple[ChainDecoder, list[ChunkInfo]]:
        if self._built is None:
            self._built = self._source.decoder(self._info, self._tensors, self._stats, True)
        return self._built


class StoredBases:
    """A save's bases (a :class:`ckptstore_core.pipeline.BaseReader`) decoded from storage
    along their chains: a save with no base file (a part of a checkpoint written by several
    writers, whose parent no cache file holds)."""

    def __init__(self, decoder: ChainDecoder) -> None:
        self._decoder = decoder

    def read(self, base: BaseChunk, into: np.ndarray) -> memoryview:
        data = self._decoder.decode(self._decoder.closure[base.chunk_id])
        if len(data) != len(into):
            raise CorruptData(f"the catalog's chunk {base.chunk_id} has another length")
        return memoryview(data)
