"""The chunk pipeline, the middle stages of every save whoever writes (the service, for a
body it receives; a client, for the state it encodes itself): split the tensor pieces into
chunks (:mod:`.split`), plan each against its base (:mod:`.plan`), encode them in order
within a budget (:mod:`.encode`) and hand each to a :class:`~.sink.ChunkSink`; the result
is the rows to commit (:class:`Stored`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field

from ckptstore_core import codec
from ckptstore_core.errors import InternalError
from ckptstore_core.lossy import LOSSY
from ckptstore_core.pipeline.budget import Budget
from ckptstore_core.pipeline.encode import BaseReader, Encoded, EncodePipeline
from ckptstore_core.pipeline.plan import ChunkPlan, DeltaPlanner
from ckptstore_core.pipeline.rows import NewChunk, TensorInfo
from ckptstore_core.pipeline.sink import ChunkSink
from ckptstore_core.pipeline.split import RawChunk, Splitter
from ckptstore_core.wire import Header, TensorPiece

__all__ = ["ChunkPipeline", "Stored"]

_READ_BYTES = 4 << 20  # what a lossy tensor's checksum reads of the cache file at once


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
class ChunkPipeline:
    """Runs the stages over one body at a time (see the module's docstring): ``pool`` runs
    the codec jobs, ``budget`` bounds what they hold, ``chunk_bytes`` is the chunk size
    and ``level`` zstd's."""

    pool: Executor
    budget: Budget
    chunk_bytes: int
    level: int  # zstd

    def run(
        self,
        header: Header,
        pieces: Iterator[TensorPiece],
        planner: DeltaPlanner,
        bases: BaseReader | None,
        cache_fd: int,
        sink: ChunkSink,
    ) -> Stored:
        """Split, plan and encode the body's chunks, handing each to ``sink`` in order
        (what they load to goes to ``cache_fd`` at their data-section offsets). The
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
                stored.chunks.append(_stored_chunk(e, planner, splitter, sink, stored))
        digests = splitter.digests.finish()
        for i, (t, digest) in enumerate(zip(header.tensors, digests, strict=True)):
            loads = digest
            if i in planner.lossy_tensors:
                loads = _cache_file_checksum(cache_fd, t.begin, t.nbytes)
            sent = None if loads == digest else digest
            stored.tensors.append(
                TensorInfo(i, t.name, t.dtype, t.shape, t.begin, t.nbytes, loads, sent)
            )
        return stored


def _cache_file_checksum(fd: int, begin: int, size: int) -> bytes:
    """The checksum of ``size`` bytes of the save's cache file ``fd`` at ``begin``."""
    digest = codec.file_checksum(fd, begin, size, _READ_BYTES)
    if digest is None:
        raise InternalError("a save's cache file is shorter than the chunks written to it")
    return digest


def _stored_chunk(
    e: Encoded, planner: DeltaPlanner, splitter: Splitter, sink: ChunkSink, stored: Stored
) -> NewChunk:
    link = planner.link(e.chunk, e.plan, e.enc.codec)
    if link.sibling is not None:
        stored.siblings[len(stored.chunks)] = link.sibling
    splitter.digests.chunk_checksum(e.chunk.tensor_idx, e.enc.checksum)
    blob_offset, size = sink.write(e.enc.parts)
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
