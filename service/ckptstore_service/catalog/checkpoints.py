"""Runs and their committed checkpoints: look-ups and listings.

Only ``committed`` rows are ever returned: an upload in progress (a ``writing`` row, see
:mod:`.uploads`) is invisible here, as a parent, as ``latest`` and in every listing.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection
from typing import Any

from sqlalchemy import and_, case, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import aliased

from ckptstore_core.errors import CheckpointNotFound, RunNotFound
from ckptstore_core.records import RunInfo, user_metadata
from ckptstore_service.catalog.db import Database, utc
from ckptstore_service.catalog.models import COMMITTED, DELETED, PENDING, Checkpoint, Run
from ckptstore_service.catalog.records import CheckpointRecord

__all__ = [
    "ensure_run",
    "find",
    "get",
    "list_checkpoints",
    "list_runs",
    "parent_of",
    "run_exists",
    "set_verification",
    "to_verify",
]


def ensure_run(db: Database, name: str) -> int:
    """The id of run ``name``, created if it has none yet (safe against a replica creating
    it at the same time)."""
    with db.session() as s:
        run_id = s.scalar(select(Run.id).where(Run.name == name))
        if run_id is not None:
            return run_id
    try:
        with db.session() as s:
            return int(s.execute(insert(Run).values(name=name).returning(Run.id)).scalar_one())
    except IntegrityError:  # another replica created it first
        with db.session() as s:
            return int(s.execute(select(Run.id).where(Run.name == name)).scalar_one())


@functools.cache
def _info_query(*, committed: bool = True) -> Any:
    """Built once per kind: an ``aliased`` entity costs a proxy per column at each build
    (1-2 ms per look-up, three look-ups per save), and select statements are immutable."""
    parent = aliased(Checkpoint)
    query = (
        select(Checkpoint, Run.name, parent.step)
        .join(Run, Run.id == Checkpoint.run_id)
        .outerjoin(parent, parent.id == Checkpoint.parent_id)
    )
    return query.where(Checkpoint.status == COMMITTED) if committed else query


def _info(row: Any) -> CheckpointRecord:
    ck, run, parent_step = row
    stored = json.loads(ck.metadata_json)
    return CheckpointRecord(
        id=ck.id,
        run=run,
        step=ck.step,
        parent_step=parent_step,
        keyframe=ck.keyframe,
        chain_depth=ck.chain_depth,
        since_keyframe=ck.since_keyframe,
        raw_bytes=ck.raw_bytes,
        stored_bytes=ck.stored_bytes,
        tensors=ck.n_tensors,
        blob_key=ck.blob_key,
        stored_metadata=stored,
        created=utc(ck.created_at),
        parts=ck.n_parts,
        metadata=user_metadata(stored),
        pinned=ck.pinned,
        lossy=None if ck.lossy_json is None else json.loads(ck.lossy_json),
        verification=ck.verification,
        pairing=None if ck.pairing_json is None else json.loads(ck.pairing_json),
    )


def _first(db: Database, query: Any) -> CheckpointRecord | None:
    with db.session() as s:
        row = s.execute(query).first()
    return None if row is None else _info(row)


def find(db: Database, run: str, step: int | None) -> CheckpointRecord | None:
    """The committed checkpoint ``step`` of ``run`` (None: the latest), or None."""
    query = _info_query().where(Run.name == run)
    query = (
        query.order_by(Checkpoint.step.desc()).limit(1)
        if step is None
        else query.where(Checkpoint.step == step)
    )
    return _first(db, query)


def get(db: Database, run: str, step: int | None) -> CheckpointRecord:
    """Like :func:`find` but raises RunNotFound / CheckpointNotFound."""
    info = find(db, run, step)
    if info is not None:
        return info
    if not run_exists(db, run):
        raise RunNotFound(f"run {run!r} has no checkpoints")
    what = "no checkpoints" if step is None else f"no checkpoint at step {step}"
    raise CheckpointNotFound(f"run {run!r} has {what}")


def run_exists(db: Database, run: str) -> bool:
    """Whether ``run`` has a committed checkpoint."""
    query = (
        select(func.count())
        .select_from(Checkpoint)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Run.name == run, Checkpoint.status == COMMITTED)
    )
    with db.session() as s:
        return bool(s.scalar(query))


def parent_of(db: Database, run: str, step: int) -> CheckpointRecord | None:
    """The committed checkpoint of ``run`` with the greatest step below ``step``."""
    query = (
        _info_query()
        .where(Run.name == run, Checkpoint.step < step)
        .order_by(Checkpoint.step.desc())
        .limit(1)
    )
    return _first(db, query)


def next_after(db: Database, run: str, step: int) -> CheckpointRecord | None:
    """The committed checkpoint of ``run`` with the smallest step above ``step``."""
    query = (
        _info_query()
        .where(Run.name == run, Checkpoint.step > step)
        .order_by(Checkpoint.step)
        .limit(1)
    )
    return _first(db, query)


def list_checkpoints(db: Database, run: str) -> list[CheckpointRecord]:
    """The run's committed checkpoints by step; RunNotFound if it has none."""
    query = _info_query().where(Run.name == run).order_by(Checkpoint.step)
    with db.session() as s:
        rows = s.execute(query).all()
    if not rows and not run_exists(db, run):
        raise RunNotFound(f"run {run!r} has no checkpoints")
    return [_info(r) for r in rows]


def records_by_id(
    db: Database, ids: Collection[int], *, shared: bool = False
) -> dict[int, CheckpointRecord]:
    """The committed checkpoints ``ids`` (of any run), by id; those not committed are left
    out. A delete's re-base or a re-root reaches checkpoints of other runs (forks). With
    ``shared``, the deleted checkpoints among ``ids`` that keep shared chunks (a blob) too:
    a run's delete re-bases the shared chunks of its forks that rest on it."""
    if not ids:
        return {}
    query = _info_query(committed=not shared).where(Checkpoint.id.in_(sorted(ids)))
    if shared:
        query = query.where(
            or_(
                Checkpoint.status == COMMITTED,
                and_(Checkpoint.status == DELETED, Checkpoint.blob_key != ""),
            )
        )
    with db.session() as s:
        return {r.id: r for r in map(_info, s.execute(query).all())}


def list_runs(db: Database, name: str | None = None) -> list[RunInfo]:
    """Every run with a committed checkpoint (or only run ``name``), by name, its
    checkpoints summed."""
    # the stored bytes include the blobs that deleted checkpoints keep for their shared
    # chunks (docs/lifecycle.md): summed over runs, what the blob store holds
    committed = Checkpoint.status == COMMITTED
    shared = and_(Checkpoint.status == DELETED, Checkpoint.blob_key != "")
    query = (
        select(
            Run.name,
            func.count(case((committed, Checkpoint.id))),
            func.max(case((committed, Checkpoint.step))),
            func.sum(case((committed, Checkpoint.raw_bytes), else_=0)),
            func.sum(Checkpoint.stored_bytes),
            Run.created_at,
        )
        .join(Checkpoint, Checkpoint.run_id == Run.id)
        .where(or_(committed, shared))
        .group_by(Run.id, Run.name, Run.created_at)
        .having(func.count(case((committed, Checkpoint.id))) > 0)
        .order_by(Run.name)
    )
    if name is not None:
        query = query.where(Run.name == name)
    with db.session() as s:
        rows = s.execute(query).all()
    return [
        RunInfo(name, int(n), int(latest), int(raw), int(stored), utc(created))
        for name, n, latest, raw, stored, created in rows
    ]


def to_verify(db: Database, limit: int) -> list[CheckpointRecord]:
    """Committed checkpoints whose client-encoded chunks the verifier has not decoded yet,
    oldest commit first."""
    query = (
        _info_query()
        .where(Checkpoint.verification == PENDING)
        .order_by(Checkpoint.committed_at, Checkpoint.id)
        .limit(limit)
    )
    with db.session() as s:
        return [_info(row) for row in s.execute(query).all()]


def set_verification(db: Database, checkpoint_id: int, state: str) -> bool:
    """Record the verifier's verdict on a PENDING checkpoint; whether it was still there
    (deleted meanwhile: False)."""
    with db.session() as s:
        done = s.execute(
            update(Checkpoint)
            .where(Checkpoint.id == checkpoint_id, Checkpoint.verification == PENDING)
            .values(verification=state)
            .returning(Checkpoint.id)
        ).first()
    return done is not None
