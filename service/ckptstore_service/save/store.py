"""The middle stages of every save, whoever writes: split the body's tensor pieces into
chunks, plan each against its base, encode them in order and append each to the blob of the
upload transaction; the result is the rows to commit."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field

import xxhash

from ckptstore_core.errors import InternalError
from ckptstore_core.lossy import LOSSY
from ckptstore_core.wire import Header, TensorPiece
from ckptstore_service.budget import Budget
from ckptstore_service.catalog import Catalog, CheckpointRecord, NewChunk, TensorInfo
from ckptstore_service.save.encode import BaseReader, Encoded, EncodePipeline
from ckptstore_service.save.plan import ChunkPlan, DeltaPlanner, LossySave
from ckptstore_service.save.split import RawChunk, Splitter
from ckptstore_service.save.upload import PartTransaction, UploadTransaction
from ckptstore_service.settings import Settings

__all__ = ["ChunkStore", "Stored", "Transaction", "planner_for"]

Transaction = UploadTransaction | PartTransaction

_READ_BYTES = 4 << 20  # what a lossy tensor's checksum reads of the cache file at once


def planner_for(
    catalog: Catalog,
    settings: Settings,
    header: Header,
    parent: CheckpointRecord | None,
    lossy: LossySave | None = None,
) -> tuple[DeltaPlanner, dict[int, TensorInfo]]:
    """The delta planner of a save of ``header`` after ``parent`` (None: the run's first),
    and the parent's tensors by index. A keyframe every ``keyframe_interval`` checkpoints;
    ``lossy``: what a lossy save asks for (its chunks need a base: none on a first save)."""
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
        lossy=lossy,
        lossy_max_depth=settings.lossy_max_chain_depth,
    )
    return planner, tensors


@dataclass
class Stored:
    """What the stages made of a body: the rows to commit."""

    tensors: list[TensorInfo] = field(default_factory=list)
    chunks: list[NewChunk] = field(default_factory=list)
    siblings: dict[int, int] = field(default_factory=dict)  # chunk -> its fp32 master chunk
    t_body: float = 0.0  # when the body's last chunk was handed to the encoder

    @property
    def lossy(self) -> bool:
        """Whether a chunk was stored lossy: the checkpoint does not load to what was sent."""
        return any(c.codec == LOSSY for c in self.chunks)


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
        order (what they load to goes to ``cache_fd`` at their data-section offsets). The
        tensors that may hold lossy chunks get the checksum of what ``cache_fd`` then holds
        of them, and that of the bytes sent as ``sent_checksum`` where it differs."""
        splitter = Splitter(header, self.chunk_bytes, planner.lossy_tensors)
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
        for i, (t, digest) in enumerate(zip(header.tensors, digests, strict=True)):
            loads = digest
            if i in planner.lossy_tensors:
                loads = _file_digest(cache_fd, t.begin, t.nbytes)
            sent = None if loads == digest else digest
            stored.tensors.append(
                TensorInfo(i, t.name, t.dtype, t.shape, t.begin, t.nbytes, loads, sent)
            )
        return stored


def _file_digest(fd: int, begin: int, size: int) -> bytes:
    """The xxh3-128 of ``size`` bytes of file ``fd`` at ``begin``."""
    hasher = xxhash.xxh3_128()
    for off in range(begin, begin + size, _READ_BYTES):
        n = min(_READ_BYTES, begin + size - off)
        data = os.pread(fd, n, off)
        if len(data) != n:
            raise InternalError("a save's cache file is shorter than the chunks written to it")
        hasher.update(data)
    return hasher.digest()


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
