"""The garbage table (blobs to delete once their time has come) and the re-root commit.

A blob is named on the garbage table before anything could make it unreachable, so a crash
at any point leaves only blobs that a checkpoint row or a garbage row names. The collector
(:func:`ckptstore_service.reroot.collect_garbage`) deletes a due blob first and its row
after, and never one that a checkpoint names (:func:`blob_in_use`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, delete, func, insert, select, update

from ckptstore_core.errors import CorruptData
from ckptstore_service.catalog.checkpoints import ensure_run
from ckptstore_service.catalog.db import Database
from ckptstore_service.catalog.models import Base, Checkpoint, Chunk, Garbage, Run

__all__ = [
    "add_garbage",
    "blob_in_use",
    "commit_reroot",
    "drop_garbage",
    "forget_garbage",
    "garbage",
]

_CHUNKS = Base.metadata.tables[Chunk.__tablename__]
# what a re-root changes of a chunk row; its id, raw bytes and checksum stay
_REROOT_FIELDS = ("codec", "base_id", "depth", "blob_offset", "stored_len")


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
    """Whether any checkpoint row (committed or being written) names blob ``key``."""
    with db.session() as s:
        return bool(s.scalar(select(func.count()).where(Checkpoint.blob_key == key)))


def forget_garbage(db: Database, key: str) -> None:
    """Take blob ``key`` off the table (it was deleted by the one that wrote it)."""
    with db.session() as s:
        s.execute(delete(Garbage).where(Garbage.blob_key == key))


def commit_reroot(
    db: Database,
    run: str,
    *,
    chunks: Sequence[Mapping[str, Any]],
    checkpoints: Sequence[Mapping[str, Any]],
    written: Sequence[int],
    retired: Sequence[str],
    not_before: datetime,
) -> None:
    """Make a re-root visible, in one transaction: the chunk rows' new ``codec``,
    ``base_id``, ``depth``, ``blob_offset`` and ``stored_len`` (keys ``id`` and those),
    the checkpoints' new ``blob_key``, ``stored_bytes``, ``chain_depth`` and ``keyframe``
    (keys ``id``, ``old_blob_key`` and those), the garbage rows of the ``written`` blobs
    (ids) dropped, the ``retired`` blobs garbage from ``not_before``. Raises
    CorruptData, changing nothing, if a checkpoint's blob is not ``old_blob_key`` any
    more."""
    run_id = ensure_run(db, run)
    with db.session() as s:
        for ck in checkpoints:
            current = s.scalar(select(Checkpoint.blob_key).where(Checkpoint.id == ck["id"]))
            if current != ck["old_blob_key"]:
                raise CorruptData(f"checkpoint {ck['id']} changed during its re-root")
        if chunks:
            s.execute(
                update(_CHUNKS)
                .where(_CHUNKS.c.id == bindparam("b_id"))
                .values({f: bindparam(f"b_{f}") for f in _REROOT_FIELDS}),
                [{f"b_{k}": v for k, v in row.items()} for row in chunks],
            )
        for ck in checkpoints:
            s.execute(
                update(Checkpoint)
                .where(Checkpoint.id == ck["id"])
                .values(
                    blob_key=ck["blob_key"],
                    stored_bytes=ck["stored_bytes"],
                    chain_depth=ck["chain_depth"],
                    keyframe=ck["keyframe"],
                )
            )
        if written:
            taken = s.execute(
                delete(Garbage).where(Garbage.id.in_(list(written))).returning(Garbage.id)
            ).all()
            if len(taken) != len(written):  # a collector took one: it may be gone
                raise CorruptData("a blob of this re-root was collected before its commit")
        if retired:
            s.execute(
                insert(Garbage),
                [{"run_id": run_id, "blob_key": k, "not_before": not_before} for k in retired],
            )
