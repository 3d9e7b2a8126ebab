"""The save path, as named stages:

    body -> header (save/header.py: read and checked before anything is stored)
         -> plan (save/plan.py: the parent and the settings made into the delta planner)
         -> the chunk pipeline of the core (ckptstore_core.pipeline: split, plan, encode)
         -> upload transaction (save/upload.py, the pipeline's sink: blob appended, made
            durable, one commit)

:class:`Saver` runs them in the calling (worker) thread, which consumes the request body as
an iterator of byte pieces (fed by the event loop, see ``api/body.py``), under the run's
lock, taken once the header is read and the first tensor bytes arrived (a client that
stalls after its header blocks no one's saves to the run); the commit checks the lock's
lease (fencing: a save whose lock was lost commits nothing, LockLost). It holds a bounded
amount whatever the checkpoint's size. The raw bytes also go to a new base-cache file (the
cache policy decides which, and installs it after the commit). Any failure aborts the upload
transaction (blob deleted, then its ``writing`` row) and discards the cache file, so nothing
becomes visible.

A lossy save (``ckptstore.lossy`` in the header's metadata, docs/lossy.md) stores the paired
fp32 weights and Adam moments lossy against the parent's reconstruction: the new cache file
gets the reconstruction, not the bytes sent (the next save diffs against what loads, and
``latest`` served from the cache is what a cold load rebuilds), each such tensor's checksum
is its reconstruction's (the one it was sent as is kept for retries), and the checkpoint
records the parameters if a chunk was stored lossy, and what was paired (its listing's
``pairing``; a warning names the layout when an optimizer is there and nothing paired with
its moments). It never overwrites its parent's cache
file in place: a chunk reads the parent's ``exp_avg_sq`` at another tensor's place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from ckptstore_core.codec import Buffer
from ckptstore_core.pipeline import ChunkPipeline, FileBases, LossySave, same_offsets
from ckptstore_service.cache_policy import CachePolicy
from ckptstore_service.catalog import Catalog, CheckpointRecord, Lease
from ckptstore_service.metrics import Metrics
from ckptstore_service.save.header import (
    Incoming,
    open_body,
    same_content,
    stored_metadata,
    wait_for_data,
)
from ckptstore_service.save.plan import planner_for
from ckptstore_service.save.upload import UploadTransaction
from ckptstore_service.settings import Settings
from ckptstore_service.storage import BlobStore

__all__ = ["Saver"]

log = logging.getLogger("ckptstore")


class Saver:
    """Stores checkpoints (see the module's docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        store: BlobStore,
        cache: CachePolicy,
        chunks: ChunkPipeline,
        settings: Settings,
        metrics: Metrics,
    ) -> None:
        self._catalog = catalog
        self._store = store
        self._cache = cache
        self._chunks = chunks
        self._settings = settings
        self._metrics = metrics

    def ingest(
        self, run: str, step: int, body: Iterable[Buffer], content_length: int | None
    ) -> tuple[CheckpointRecord, bool]:
        """Store one checkpoint from a safetensors stream; returns (record, created).

        ``created`` is False when the same step already holds identical content (an
        idempotent retry); different content raises CheckpointExists.
        """
        s = self._settings
        incoming = wait_for_data(open_body(body, content_length, s))
        with self._catalog.run_lock(run) as lease:
            assert lease is not None
            existing = self._catalog.find(run, step)
            if existing is not None:
                conflict = f"run {run!r} already has a different checkpoint at step {step}"
                stored = self._catalog.tensors(existing.id)
                same_content(stored, existing.stored_metadata, incoming, conflict, existing.lossy)
                return existing, False
            self._store_new(run, step, incoming, lease)
        record = self._catalog.get(run, step)
        self._metrics.saved(record)
        return record, True

    def _store_new(self, run: str, step: int, incoming: Incoming, lease: Lease) -> None:
        t_start = time.perf_counter()
        header = incoming.header
        parent = self._catalog.parent_of(run, step)
        lossy = LossySave.asked(header)
        pairing = None if lossy is None else _pairing(run, step, lossy)
        planner, parent_tensors = planner_for(self._catalog, self._settings, header, parent, lossy)
        # a lossy chunk reads its pair's exp_avg_sq in the parent's file: not overwritten
        in_place = lossy is None and same_offsets(parent_tensors.values(), header)
        with (
            self._cache.save_files(run, parent, in_place) as files,
            UploadTransaction.begin(self._catalog, self._store, run, step, lease) as tx,
        ):
            bases = None if files.base_fd is None else FileBases(files.base_fd)
            stored = self._chunks.run(header, incoming.pieces, planner, bases, files.fd, tx)
            t_encoded = time.perf_counter()
            stored_bytes = tx.finish()
            t_durable = time.perf_counter()
            tx.commit(
                parent_id=None if parent is None else parent.id,
                # lossy chunks go on through keyframes: the checkpoint then holds deltas
                keyframe=planner.keyframe and not stored.lossy,
                since_keyframe=planner.since_keyframe,
                raw_bytes=header.data_len,
                stored_bytes=stored_bytes,
                # what was done is the checkpoint's ``lossy``, not what was asked
                metadata=stored_metadata(header.metadata),
                tensors=stored.tensors,
                chunks=stored.chunks,
                sibling_bases=stored.siblings,
                lossy=lossy.params.to_json() if lossy is not None and stored.lossy else None,
                pairing=pairing,
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


def _pairing(run: str, step: int, lossy: LossySave) -> dict[str, object] | None:
    """What a lossy save paired, as its listing shows it; logged, and a warning when an
    optimizer is there and no weight was paired with its moments (the tier then prunes
    weights alone, or nothing: docs/lossy.md#which-weights-pair)."""
    if lossy.pairing is None:
        return None
    summary = lossy.pairing.summary()
    if lossy.pairing.paired_nothing:
        log.warning(
            "lossy save %s/%d paired no weight with its Adam moments (%s); %d fp32 weights "
            "(%d bytes) stay exact: pass model= and optimizer= to the save "
            "(docs/lossy.md#which-weights-pair)",
            run,
            step,
            summary["layout"],
            summary["exact"],
            summary["exact_bytes"],
        )
    else:
        log.info(
            "lossy save %s/%d paired %d weights with moments, %d without, left %d exact (%s)",
            run,
            step,
            summary["with_moments"],
            summary["without_moments"],
            summary["exact"],
            summary["layout"],
        )
    return summary
