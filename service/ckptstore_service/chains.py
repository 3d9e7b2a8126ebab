"""The service's side of chain decoding (:mod:`ckptstore_core.chain`, which clients that
load directly run too): a checkpoint's tensors decoded from the blob store
(:class:`ChainSource`), and a save's bases decoded from it (:class:`StoredBases`).
"""

from __future__ import annotations

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
        faster than any file, each chunk verified when it was decoded), else None."""
        return self.stream() if self.all_kept() else None

    def all_kept(self) -> bool:
        """Whether every chunk is kept decoded (looked at only when the decoded chunks hold
        at least the tensors' bytes: a load on a fresh replica pays nothing)."""
        decoded = self._source.decoded
        if not self._tensors or decoded.nbytes < sum(t.nbytes for t in self._tensors):
            return False
        decoder, chunks = self._decoder()
        return all(decoded.get(decoder.resolve(c)) is not None for c in chunks)

    def stream(self) -> Iterator[Piece]:
        """The tensors' bytes, in order, verified; what this decodes is kept."""
        return self._source.ahead(*self._decoder())

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
