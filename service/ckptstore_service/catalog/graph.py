"""The chunk graph: a checkpoint's tensors and chunks, and the chains between chunks.

A chunk's ``base_id`` names the chunk it is a delta, ref or copy of; following base ids
leads to a self-contained chunk. Rows are built as Core rows, not ORM entities: a checkpoint
has thousands of them, and building ORM instances cost more than the query.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import aliased

from ckptstore_core import codec
from ckptstore_core.errors import CorruptData
from ckptstore_service.catalog.db import Database
from ckptstore_service.catalog.models import (
    COMMITTED,
    DELETED,
    Checkpoint,
    Chunk,
    Part,
    Run,
    TensorRow,
)
from ckptstore_service.catalog.records import ChunkInfo, NewChunk, TensorInfo

__all__ = [
    "chunk_tree",
    "chunks",
    "dependents",
    "descendants",
    "run_dependents",
    "shared_bytes",
    "shared_chunks",
    "sharing",
    "tensors",
]

_CHUNK_COLUMNS = (*NewChunk.__slots__, "id")
# how many ids one recursive query starts from (bound parameters per statement are limited)
_SEED_BATCH = 500


def tensors(
    db: Database,
    checkpoint_id: int,
    *,
    part_id: int | None = None,
    names: Collection[str] | None = None,
) -> list[TensorInfo]:
    """The checkpoint's tensors, by index (with ``part_id``: that part's only; with
    ``names``: those of these names only)."""
    query = (
        select(
            TensorRow.idx,
            TensorRow.name,
            TensorRow.dtype,
            TensorRow.shape,
            TensorRow.begin,
            TensorRow.nbytes,
            TensorRow.checksum,
            TensorRow.sent_checksum,
        )
        .where(TensorRow.checkpoint_id == checkpoint_id)
        .order_by(TensorRow.idx)
    )
    if part_id is not None:
        query = query.where(TensorRow.part_id == part_id)
    if names is not None:
        query = query.where(TensorRow.name.in_(sorted(names)))
    with db.session() as s:
        rows = s.execute(query).all()
    return [
        TensorInfo(idx, name, dtype, tuple(json.loads(shape)), begin, nbytes, digest, sent)
        for idx, name, dtype, shape, begin, nbytes, digest, sent in rows
    ]


def _chunk_query() -> Any:
    # a chunk of a checkpoint written in parts lives in its part's blob
    return (
        select(
            *(getattr(Chunk, name) for name in _CHUNK_COLUMNS),
            func.coalesce(Part.blob_key, Checkpoint.blob_key),
            Chunk.checkpoint_id,
        )
        .join(Checkpoint, Checkpoint.id == Chunk.checkpoint_id)
        .outerjoin(Part, Part.id == Chunk.part_id)
    )


def _chunk(row: Any) -> ChunkInfo:
    return ChunkInfo(*row)


def chunks(
    db: Database, checkpoint_id: int, tensor_idx: Collection[int] | None = None
) -> list[ChunkInfo]:
    """The checkpoint's chunks (only those of the tensors ``tensor_idx``, if given), in
    tensor and offset order."""
    query = (
        _chunk_query()
        .where(Chunk.checkpoint_id == checkpoint_id)
        .order_by(Chunk.tensor_idx, Chunk.offset)
    )
    if tensor_idx is not None:
        query = query.where(Chunk.tensor_idx.in_(sorted(tensor_idx)))
    with db.session() as s:
        return [_chunk(r) for r in s.execute(query).all()]


def chunk_tree(db: Database, checkpoint_id: int) -> tuple[list[ChunkInfo], dict[int, ChunkInfo]]:
    """The checkpoint's chunks (in tensor and offset order) and, by id, those chunks plus
    every chunk their chains reach. CorruptData if a chain names a chunk that has no row.

    One statement (one recursive query, so one snapshot on SQLite and on PostgreSQL alike):
    a re-root rewrites the chains of committed chunks (codec, base, blob), and reads on
    either side of its commit would mix the old shape and the new one. A chain 8 deep
    also took 8 round trips link by link, 20-35 ms of a cold restore's first byte.
    """
    seed = select(Chunk.id, Chunk.base_id).where(Chunk.checkpoint_id == checkpoint_id)
    reach = seed.cte("reach", recursive=True)
    reach = reach.union(select(Chunk.id, Chunk.base_id).join(reach, Chunk.id == reach.c.base_id))
    query = _chunk_query().where(Chunk.id.in_(select(reach.c.id)))
    with db.session() as s:
        known = {c.id: c for c in map(_chunk, s.execute(query).all())}
    own = [c for c in known.values() if c.checkpoint_id == checkpoint_id]
    lost = {c.base_id for c in known.values() if c.base_id is not None} - known.keys()
    if lost:
        raise CorruptData(f"the catalog's chunks name base chunks it has not: {sorted(lost)[:5]}")
    own.sort(key=lambda c: (c.tensor_idx, c.offset))
    return own, known


def descendants(db: Database, ids: Collection[int]) -> list[ChunkInfo]:
    """Every chunk whose chain passes through one of the chunks ``ids`` (a delta, ref or
    copy of one of them, or of such a chunk, and so on), not those chunks themselves."""
    found: dict[int, ChunkInfo] = {}
    ordered = sorted(ids)
    with db.session() as s:
        for i in range(0, len(ordered), _SEED_BATCH):
            seed = select(Chunk.id).where(Chunk.base_id.in_(ordered[i : i + _SEED_BATCH]))
            reach = seed.cte("down", recursive=True)
            reach = reach.union(select(Chunk.id).join(reach, Chunk.base_id == reach.c.id))
            query = _chunk_query().where(Chunk.id.in_(select(reach.c.id)))
            found.update((c.id, c) for c in map(_chunk, s.execute(query).all()))
    return [c for c in found.values() if c.id not in ids]


def dependents(db: Database, checkpoint_id: int) -> list[ChunkInfo]:
    """The chunks of other checkpoints whose base is one of checkpoint ``checkpoint_id``'s
    chunks (a delta or ref of it), by checkpoint, tensor and offset."""
    own = select(Chunk.id).where(Chunk.checkpoint_id == checkpoint_id)
    query = (
        _chunk_query()
        .where(Chunk.base_id.in_(own), Chunk.checkpoint_id != checkpoint_id)
        .order_by(Chunk.checkpoint_id, Chunk.tensor_idx, Chunk.offset)
    )
    with db.session() as s:
        return [_chunk(r) for r in s.execute(query).all()]


def shared_chunks(db: Database, checkpoint_id: int) -> set[int]:
    """The ids of checkpoint ``checkpoint_id``'s chunks that a delete of it keeps as
    *shared chunks* (docs/lifecycle.md): those that a chunk of another checkpoint refers to
    (codec ``ref``: a frozen tensor's later copies, a fork's first checkpoint) or that a
    shared chunk of an earlier delete rests on, and, within the checkpoint, the chunks these
    rest on (an fp32 master under its bf16 copy). Their bytes are needed as they are by
    whatever refers to them: kept, they cost the delete nothing, where a re-base would copy
    them into every blob that refers to them."""
    dep = aliased(Chunk)
    owner = aliased(Checkpoint)
    query = (
        select(Chunk.id)
        .join(dep, dep.base_id == Chunk.id)
        .join(owner, owner.id == dep.checkpoint_id)
        .where(
            Chunk.checkpoint_id == checkpoint_id,
            dep.checkpoint_id != checkpoint_id,
            or_(dep.codec == codec.REF, owner.status == DELETED),
        )
        .distinct()
    )
    with db.session() as s:
        kept = set(s.scalars(query).all())
        if not kept:
            return kept
        base_of = dict(
            s.execute(
                select(Chunk.id, Chunk.base_id).where(Chunk.checkpoint_id == checkpoint_id)
            ).all()
        )
    for i in list(kept):
        base = base_of[i]
        while base in base_of and base not in kept:
            kept.add(base)
            base = base_of[base]
    return kept


def sharing(db: Database, run: str) -> set[int]:
    """The deleted checkpoints of ``run`` that keep shared chunks."""
    query = (
        select(Checkpoint.id)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Run.name == run, Checkpoint.status == DELETED)
        .where(select(Chunk.id).where(Chunk.checkpoint_id == Checkpoint.id).exists())
    )
    with db.session() as s:
        return set(s.scalars(query).all())


def _run_chunk_ids(run: str, *, shared: bool = False) -> Any:
    """The ids of the chunks of ``run``'s committed checkpoints (a subquery); with
    ``shared``, those its deleted checkpoints keep as shared chunks too."""
    statuses = (COMMITTED, DELETED) if shared else (COMMITTED,)
    return (
        select(Chunk.id)
        .join(Checkpoint, Checkpoint.id == Chunk.checkpoint_id)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Run.name == run, Checkpoint.status.in_(statuses))
    )


def run_dependents(db: Database, run: str) -> list[ChunkInfo]:
    """The chunks of other runs' checkpoints (forks, and their later saves, and the shared
    chunks their deletes kept) whose base is a chunk of one of ``run``'s checkpoints (or one
    of the run's shared chunks), by checkpoint, tensor and offset."""
    own = _run_chunk_ids(run, shared=True)
    query = (
        _chunk_query()
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Chunk.base_id.in_(own), Run.name != run)
        .order_by(Chunk.checkpoint_id, Chunk.tensor_idx, Chunk.offset)
    )
    with db.session() as s:
        return [_chunk(r) for r in s.execute(query).all()]


def shared_bytes(db: Database, run: str) -> int:
    """The stored bytes of the chunks of other runs that ``run``'s chunks rest on (their
    chains reach them: a fork's refs and what those chunks rest on), each counted once."""
    seed = select(Chunk.base_id.label("id")).where(
        Chunk.id.in_(_run_chunk_ids(run)), Chunk.base_id.is_not(None)
    )
    reach = seed.cte("up", recursive=True)
    reach = reach.union(
        select(Chunk.base_id).join(reach, Chunk.id == reach.c.id).where(Chunk.base_id.is_not(None))
    )
    query = (
        select(func.coalesce(func.sum(Chunk.stored_len), 0))
        .join(Checkpoint, Checkpoint.id == Chunk.checkpoint_id)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Chunk.id.in_(select(reach.c.id)), Run.name != run)
    )
    with db.session() as s:
        return int(s.scalar(query) or 0)
