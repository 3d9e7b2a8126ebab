"""The garbage table (blobs to delete once their time has come) and the re-root commit.

A blob is named on the garbage table before anything could make it unreachable, so a crash
at any point leaves only blobs that a checkpoint row or a garbage row names. The collector
(:func:`ckptstore_service.maintenance.collect_garbage`) deletes a due blob first and its row
after, and never one that a checkpoint names (:func:`blob_in_use`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime

from sqlalchemy import bindparam, delete, func, insert, select, update
from sqlalchemy.orm import Session

from ckptstore_core.errors import CorruptData
from ckptstore_service.catalog.checkpoints import ensure_run
from ckptstore_service.catalog.db import Database
from ckptstore_service.catalog.models import Base, Checkpoint, Chunk, Garbage, Part, Run
from ckptstore_service.catalog.records import CheckpointUpdate, ChunkUpdate

__all__ = [
    "RerootChanges",
    "add_garbage",
    "apply_rewrite",
    "blob_in_use",
    "commit_reroot",
    "drop_garbage",
    "forget_garbage",
    "garbage",
    "retire",
]

_CHUNKS = Base.metadata.tables[Chunk.__tablename__]
# ChunkUpdate's fields: "id" names the row, a re-root sets the others; "checksum" only
# where it is given (an archival's lossy chunks)
_FIELDS = tuple(f.name for f in fields(ChunkUpdate) if f.name != "checksum")


def add_garbage(db: Database, run: str, keys: Iterable[str], not_before: datetime) -> list[int]:
    """Name blobs to delete once ``not_before`` has passed; returns the rows' ids."""
    run_id = ensure_run(db, run)
    rows = [{"run_id": run_id, "blob_key": k, "not_before": not_before} for k in keys]
    if not rows:
        return []
    with db.session() as s:
        return list(
            s.scalars(
                insert(Garbage).returning(Garbage.id, sort_by_parameter_order=True), rows
            ).all()
        )


def garbage(db: Database, run: str | None, now: datetime) -> list[tuple[int, str, str]]:
    """``(id, run, blob_key)`` of the blobs due for deletion (of one run, or of all)."""
    query = (
        select(Garbage.id, Run.name, Garbage.blob_key)
        .join(Run, Run.id == Garbage.run_id)
        .where(Garbage.not_before <= now)
        .order_by(Garbage.id)
    )
    if run is not None:
        query = query.where(Run.name == run)
    with db.session() as s:
        return [(i, r, k) for i, r, k in s.execute(query).all()]


def drop_garbage(db: Database, garbage_id: int) -> None:
    """Take garbage row ``garbage_id`` off the table (its blob is gone)."""
    with db.session() as s:
        s.execute(delete(Garbage).where(Garbage.id == garbage_id))


def blob_in_use(db: Database, key: str) -> bool:
    """Whether any checkpoint row (committed or being written), or any part of one, names
    blob ``key``."""
    with db.session() as s:
        if s.scalar(select(func.count()).where(Checkpoint.blob_key == key)):
            return True
        return bool(s.scalar(select(func.count()).where(Part.blob_key == key)))


def forget_garbage(db: Database, key: str) -> None:
    """Take blob ``key`` off the table (it was deleted by the one that wrote it)."""
    with db.session() as s:
        s.execute(delete(Garbage).where(Garbage.blob_key == key))


@dataclass(frozen=True, slots=True)
class RerootChanges:
    """Everything one re-root commit changes."""

    chunks: Sequence[ChunkUpdate]  # the rewritten chunks, and those whose depth follows
    checkpoints: Sequence[CheckpointUpdate]  # those holding such chunks
    written: Sequence[int]  # the garbage rows (ids) of the new blobs: dropped
    retired: Sequence[str]  # the replaced blobs: garbage from ``not_before``
    not_before: datetime


def commit_reroot(db: Database, run: str, changes: RerootChanges) -> None:
    """Make a re-root visible, in one transaction: the chunks' and the checkpoints' new
    rows, the new blobs' garbage rows dropped, the replaced blobs named as garbage.

    Called under the run's lock (no save commits meanwhile), after every new blob is
    durable. Raises CorruptData, changing nothing, if a checkpoint's blob is not its
    ``old_blob_key`` any more, or if a collector took a new blob's garbage row (the blob
    may be gone): the caller then deletes what it wrote.
    """
    run_id = ensure_run(db, run)
    with db.session() as s:
        apply_rewrite(s, run_id, changes)


def apply_rewrite(s: Session, run_id: int, changes: RerootChanges) -> None:
    """The rows of a rewrite of committed chunks (a re-root's, a delete's re-base), in
    transaction ``s``: see :func:`commit_reroot`."""
    for ck in changes.checkpoints:
        current = s.scalar(select(Checkpoint.blob_key).where(Checkpoint.id == ck.id))
        if current != ck.old_blob_key:
            raise CorruptData(f"checkpoint {ck.id} changed during its rewrite")
    if changes.chunks:
        s.execute(
            update(_CHUNKS)
            .where(_CHUNKS.c.id == bindparam("b_id"))
            .values({f: bindparam(f"b_{f}") for f in _FIELDS if f != "id"}),
            [{f"b_{f}": getattr(u, f) for f in _FIELDS} for u in changes.chunks],
        )
    sums = [{"b_id": u.id, "b_checksum": u.checksum} for u in changes.chunks if u.checksum]
    if sums:
        s.execute(
            update(_CHUNKS)
            .where(_CHUNKS.c.id == bindparam("b_id"))
            .values(checksum=bindparam("b_checksum")),
            sums,
        )
    for ck in changes.checkpoints:
        s.execute(
            update(Checkpoint)
            .where(Checkpoint.id == ck.id)
            .values(
                blob_key=ck.blob_key,
                stored_bytes=ck.stored_bytes,
                chain_depth=ck.chain_depth,
                keyframe=ck.keyframe,
            )
        )
    if changes.written:
        taken = s.execute(
            delete(Garbage).where(Garbage.id.in_(list(changes.written))).returning(Garbage.id)
        ).all()
        if len(taken) != len(changes.written):  # a collector took one: it may be gone
            raise CorruptData("a blob of this rewrite was collected before its commit")
    retire(s, run_id, changes.retired, changes.not_before)


def retire(s: Session, run_id: int, keys: Iterable[str], not_before: datetime) -> None:
    """Name blobs ``keys`` (of run ``run_id``) as garbage from ``not_before``, in
    transaction ``s``."""
    rows = [{"run_id": run_id, "blob_key": k, "not_before": not_before} for k in keys if k]
    if rows:
        s.execute(insert(Garbage), rows)
