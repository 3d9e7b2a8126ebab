"""The upload transaction of a save: a checkpoint's blob and its ``writing`` row, from
begin to commit or abort.

    tx = UploadTransaction.begin(catalog, store, run, step, lease)  # writing row, writer
    tx.write(parts) ...                                  # appended, in order (the sink)
    tx.finish()                                          # the blob is durable
    tx.commit(...)                                       # one transaction, fenced by lease
    tx.abort()                                           # or: nothing stays visible

Both transactions are the :class:`ckptstore_core.pipeline.ChunkSink` of the chunk pipeline
that fills them. As a context manager it aborts if the body raises before :meth:`commit`.
Data first, metadata last: the checkpoint becomes visible only in the commit's transaction,
after its blob is durable, and only if the lock it was written under (``lease``) is still
held then (LockLost otherwise: the fencing check of :mod:`ckptstore_service.catalog.locks`).
An abort runs each clean-up step on its own (the save's own error is what the client must
see, and a blob store that refused the write refuses the delete too) and drops the
``writing`` row only once its blob is gone: that row is what names a finished blob to the
start-up collection, which nothing else would ever find.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Self

from ckptstore_core.errors import StorageUnavailable
from ckptstore_service.catalog import Catalog, Lease, NewChunk, PartRecord, TensorInfo
from ckptstore_service.names import blob_key
from ckptstore_service.storage import BlobSink, BlobStore, Buffer

__all__ = ["PartTransaction", "UploadTransaction"]

log = logging.getLogger("ckptstore")


def _cleanup(fn: Callable[..., object], *args: object) -> bool:
    """One clean-up step after a failed save; its own failure is logged, not raised (the
    ``writing`` row and blob it leaves are collected at the next start-up). Returns whether
    it succeeded."""
    try:
        fn(*args)
    except Exception as exc:
        log.warning("clean-up after a failed save: %s: %s", type(exc).__name__, exc)
        return False
    return True


def _blob_gone(store: BlobStore, key: str) -> bool:
    """Delete a failed save's blob; whether it is gone (or was never written). Only then may
    its ``writing`` row go: the row is what names a finished blob to the start-up
    collection, which nothing else would ever find."""
    try:
        store.discard(key)
        return True
    except StorageUnavailable as exc:
        # Not answering: asking whether the blob exists would wait as long again.
        log.warning("clean-up after a failed save: %s: %s", type(exc).__name__, exc)
        return False
    except Exception as exc:
        log.warning("clean-up after a failed save: %s: %s", type(exc).__name__, exc)
    try:
        return not store.exists(key)
    except Exception:
        return False


class _BlobTransaction:
    """A blob written in order (a :class:`BlobSink`, so a chunk pipeline's sink too), then
    made durable, named by a row that goes with it on abort. Subclasses say which row:
    :meth:`_drop_row`."""

    def __init__(self, store: BlobStore, key: str, written_elsewhere: bool = False) -> None:
        self._store = store
        self.key = key
        # a blob its writer uploads straight to the store (presigned): nothing written here
        self._writer = None if written_elsewhere else BlobSink(store, key)
        self.committed = False

    def write(self, parts: Iterable[Buffer]) -> tuple[int, int]:
        """Append one encoded chunk; returns its (offset, length) in the blob."""
        assert self._writer is not None
        return self._writer.write(parts)

    def finish(self) -> int:
        """Make the blob durable; returns its size."""
        assert self._writer is not None
        return self._writer.finish()

    def _drop_row(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Undo what is not committed; each step on its own, failures logged."""
        if self.committed:
            return
        if self._writer is not None:
            _cleanup(self._writer.abort)
        if _blob_gone(self._store, self.key):
            _cleanup(self._drop_row)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()


class UploadTransaction(_BlobTransaction):
    """A single writer's checkpoint (see the module's docstring); ``checkpoint_id`` is its
    ``writing`` row's id."""

    def __init__(
        self,
        catalog: Catalog,
        store: BlobStore,
        key: str,
        checkpoint_id: int,
        lease: Lease | None = None,
    ):
        super().__init__(store, key)
        self._catalog = catalog
        self.checkpoint_id = checkpoint_id
        self._lease = lease

    @classmethod
    def begin(
        cls, catalog: Catalog, store: BlobStore, run: str, step: int, lease: Lease | None = None
    ) -> UploadTransaction:
        """``lease``: the run lock's, held for the whole upload; the commit checks it."""
        run_id = catalog.ensure_run(run)
        key = blob_key(run, step)
        return cls(catalog, store, key, catalog.begin_upload(run_id, step, key), lease)

    def _drop_row(self) -> None:
        self._catalog.abort_upload(self.checkpoint_id)

    def commit(
        self,
        *,
        parent_id: int | None,
        keyframe: bool,
        since_keyframe: int,
        raw_bytes: int,
        stored_bytes: int,
        metadata: dict[str, str],
        tensors: Sequence[TensorInfo],
        chunks: Sequence[NewChunk],
        sibling_bases: dict[int, int],
        lossy: Mapping[str, object] | None = None,
        pairing: Mapping[str, object] | None = None,
    ) -> None:
        """Make the checkpoint visible (after :meth:`finish`), in one transaction.
        ``lossy``: the parameters its lossy chunks were stored with (None: bit-exact);
        ``pairing``: what a lossy save paired (None: not asked to be lossy)."""
        self._catalog.commit_upload(
            self.checkpoint_id,
            parent_id=parent_id,
            keyframe=keyframe or all(c.depth == 0 for c in chunks),
            chain_depth=max((c.depth for c in chunks), default=0),
            since_keyframe=since_keyframe,
            raw_bytes=raw_bytes,
            stored_bytes=stored_bytes,
            metadata=metadata,
            tensors=tensors,
            chunks=chunks,
            sibling_bases=sibling_bases,
            fence=self._lease,
            lossy=lossy,
            pairing=pairing,
        )
        self.committed = True


class PartTransaction(_BlobTransaction):
    """One part of a checkpoint written by several writers: its ``writing`` part row, its
    blob; :meth:`commit` records its rows and makes it ``done`` (the checkpoint stays
    invisible until :meth:`Catalog.commit_parts`)."""

    def __init__(
        self,
        catalog: Catalog,
        store: BlobStore,
        key: str,
        part: PartRecord,
        lease: Lease | None = None,
        written_elsewhere: bool = False,
    ):
        super().__init__(store, key, written_elsewhere)
        self._catalog = catalog
        self.part = part
        self._lease = lease

    @classmethod
    def begin(
        cls,
        catalog: Catalog,
        store: BlobStore,
        run: str,
        step: int,
        checkpoint_id: int,
        name: str,
        lease: Lease | None = None,
        uploaded: str | None = None,
    ) -> PartTransaction:
        """``lease``: the part lock's, held while the part uploads; its commit checks it.
        ``uploaded``: the key of a blob its writer uploaded to the store itself (presigned;
        completed by the caller, deleted on abort)."""
        key = uploaded or blob_key(run, step)
        part_id = catalog.begin_part(checkpoint_id, name, key)
        record = PartRecord(part_id, checkpoint_id, name, key, "", 0, 0, 0)
        return cls(catalog, store, key, record, lease, uploaded is not None)

    def _drop_row(self) -> None:
        self._catalog.drop_part(self.part.id)

    def commit(
        self,
        *,
        raw_bytes: int,
        stored_bytes: int,
        tensors: Sequence[TensorInfo],
        chunks: Sequence[NewChunk],
        sibling_bases: dict[int, int],
        encoded_by: str = "service",
    ) -> None:
        """``encoded_by``: ``client`` when the part's writer encoded its chunks."""
        self._catalog.finish_part(
            self.part,
            raw_bytes=raw_bytes,
            stored_bytes=stored_bytes,
            tensors=tensors,
            chunks=chunks,
            sibling_bases=sibling_bases,
            fence=self._lease,
            encoded_by=encoded_by,
        )
        self.committed = True
