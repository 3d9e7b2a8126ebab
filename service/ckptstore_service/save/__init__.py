"""The save path, as named stages:

    body -> header (save/header.py: read and checked before anything is stored)
         -> split (save/split.py: tensor pieces into chunks, tensors hashed)
         -> plan (save/plan.py: each chunk's base in the parent, or its fp32 master)
         -> encode (save/encode.py: the codec pool, in order, within a budget)
         -> upload transaction (save/upload.py: blob appended, made durable, one commit)

:class:`Saver` runs them in the calling (worker) thread, which consumes the request body as
an iterator of byte pieces (fed by the event loop, see ``api/body.py``), under the run's
lock. It holds a bounded amount whatever the checkpoint's size. The raw bytes also go to a
new base-cache file (the cache policy decides which, and installs it after the commit). Any
failure aborts the upload transaction (blob deleted, then its ``writing`` row) and discards
the cache file, so nothing becomes visible.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

from ckptstore_service.budget import Budget
from ckptstore_service.cache_policy import CachePolicy, SaveFiles
from ckptstore_service.catalog import Catalog, CheckpointRecord, NewChunk, TensorInfo
from ckptstore_service.save.encode import Encoded, EncodePipeline
from ckptstore_service.save.header import Incoming, open_body, same_content
from ckptstore_service.save.plan import ChunkPlan, DeltaPlanner, same_offsets
from ckptstore_service.save.split import RawChunk, Splitter
from ckptstore_service.save.upload import UploadTransaction
from ckptstore_service.settings import Settings
from ckptstore_service.storage import BlobStore

__all__ = ["Saver"]

log = logging.getLogger("ckptstore")


@dataclass
class _Stored:
    """What the encode loop made of the body: the chunk rows, and which rest on a sibling."""

    chunks: list[NewChunk]
    siblings: dict[int, int]  # chunk index -> index of its fp32 master chunk
    t_body: float  # when the body's last chunk was handed to the encoder


class Saver:
    """Stores checkpoints (see the module's docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        store: BlobStore,
        cache: CachePolicy,
        pool: Executor,
        settings: Settings,
        budget: Budget,
    ) -> None:
        self._catalog = catalog
        self._store = store
        self._cache = cache
        self._pool = pool
        self._settings = settings
        self._budget = budget

    def ingest(
        self, run: str, step: int, body: Iterable[bytes], content_length: int | None
    ) -> tuple[CheckpointRecord, bool]:
        """Store one checkpoint from a safetensors stream; returns (record, created).

        ``created`` is False when the same step already holds identical content (an
        idempotent retry); different content raises CheckpointExists.
        """
        s = self._settings
        incoming = open_body(body, content_length, s.max_header_bytes, s.max_upload_bytes)
        with self._catalog.run_lock(run):
            existing = self._catalog.find(run, step)
            if existing is not None:
                stored = self._catalog.tensors(existing.id)
                return same_content(existing, stored, incoming), False
            self._store_new(run, step, incoming)
        return self._catalog.get(run, step), True

    def _store_new(self, run: str, step: int, incoming: Incoming) -> None:
        t_start = time.perf_counter()
        header = incoming.header
        parent = self._catalog.parent_of(run, step)
        parent_tensors = (
            {} if parent is None else {t.idx: t for t in self._catalog.tensors(parent.id)}
        )
        planner = DeltaPlanner(
            header,
            keyframe=parent is None
            or parent.since_keyframe + 1 >= self._settings.keyframe_interval,
            max_chain_depth=self._settings.max_chain_depth,
            parent_tensors=parent_tensors,
            parent_chunks=[] if parent is None else self._catalog.chunks(parent.id),
        )
        splitter = Splitter(header, self._settings.chunk_bytes)
        in_place = same_offsets(parent_tensors.values(), header)
        with (
            self._cache.save_files(run, parent, in_place) as files,
            UploadTransaction.begin(self._catalog, self._store, run, step) as tx,
        ):
            stored = self._encode(splitter, planner, incoming.pieces, files, tx)
            t_encoded = time.perf_counter()
            stored_bytes = tx.finish()
            t_durable = time.perf_counter()
            tensors = [
                TensorInfo(i, t.name, t.dtype, t.shape, t.begin, t.nbytes, digest)
                for i, (t, digest) in enumerate(
                    zip(header.tensors, splitter.digests.finish(), strict=True)
                )
            ]
            tx.commit(
                parent_id=None if parent is None else parent.id,
                keyframe=planner.keyframe,
                since_keyframe=0
                if planner.keyframe or parent is None
                else parent.since_keyframe + 1,
                raw_bytes=header.data_len,
                stored_bytes=stored_bytes,
                metadata=dict(header.metadata),
                tensors=tensors,
                chunks=stored.chunks,
                sibling_bases=stored.siblings,
            )
            files.committed = (tx.checkpoint_id, header.data_len)
        t_end = time.perf_counter()
        log.info(
            "saved %s/%d: %d -> %d bytes in %.2fs (body %.2fs, encode tail %.2fs, "
            "blob finish %.2fs, commit %.2fs)",
            run,
            step,
            header.data_len,
            stored_bytes,
            t_end - t_start,
            stored.t_body - t_start,
            t_encoded - stored.t_body,
            t_durable - t_encoded,
            t_end - t_durable,
        )

    def _encode(
        self,
        splitter: Splitter,
        planner: DeltaPlanner,
        pieces: Iterator[object],
        files: SaveFiles,
        tx: UploadTransaction,
    ) -> _Stored:
        """Split, plan and encode the body's chunks, appending each to the blob in order."""
        stored = _Stored([], {}, 0.0)

        def planned() -> Iterator[tuple[RawChunk, ChunkPlan]]:
            for c in splitter.chunks(pieces):  # type: ignore[arg-type]
                yield c, planner.plan(c)
            stored.t_body = time.perf_counter()

        level = self._settings.zstd_level
        recycle = splitter.recycle
        with EncodePipeline(
            self._pool, self._budget, level, files.base_fd, files.fd, recycle
        ) as pipeline:
            for e in pipeline.run(planned()):
                stored.chunks.append(self._stored_chunk(e, planner, splitter, tx, stored))
        return stored

    @staticmethod
    def _stored_chunk(
        e: Encoded,
        planner: DeltaPlanner,
        splitter: Splitter,
        tx: UploadTransaction,
        stored: _Stored,
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
