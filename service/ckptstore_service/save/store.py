"""The middle stages of every save, whoever writes: split the body's tensor pieces into
chunks, plan each against its base, encode them in order and append each to the blob of the
upload transaction; the result is the rows to commit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field

from ckptstore_core.wire import Header, TensorPiece
from ckptstore_service.budget import Budget
from ckptstore_service.catalog import Catalog, CheckpointRecord, NewChunk, TensorInfo
from ckptstore_service.save.encode import BaseReader, Encoded, EncodePipeline
from ckptstore_service.save.plan import ChunkPlan, DeltaPlanner
from ckptstore_service.save.split import RawChunk, Splitter
from ckptstore_service.save.upload import PartTransaction, UploadTransaction
from ckptstore_service.settings import Settings

__all__ = ["ChunkStore", "Stored", "Transaction", "planner_for"]

Transaction = UploadTransaction | PartTransaction


def planner_for(
    catalog: Catalog, settings: Settings, header: Header, parent: CheckpointRecord | None
) -> tuple[DeltaPlanner, dict[int, TensorInfo]]:
    """The delta planner of a save of ``header`` after ``parent`` (None: the run's first),
    and the parent's tensors by index. A keyframe every ``keyframe_interval`` checkpoints."""
    if parent is None:
        return DeltaPlanner(header, keyframe=True, since_keyframe=0, max_chain_depth=0), {}
    tensors = {t.idx: t for t in catalog.tensors(parent.id)}
    since = parent.since_keyframe + 1
    keyframe = since >= settings.keyframe_interval
    planner = DeltaPlanner(
        header,
        keyframe=keyframe,
        since_keyframe=0 if keyframe else since,
        max_chain_depth=settings.max_chain_depth,
        parent_tensors=tensors,
        parent_chunks=catalog.chunks(parent.id),
    )
    return planner, tensors


@dataclass
class Stored:
    """What the stages made of a body: the rows to commit."""

    tensors: list[TensorInfo] = field(default_factory=list)
    chunks: list[NewChunk] = field(default_factory=list)
    siblings: dict[int, int] = field(default_factory=dict)  # chunk -> its fp32 master chunk
    t_body: float = 0.0  # when the body's last chunk was handed to the encoder


@dataclass(frozen=True)
class ChunkStore:
    pool: Executor
    budget: Budget
    chunk_bytes: int
    level: int  # zstd

    def store(
        self,
        header: Header,
        pieces: Iterator[TensorPiece],
        planner: DeltaPlanner,
        bases: BaseReader | None,
        cache_fd: int,
        tx: Transaction,
    ) -> Stored:
        """Split, plan and encode the body's chunks, appending each to ``tx``'s blob in
        order (the raw bytes go to ``cache_fd`` at their data-section offsets)."""
        splitter = Splitter(header, self.chunk_bytes)
        stored = Stored()

        def planned() -> Iterator[tuple[RawChunk, ChunkPlan]]:
            for c in splitter.chunks(pieces):
                yield c, planner.plan(c)
            stored.t_body = time.perf_counter()

        pipeline = EncodePipeline(
            self.pool, self.budget, self.level, bases, cache_fd, splitter.recycle
        )
        with pipeline:
            for e in pipeline.run(planned()):
                stored.chunks.append(_stored_chunk(e, planner, splitter, tx, stored))
        digests = splitter.digests.finish()
        stored.tensors = [
            TensorInfo(i, t.name, t.dtype, t.shape, t.begin, t.nbytes, digest)
            for i, (t, digest) in enumerate(zip(header.tensors, digests, strict=True))
        ]
        return stored


def _stored_chunk(
    e: Encoded, planner: DeltaPlanner, splitter: Splitter, tx: Transaction, stored: Stored
) -> NewChunk:
    link = planner.link(e.chunk, e.plan, e.enc.codec)
    if link.sibling is not None:
        stored.siblings[len(stored.chunks)] = link.sibling
    splitter.digests.chunk_checksum(e.chunk.tensor_idx, e.enc.checksum)
    blob_offset, size = tx.write(e.enc.parts)
    c = e.chunk
    return NewChunk(
        tensor_idx=c.tensor_idx,
        offset=c.offset,
        raw_len=c.raw_len,
        itemsize=c.itemsize,
        codec=e.enc.codec,
        base_id=link.base_id,
        depth=link.depth,
        blob_offset=blob_offset,
        stored_len=size,
        checksum=e.enc.checksum,
    )
