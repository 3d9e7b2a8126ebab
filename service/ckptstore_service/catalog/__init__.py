"""The catalog: the delta chain in SQL (SQLite by default, PostgreSQL in production).

No HTTP and no blob I/O here. Every method opens a short transaction and returns plain frozen
dataclasses (:mod:`.records`), never ORM objects, so callers hold no session across a long
upload. :class:`Catalog` is the one object callers use; behind it, one module per concern:

* :mod:`.db`: engine, transactions, migrations, errors -> StorageUnavailable
* :mod:`.deadline`: PostgreSQL: a client-side deadline on every call of the database
* :mod:`.locks`: run locks, one interface, a backend per kind of database
* :mod:`.checkpoints`: runs and committed checkpoints (look-ups, listings)
* :mod:`.uploads`: the upload protocol (begin -> commit | abort)
* :mod:`.graph`: tensors, chunks and their chains
* :mod:`.garbage`: blobs due for deletion, and the re-root commit
* :mod:`.parts`: checkpoints written in parts by several writers, committed once
* :mod:`.lifecycle`: deleting checkpoints (after their re-base) and runs
* :mod:`.retention`: pins and runs' retention policies
* :mod:`.archive`: the commit that moves a checkpoint to the lossy tier
* :mod:`.tokens`: bearer tokens, stored hashed (``Catalog.tokens``)
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from ckptstore_core.records import RunInfo
from ckptstore_core.retention import RetentionPolicy
from ckptstore_service.catalog import (
    archive,
    checkpoints,
    garbage,
    graph,
    lifecycle,
    parts,
    retention,
    uploads,
)
from ckptstore_service.catalog.db import DEFAULT_TIMEOUT_S, Database, shown_url
from ckptstore_service.catalog.lifecycle import DeleteChanges, KeptChunks, PartBlob
from ckptstore_service.catalog.locks import DEFAULT_LEASE_S, Lease, Purpose, open_run_locks
from ckptstore_service.catalog.parts import PartRecord
from ckptstore_service.catalog.records import (
    CheckpointRecord,
    CheckpointUpdate,
    ChunkInfo,
    ChunkUpdate,
    NewChunk,
    TensorInfo,
)
from ckptstore_service.catalog.tokens import TokenStore

__all__ = [
    "Catalog",
    "CheckpointRecord",
    "CheckpointUpdate",
    "ChunkInfo",
    "ChunkUpdate",
    "DeleteChanges",
    "KeptChunks",
    "Lease",
    "NewChunk",
    "PartBlob",
    "PartRecord",
    "RunInfo",
    "TensorInfo",
    "shown_url",
]


class Catalog:
    """The catalog of one database URL: open once per process, share across threads.

    ``holder`` names this process's run locks (default: a random name; a replica passes a
    name kept in its data folder, so that it releases at start-up what it held when it
    died: :meth:`release_own_locks`); ``lease_s``: PostgreSQL's lock lease
    (:class:`~.locks.LeaseLocks`); ``timeout_s``: PostgreSQL's longest wait for one call
    (:class:`~.db.Database`)."""

    def __init__(
        self,
        url: str,
        *,
        holder: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._db = Database(url, timeout_s=timeout_s)
        self._locks = open_run_locks(self._db, holder, lease_s)
        #: bearer tokens (:mod:`.tokens`)
        self.tokens = TokenStore(self._db)

    @property
    def url(self) -> str:
        return self._db.url

    @property
    def is_postgres(self) -> bool:
        return self._db.is_postgres

    @property
    def engine(self) -> Engine:
        return self._db.engine

    @property
    def sqlite_file(self) -> Path | None:
        """The SQLite file, None for PostgreSQL or an in-memory database."""
        return self._db.sqlite_file

    def close(self) -> None:
        self._db.close()
        self._locks.close()

    def ping(self) -> None:
        self._db.ping()

    def check_ready(self) -> None:
        """:meth:`ping`, and CorruptData once any call found the database damaged."""
        self._db.check_ready()

    def upgrade(self) -> None:
        """Bring the schema to the newest revision (idempotent; see :meth:`Database.upgrade`)."""
        self._db.upgrade()

    def revision(self) -> str | None:
        """The schema's current revision (None before the first upgrade)."""
        return self._db.revision()

    # -- locks -------------------------------------------------------------------------------

    def run_lock(self, run: str, *, blocking: bool = True) -> AbstractContextManager[Lease | None]:
        """Serialize writers of ``run`` (threads, processes, replicas): a save holds it for
        its whole upload, a re-root for its commit. Yields its :class:`~.locks.Lease` once
        held, which the commit under it checks (``fence=``); with ``blocking=False``, None
        at once while another writer holds it (:class:`~.locks.RunLocks` states the
        contract)."""
        return self._locks.hold(Purpose.RUN, run, blocking=blocking)

    def release_own_locks(self) -> int:
        """At start-up, before anything is locked: drop the locks that this holder held when
        it died (their uploads then are collectable at once); how many."""
        return self._locks.release_mine()

    def reroot_lock(
        self, run: str, *, blocking: bool = True
    ) -> AbstractContextManager[Lease | None]:
        """One re-root of ``run`` at a time, and no collection of its garbage meanwhile;
        independent of :meth:`run_lock` (saves go on during a re-root)."""
        return self._locks.hold(Purpose.REROOT, run, blocking=blocking)

    def part_lock(
        self, run: str, step: int, part: str, *, blocking: bool = True
    ) -> AbstractContextManager[Lease | None]:
        """Held by the upload of one part (:mod:`.parts`), across replicas: a ``writing``
        part whose lock is free has no writer."""
        return self._locks.hold(Purpose.PART, f"{run}#{step}#{part}", blocking=blocking)

    # -- checkpoints written in parts (:mod:`.parts`) ----------------------------------------

    def open_parts(self, run_id: int, step: int) -> int:
        return parts.open_checkpoint(self._db, run_id, step)

    def open_parts_of(self, run: str, step: int) -> int | None:
        return parts.open_checkpoint_of(self._db, run, step)

    def find_part(self, checkpoint_id: int, name: str) -> PartRecord | None:
        return parts.find_part(self._db, checkpoint_id, name)

    def begin_part(self, checkpoint_id: int, name: str, blob_key: str) -> int:
        return parts.begin_part(self._db, checkpoint_id, name, blob_key)

    def finish_part(
        self,
        part: PartRecord,
        *,
        raw_bytes: int,
        stored_bytes: int,
        tensors: Sequence[TensorInfo],
        chunks: Sequence[NewChunk],
        sibling_bases: dict[int, int],
        fence: Lease | None = None,
        encoded_by: str = "service",
    ) -> None:
        """Make the part ``done`` (its rows in); ``fence``: the part lock's lease, checked
        in the same transaction; ``encoded_by``: ``client`` for chunks its writer encoded."""
        parts.finish_part(
            self._db,
            part,
            raw_bytes=raw_bytes,
            stored_bytes=stored_bytes,
            tensors=tensors,
            chunks=chunks,
            sibling_bases=sibling_bases,
            fence=fence,
            encoded_by=encoded_by,
        )

    def part_tensors(self, part: PartRecord) -> list[TensorInfo]:
        return parts.part_tensors(self._db, part)

    def drop_part(self, part_id: int) -> None:
        parts.drop_part(self._db, part_id)

    def commit_parts(
        self,
        run: str,
        step: int,
        names: Sequence[str],
        *,
        parent_id: int | None,
        keyframe: bool,
        since_keyframe: int,
        metadata: dict[str, str],
        fence: Lease | None = None,
    ) -> list[PartRecord]:
        """Commit the checkpoint of parts ``names``; ``fence``: the run lock's lease,
        checked in the commit's transaction."""
        return parts.commit_parts(
            self._db,
            run,
            step,
            names,
            parent_id=parent_id,
            keyframe=keyframe,
            since_keyframe=since_keyframe,
            metadata=metadata,
            fence=fence,
        )

    def committed_parts(self, checkpoint_id: int) -> list[str]:
        return parts.committed_parts(self._db, checkpoint_id)

    def parts_in_progress(self) -> list[tuple[PartRecord, str, int]]:
        return parts.parts_in_progress(self._db)

    def abandoned_parts(self, older_than: datetime) -> list[tuple[int, str, int, list[PartRecord]]]:
        return parts.abandoned(self._db, older_than)

    def claim_part(self, part_id: int, abandoned_before: datetime | None = None) -> bool:
        return parts.claim_part(self._db, part_id, abandoned_before)

    def drop_checkpoint(self, checkpoint_id: int) -> None:
        parts.drop_checkpoint(self._db, checkpoint_id)

    # -- runs and checkpoints (:mod:`.checkpoints`) -------------------------------------------

    def ensure_run(self, name: str) -> int:
        return checkpoints.ensure_run(self._db, name)

    def find(self, run: str, step: int | None) -> CheckpointRecord | None:
        """The committed checkpoint ``step`` of ``run`` (None: the latest), or None."""
        return checkpoints.find(self._db, run, step)

    def get(self, run: str, step: int | None) -> CheckpointRecord:
        """Like :meth:`find` but raises RunNotFound / CheckpointNotFound."""
        return checkpoints.get(self._db, run, step)

    def run_exists(self, run: str) -> bool:
        return checkpoints.run_exists(self._db, run)

    def to_verify(self, limit: int = 16) -> list[CheckpointRecord]:
        """Committed checkpoints with client-encoded chunks not verified yet, oldest first."""
        return checkpoints.to_verify(self._db, limit)

    def set_verification(self, checkpoint_id: int, state: str) -> bool:
        """The verifier's verdict (``verified`` or ``corrupt``) on a pending checkpoint."""
        return checkpoints.set_verification(self._db, checkpoint_id, state)

    def parent_of(self, run: str, step: int) -> CheckpointRecord | None:
        """The committed checkpoint of ``run`` with the greatest step below ``step``."""
        return checkpoints.parent_of(self._db, run, step)

    def next_after(self, run: str, step: int) -> CheckpointRecord | None:
        """The committed checkpoint of ``run`` with the smallest step above ``step``."""
        return checkpoints.next_after(self._db, run, step)

    def list_checkpoints(self, run: str) -> list[CheckpointRecord]:
        return checkpoints.list_checkpoints(self._db, run)

    def records_by_id(
        self, ids: Collection[int], *, shared: bool = False
    ) -> dict[int, CheckpointRecord]:
        """The committed checkpoints ``ids``, of any run, by id (with ``shared``: the deleted
        ones keeping shared chunks too)."""
        return checkpoints.records_by_id(self._db, ids, shared=shared)

    def list_runs(self, name: str | None = None) -> list[RunInfo]:
        """Every run with a committed checkpoint (or only run ``name``), summed."""
        return checkpoints.list_runs(self._db, name)

    # -- the upload protocol (:mod:`.uploads`): begin -> commit | abort ----------------------

    def begin_upload(self, run_id: int, step: int, blob_key: str) -> int:
        """Record an upload in progress; its row names the blob for garbage collection."""
        return uploads.begin(self._db, run_id, step, blob_key)

    def commit_upload(
        self,
        checkpoint_id: int,
        *,
        parent_id: int | None,
        keyframe: bool,
        chain_depth: int,
        since_keyframe: int,
        raw_bytes: int,
        stored_bytes: int,
        metadata: dict[str, str],
        tensors: Sequence[TensorInfo],
        chunks: Sequence[NewChunk],
        sibling_bases: Mapping[int, int] | None = None,
        lossy: Mapping[str, Any] | None = None,
        fence: Lease | None = None,
        pairing: Mapping[str, Any] | None = None,
    ) -> None:
        """Make the checkpoint visible: one transaction, after all its bytes are durable
        (:func:`.uploads.commit`). ``lossy``: the parameters its lossy chunks were encoded
        with (listed with it), None for a bit-exact checkpoint; ``pairing``: what a lossy
        save paired (``Pairing.summary()``, listed with it), None if none was asked for.
        ``fence``: the run lock's lease, checked in that transaction (LockLost, nothing
        committed, if it was lost)."""
        figures = uploads.Figures(
            parent_id,
            keyframe,
            chain_depth,
            since_keyframe,
            raw_bytes,
            stored_bytes,
            metadata,
            lossy,
            pairing,
        )
        uploads.commit(
            self._db, checkpoint_id, figures, tensors, chunks, sibling_bases or {}, fence
        )

    def abort_upload(self, checkpoint_id: int) -> None:
        uploads.abort(self._db, checkpoint_id)

    def is_writing(self, checkpoint_id: int) -> bool:
        """Whether ``checkpoint_id`` is still an upload's ``writing`` row: what a collector
        that listed it checks again under the run's lock (the upload may have committed)."""
        return uploads.is_writing(self._db, checkpoint_id)

    def uploads_in_progress(self) -> list[tuple[int, str, str, datetime]]:
        """``(checkpoint_id, run, blob_key, created_at)`` of every ``writing`` row."""
        return uploads.uploads_in_progress(self._db)

    # -- tensors and chunks (:mod:`.graph`) --------------------------------------------------

    def tensors(self, checkpoint_id: int, names: Collection[str] | None = None) -> list[TensorInfo]:
        """The checkpoint's tensors, or those of these ``names``."""
        return graph.tensors(self._db, checkpoint_id, names=names)

    def chunks(
        self, checkpoint_id: int, tensor_idx: Collection[int] | None = None
    ) -> list[ChunkInfo]:
        """The checkpoint's chunks, or those of the tensors ``tensor_idx``."""
        return graph.chunks(self._db, checkpoint_id, tensor_idx)

    def chunk_tree(self, checkpoint_id: int) -> tuple[list[ChunkInfo], dict[int, ChunkInfo]]:
        """The checkpoint's chunks and every chunk their chains reach, in one snapshot."""
        return graph.chunk_tree(self._db, checkpoint_id)

    def descendants(self, ids: Collection[int]) -> list[ChunkInfo]:
        """Every chunk whose chain passes through one of the chunks ``ids``."""
        return graph.descendants(self._db, ids)

    def shared_chunks(self, checkpoint_id: int) -> set[int]:
        """The chunks of the checkpoint that its delete keeps (:func:`.graph.shared_chunks`)."""
        return graph.shared_chunks(self._db, checkpoint_id)

    def sharing(self, run: str) -> set[int]:
        """The run's deleted checkpoints that keep shared chunks (:func:`.graph.sharing`)."""
        return graph.sharing(self._db, run)

    def dependents(self, checkpoint_id: int) -> list[ChunkInfo]:
        """The chunks of other checkpoints whose base is one of this checkpoint's chunks."""
        return graph.dependents(self._db, checkpoint_id)

    def run_dependents(self, run: str) -> list[ChunkInfo]:
        """The chunks of other runs whose base is a chunk of one of ``run``'s checkpoints."""
        return graph.run_dependents(self._db, run)

    def shared_bytes(self, run: str) -> int:
        """The stored bytes of other runs' chunks that ``run``'s chunks rest on."""
        return graph.shared_bytes(self._db, run)

    # -- deleting checkpoints and runs (:mod:`.lifecycle`) -----------------------------------

    def open_parts_step(self, run: str) -> int | None:
        """The step of a checkpoint of ``run`` being written in parts, if any."""
        return lifecycle.open_parts_step(self._db, run)

    def part_blobs(self, checkpoint_id: int) -> list[PartBlob]:
        """The blobs of the checkpoint's parts (none unless written in parts)."""
        return lifecycle.part_blobs(self._db, checkpoint_id)

    def commit_delete(self, run: str, changes: DeleteChanges) -> list[str]:
        """Make a delete visible in one transaction; returns the deleted checkpoint's blobs
        (:func:`.lifecycle.commit_delete` states the contract)."""
        return lifecycle.commit_delete(self._db, run, changes)

    def delete_run(
        self,
        run: str,
        not_before: datetime,
        rebase: garbage.RerootChanges | None = None,
        parts: Sequence[PartBlob] = (),
    ) -> tuple[int, list[str]]:
        """Delete every checkpoint of ``run``; their blobs are garbage from ``not_before``;
        the re-base of other runs' chunks resting on them (``rebase``, ``parts``) in the same
        transaction (:func:`.lifecycle.delete_run`)."""
        return lifecycle.delete_run(self._db, run, not_before, rebase, parts)

    # -- pins and retention policies (:mod:`.retention`) ------------------------------------

    def set_pinned(self, run: str, step: int, pinned: bool) -> CheckpointRecord:
        """Pin (unpin) checkpoint ``step`` of ``run``; returns it. RunNotFound /
        CheckpointNotFound if there is none."""
        return retention.set_pinned(self._db, run, step, pinned)

    def set_retention(self, run: str, policy: RetentionPolicy | None) -> None:
        """Store ``run``'s own retention policy (None: clear it)."""
        retention.set_retention(self._db, run, policy)

    def retention(self, run: str) -> RetentionPolicy | None:
        """``run``'s own retention policy, None if it has none."""
        return retention.retention(self._db, run)

    # -- garbage and re-roots (:mod:`.garbage`) ----------------------------------------------

    def add_garbage(self, run: str, keys: Iterable[str], not_before: datetime) -> list[int]:
        """Name blobs to delete once ``not_before`` has passed; returns the rows' ids."""
        return garbage.add_garbage(self._db, run, keys, not_before)

    def garbage(self, run: str | None, now: datetime) -> list[tuple[int, str, str]]:
        """``(id, run, blob_key)`` of the blobs due for deletion (of one run, or of all)."""
        return garbage.garbage(self._db, run, now)

    def drop_garbage(self, garbage_id: int) -> None:
        garbage.drop_garbage(self._db, garbage_id)

    def blob_in_use(self, key: str) -> bool:
        """Whether any checkpoint row (committed or being written) names blob ``key``."""
        return garbage.blob_in_use(self._db, key)

    def forget_garbage(self, key: str) -> None:
        """Take blob ``key`` off the table (it was deleted by the one that wrote it)."""
        garbage.forget_garbage(self._db, key)

    def commit_reroot(
        self,
        run: str,
        *,
        chunks: Sequence[ChunkUpdate],
        checkpoints: Sequence[CheckpointUpdate],
        written: Sequence[int],
        retired: Sequence[str],
        not_before: datetime,
    ) -> None:
        """Make a re-root visible, in one transaction: the ``chunks``' and the
        ``checkpoints``' new rows, the garbage rows of the blobs it ``written`` (ids)
        dropped, the ``retired`` blobs garbage from ``not_before``. Raises CorruptData,
        changing nothing, if a checkpoint changed meanwhile (:func:`.garbage.commit_reroot`
        states the contract)."""
        changes = garbage.RerootChanges(chunks, checkpoints, written, retired, not_before)
        garbage.commit_reroot(self._db, run, changes)

    # -- archival to the lossy tier (:mod:`.archive`) -----------------------------------------

    def commit_archive(self, run: str, changes: archive.ArchiveChanges) -> None:
        """Make an archival visible, in one transaction: the rewrite's rows, the lossy
        checkpoint's new checksums and its lossy parameters (:func:`.archive.commit_archive`
        states the contract)."""
        archive.commit_archive(self._db, run, changes)

    def warm_up(self) -> None:
        """Run the load path's queries once on ids that do not exist: SQLAlchemy compiles a
        statement on its first use (measured: a cold restore's catalog reads took 29-41 ms
        against 12-15 ms warm), so the first resume after a start-up does not pay for that."""
        self.find("", None)
        self.find("", 0)
        self.parent_of("", 0)
        self.tensors(-1)
        self.chunk_tree(-1)
