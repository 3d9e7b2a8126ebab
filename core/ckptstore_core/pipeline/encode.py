"""The encode stage of a save: planned chunks in, encoded chunks out, in the same order,
within a memory budget.

Each chunk is encoded against its base (read from the parent's data section in the base
cache, or decoded from storage: a :class:`BaseReader`) or its cast source (read from the new
cache file), and what it loads to is written to the new cache file (its raw bytes; a lossy
chunk's reconstruction, so that the next save diffs against what loads), in the codec pool;
a small chunk costs less to encode in the calling thread than to hand to a codec thread (two
wake-ups), so it is encoded at once. What is held:

* chunks in flight in the pool hold a buffer each: at most ``budget.in_flight`` of them;
* small chunks, encoded at once, hold only what they encoded while they wait for the chunks
  before them; they do not wait on the pool, so the ingest goes on parsing (a state's many
  small tensors come last, see ``upload_order`` in ckptstore.state) while the pool works.
  Each counts at least ``_SMALL_COST`` bytes (its future and bookkeeping weigh ~1 KB): at
  most ``budget.bytes_in_flight`` of them.

Use it as a context manager: on exit, jobs not taken are cancelled or waited for (a job
may still write to the cache file, which the caller is about to close).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Protocol

import numpy as np

from ckptstore_core import codec, lossy
from ckptstore_core.errors import InternalError
from ckptstore_core.pipeline.budget import Budget
from ckptstore_core.pipeline.plan import BaseChunk, CastFrom, ChunkPlan, LossyChunk
from ckptstore_core.pipeline.split import RawChunk

__all__ = [
    "BaseReader",
    "EncodePipeline",
    "Encoded",
    "FileBases",
    "encode_job",
]

# chunks smaller than this are encoded by the ingest thread itself: a hand-off to a codec
# thread (two wake-ups) costs more than encoding a few KiB
_INLINE_BYTES = 64 << 10
# what a small chunk waiting to be written counts for, at least, against the budget
_SMALL_COST = 16 << 10


@dataclass(frozen=True, slots=True)
class Encoded:
    chunk: RawChunk  # its block is recycled: only its place and sizes remain valid
    plan: ChunkPlan
    enc: codec.EncodedChunk


@dataclass(frozen=True, slots=True)
class _Pending:
    chunk: RawChunk
    plan: ChunkPlan
    pooled: bool  # holds its block until encoded (else it was encoded at once)
    future: Future[codec.EncodedChunk]


class BaseReader(Protocol):
    """Where a chunk's base (the same chunk of the parent checkpoint) is read from."""

    def read(self, base: BaseChunk, into: np.ndarray) -> memoryview | None:
        """The base's raw bytes, in ``into`` (its exact length) or in a buffer of its own;
        None where the reader finds that what it holds is not the base after all (a
        writer's copy that fails the parent's checksum): the chunk is then encoded on its
        own."""
        ...


class FileBases:
    """Bases from the parent's raw data section in a file (the base cache)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self, base: BaseChunk, into: np.ndarray) -> memoryview:
        if os.preadv(self.fd, [into.data], base.file_offset) != len(into):
            raise RuntimeError("base cache file is shorter than the catalog says")
        return into.data


def _predicted(cast: CastFrom, cache_fd: int) -> bytes:
    cast.written.wait()
    return codec.cast_prediction(os.pread(cache_fd, cast.length, cast.file_offset), cast.dtype)


def encode_lossy(
    c: RawChunk, plan: LossyChunk, parent: memoryview, bases: BaseReader
) -> tuple[codec.EncodedChunk, np.ndarray] | None:
    """Chunk ``c`` (fp32) stored lossy against ``parent`` (its base's bytes, as they load):
    the encoded chunk (codec LOSSY, the reconstruction's checksum) and the reconstruction,
    or None if :func:`ckptstore_core.lossy.encode` keeps it lossless. The payload is decoded
    back and compared with the reconstruction before it is used (never silent)."""
    v_prev = None
    if plan.v_prev is not None:
        into = np.empty(c.raw_len, np.uint8)
        held = bases.read(plan.v_prev, into)  # an encoder's hint only: the payload decodes without
        v_prev = None if held is None else np.frombuffer(held, np.float32)
    base = np.frombuffer(parent, np.float32)
    out = lossy.encode(plan.role, c.data.view(np.float32), base, v_prev, plan.params)
    if out is None:
        return None
    payload, rec = out
    if lossy.decode(payload, base, len(rec)).tobytes() != rec.tobytes():
        raise InternalError("a lossy chunk does not decode to the reconstruction it encoded")
    return codec.EncodedChunk(lossy.LOSSY, (payload,), codec.checksum(rec.data)), rec


def encode_job(
    c: RawChunk, plan: ChunkPlan, level: int, bases: BaseReader | None, cache_fd: int
) -> codec.EncodedChunk:
    """Encode one chunk (a codec thread's job) and write what it loads to (its raw bytes, or
    a lossy chunk's reconstruction) to the cache file."""
    lossy_out = None
    try:
        predicted = None if plan.cast is None else _predicted(plan.cast, cache_fd)
        parent = None
        if plan.base is not None and bases is not None:
            parent = bases.read(plan.base, c.scratch[: c.raw_len])
        if plan.lossy is not None and parent is not None and bases is not None:
            lossy_out = encode_lossy(c, plan.lossy, parent, bases)
        loads_as = c.data.data if lossy_out is None else lossy_out[1].data
        os.pwrite(cache_fd, loads_as, c.file_offset)
    finally:
        if plan.written is not None:
            plan.written.set()  # also on failure: the ingest fails anyway, nobody must hang
    if lossy_out is not None:
        return lossy_out[0]
    if predicted is not None:
        assert plan.cast is not None
        # a delta on the prediction adds no chain link: every gain counts
        enc = codec.encode_chunk(c.data.data, predicted, c.itemsize, level, min_gain=0.0)
        if enc.codec == codec.REF or codec.is_delta(enc.codec):
            return replace(enc, codec=f"{codec.CASTS[plan.cast.dtype]}|{enc.codec}")
        # the copy is not a rounding of its master after all: the parent may do better
    return codec.encode_chunk(c.data.data, parent, c.itemsize, level, delta=plan.delta)


def _at_once(fn: Callable[..., codec.EncodedChunk], *args: object) -> Future[codec.EncodedChunk]:
    future: Future[codec.EncodedChunk] = Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:
        future.set_exception(exc)
    return future


class EncodePipeline:
    """Encodes planned chunks in order (see the module's docstring). ``recycle`` gets each
    chunk's block back once its bytes are no longer needed."""

    def __init__(
        self,
        pool: Executor,
        budget: Budget,
        level: int,
        bases: BaseReader | None,
        cache_fd: int,
        recycle: Callable[[np.ndarray], None],
    ) -> None:
        self._pool = pool
        self._max_pooled = budget.in_flight
        self._max_small = budget.bytes_in_flight
        self._args = (level, bases, cache_fd)
        self._recycle = recycle
        self._pending: deque[_Pending] = deque()
        self._pooled = self._small = 0

    def run(self, planned: Iterable[tuple[RawChunk, ChunkPlan]]) -> Iterator[Encoded]:
        """The chunks encoded, in the order they came, each as soon as the budget wants it
        out; the rest at the end."""
        for c, plan in planned:
            self._submit(c, plan)
            while self._pending and (
                self._pooled > self._max_pooled or self._small > self._max_small
            ):
                yield self._take()
        while self._pending:
            yield self._take()

    def _submit(self, c: RawChunk, plan: ChunkPlan) -> None:
        pooled = c.raw_len >= _INLINE_BYTES
        if pooled:
            future = self._pool.submit(encode_job, c, plan, *self._args)
            self._pooled += 1
        else:
            future = _at_once(encode_job, c, plan, *self._args)
            self._recycle(c.block)  # encoded: what it returned holds bytes of its own
            self._small += max(c.raw_len, _SMALL_COST)
            future.result()  # a failure stops the upload now, not at the next take
        self._pending.append(_Pending(c, plan, pooled, future))

    def _take(self) -> Encoded:
        p = self._pending.popleft()
        enc = p.future.result()
        if p.pooled:
            self._recycle(p.chunk.block)
            self._pooled -= 1
        else:
            self._small -= max(p.chunk.raw_len, _SMALL_COST)
        return Encoded(p.chunk, p.plan, enc)

    def __enter__(self) -> EncodePipeline:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for p in self._pending:
            p.future.cancel()
        for p in self._pending:
            if not p.future.cancelled():
                p.future.exception()  # wait: the job may still write to the cache file
        self._pending.clear()
