"""The catalog: the delta chain in SQL (SQLite by default, PostgreSQL in production).

No HTTP and no blob I/O here. Every method opens a short transaction and returns plain frozen
dataclasses, never ORM objects, so callers hold no session across a long upload.

Writers to one run are serialized by :meth:`Catalog.run_lock`, held for a whole upload: on
PostgreSQL a session advisory lock on the run name (replicas sharing the database queue up; the
server releases it if the holder dies), on SQLite an flock beside the database file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Engine,
    bindparam,
    create_engine,
    delete,
    event,
    func,
    insert,
    make_url,
    select,
    text,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session, aliased, sessionmaker
from sqlalchemy.pool import NullPool

from ckptstore_core.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CorruptData,
    RunNotFound,
    StorageUnavailable,
)
from ckptstore_core.records import CheckpointInfo, RunInfo
from ckptstore_service.catalog.models import (
    COMMITTED,
    WRITING,
    Base,
    Checkpoint,
    Chunk,
    Garbage,
    Run,
    TensorRow,
)

__all__ = [
    "Catalog",
    "CheckpointRecord",
    "ChunkInfo",
    "NewChunk",
    "RunInfo",
    "TensorInfo",
    "shown_url",
]


@dataclass(frozen=True, slots=True)
class CheckpointRecord(CheckpointInfo):
    """A committed checkpoint as listed, with what only the service needs of it."""

    id: int
    since_keyframe: int
    blob_key: str
    metadata: dict[str, str]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    idx: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int
    checksum: bytes


@dataclass(frozen=True, slots=True)
class NewChunk:
    tensor_idx: int
    offset: int
    raw_len: int
    itemsize: int
    codec: str
    base_id: int | None
    depth: int
    blob_offset: int
    stored_len: int
    checksum: bytes


@dataclass(frozen=True, slots=True)
class ChunkInfo(NewChunk):
    id: int
    blob_key: str  # of its checkpoint
    checkpoint_id: int


def shown_url(url: str) -> str:
    """``url`` as it may be shown in an error: without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # a URL SQLAlchemy cannot parse holds no password it could hide
        return url.split("@")[-1] if "@" in url else url


def _utc(value: datetime) -> datetime:
    # SQLite hands back naive datetimes even for timezone-aware columns.
    return value if value.tzinfo else value.replace(tzinfo=UTC)


class Catalog:
    def __init__(self, url: str) -> None:
        self.url = url
        self.is_postgres = url.startswith("postgresql")
        kwargs: dict[str, Any] = {"pool_pre_ping": True}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 60}
        else:
            kwargs.update(pool_size=10, max_overflow=20)
        try:
            self.engine: Engine = create_engine(url, **kwargs)
        except Exception as exc:  # a bad URL or a missing driver
            raise ValueError(f"cannot use database URL {shown_url(url)!r}: {exc}") from exc
        # Run locks live on connections of their own, outside the pool: an upload holds its
        # lock for its whole duration (and a writer waiting for a run's lock holds a
        # connection while it waits), so from the pool, 30 uploads in progress would take
        # every connection and leave their own queries, and every other request, waiting.
        self._lock_engine: Engine | None = (
            create_engine(url, poolclass=NullPool) if self.is_postgres else None
        )
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._locks: dict[str, threading.Lock] = {}
        database = make_url(url).database if url.startswith("sqlite") else None
        #: the SQLite file, None for PostgreSQL or an in-memory database
        self.sqlite_file = Path(database) if database and database != ":memory:" else None
        self._lock_dir = None if self.sqlite_file is None else Path(f"{self.sqlite_file}.locks")
        self._locks_guard = threading.Lock()

    def close(self) -> None:
        self.engine.dispose()
        if self._lock_engine is not None:
            self._lock_engine.dispose()

    def ping(self) -> None:
        with self._session() as s:
            s.execute(text("SELECT 1"))

    def upgrade(self) -> None:
        """Bring the schema to the newest Alembic revision (idempotent).

        On PostgreSQL an advisory lock keeps replicas that start together from migrating
        at the same time.
        """
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
        with self._translate(), self.engine.begin() as conn:
            if self.is_postgres:
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
            config.attributes["connection"] = conn
            command.upgrade(config, "head")

    def revision(self) -> str | None:
        """The schema's current Alembic revision (None before the first upgrade)."""
        from alembic.runtime.migration import MigrationContext

        with self._translate(), self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    # -- sessions and locks --------------------------------------------------------------

    @contextlib.contextmanager
    def _translate(self) -> Iterator[None]:
        try:
            yield
        except IntegrityError:
            raise
        except DBAPIError as exc:
            if exc.connection_invalidated or _is_connection_error(exc):
                raise StorageUnavailable(f"database unavailable: {exc.orig}") from exc
            raise

    @contextlib.contextmanager
    def _session(self) -> Iterator[Session]:
        with self._translate(), self._sessions.begin() as session:
            yield session

    def _local_lock(self, run: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(run, threading.Lock())

    @contextlib.contextmanager
    def run_lock(self, run: str, *, blocking: bool = True) -> Iterator[bool]:
        """Serialize writers of ``run``: threads, processes and replicas.

        PostgreSQL: a session advisory lock on the run (released by the server if the holder
        dies). SQLite file: an flock on a file beside the database. In-memory SQLite: a
        thread lock. Yields True when held; with ``blocking=False`` yields False at once
        instead of waiting when another writer holds it.
        """
        if self.is_postgres:
            with self._pg_lock(run, blocking) as held:
                yield held
        elif self._lock_dir is not None:
            with self._file_lock(run, blocking) as held:
                yield held
        else:
            local = self._local_lock(run)
            held = local.acquire(blocking=blocking)
            try:
                yield held
            finally:
                if held:
                    local.release()

    @contextlib.contextmanager
    def _pg_lock(self, run: str, blocking: bool) -> Iterator[bool]:
        key = int.from_bytes(
            hashlib.blake2b(run.encode(), digest_size=8).digest(), "big", signed=True
        )
        fn = "pg_advisory_lock" if blocking else "pg_try_advisory_lock"
        assert self._lock_engine is not None
        with self._translate(), self._lock_engine.connect() as conn:
            got = conn.execute(text(f"SELECT {fn}(:k)"), {"k": key}).scalar()
            held = blocking or bool(got)
            conn.commit()
            try:
                yield held
            finally:
                if held:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                    conn.commit()

    @contextlib.contextmanager
    def _file_lock(self, run: str, blocking: bool) -> Iterator[bool]:
        assert self._lock_dir is not None
        self._lock_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock_dir / f"{run}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                held = True
            except BlockingIOError:
                held = False
            yield held
        finally:
            os.close(fd)  # releases the flock

    # -- runs and checkpoints ------------------------------------------------------------

    def ensure_run(self, name: str) -> int:
        with self._session() as s:
            run_id = s.scalar(select(Run.id).where(Run.name == name))
            if run_id is not None:
                return run_id
        try:
            with self._session() as s:
                return int(s.execute(insert(Run).values(name=name).returning(Run.id)).scalar_one())
        except IntegrityError:  # another replica created it first
            with self._session() as s:
                return int(s.execute(select(Run.id).where(Run.name == name)).scalar_one())

    def _info_query(self) -> Any:
        parent = aliased(Checkpoint)
        return (
            select(Checkpoint, Run.name, parent.step)
            .join(Run, Run.id == Checkpoint.run_id)
            .outerjoin(parent, parent.id == Checkpoint.parent_id)
            .where(Checkpoint.status == COMMITTED)
        )

    @staticmethod
    def _info(row: Any) -> CheckpointRecord:
        ck, run, parent_step = row
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
            metadata=json.loads(ck.metadata_json),
            created=_utc(ck.created_at),
        )

    def find(self, run: str, step: int | None) -> CheckpointRecord | None:
        """The committed checkpoint ``step`` of ``run`` (None: the latest), or None."""
        query = self._info_query().where(Run.name == run)
        query = (
            query.order_by(Checkpoint.step.desc()).limit(1)
            if step is None
            else query.where(Checkpoint.step == step)
        )
        with self._session() as s:
            row = s.execute(query).first()
        return None if row is None else self._info(row)

    def get(self, run: str, step: int | None) -> CheckpointRecord:
        """Like :meth:`find` but raises RunNotFound / CheckpointNotFound."""
        info = self.find(run, step)
        if info is not None:
            return info
        if not self.run_exists(run):
            raise RunNotFound(f"run {run!r} has no checkpoints")
        what = "no checkpoints" if step is None else f"no checkpoint at step {step}"
        raise CheckpointNotFound(f"run {run!r} has {what}")

    def run_exists(self, run: str) -> bool:
        query = (
            select(func.count())
            .select_from(Checkpoint)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Run.name == run, Checkpoint.status == COMMITTED)
        )
        with self._session() as s:
            return bool(s.scalar(query))

    def parent_of(self, run: str, step: int) -> CheckpointRecord | None:
        """The committed checkpoint of ``run`` with the greatest step below ``step``."""
        query = (
            self._info_query()
            .where(Run.name == run, Checkpoint.step < step)
            .order_by(Checkpoint.step.desc())
            .limit(1)
        )
        with self._session() as s:
            row = s.execute(query).first()
        return None if row is None else self._info(row)

    def list_checkpoints(self, run: str) -> list[CheckpointRecord]:
        query = self._info_query().where(Run.name == run).order_by(Checkpoint.step)
        with self._session() as s:
            rows = s.execute(query).all()
        if not rows and not self.run_exists(run):
            raise RunNotFound(f"run {run!r} has no checkpoints")
        return [self._info(r) for r in rows]

    def list_runs(self) -> list[RunInfo]:
        query = (
            select(
                Run.name,
                func.count(Checkpoint.id),
                func.max(Checkpoint.step),
                func.sum(Checkpoint.raw_bytes),
                func.sum(Checkpoint.stored_bytes),
                Run.created_at,
            )
            .join(Checkpoint, Checkpoint.run_id == Run.id)
            .where(Checkpoint.status == COMMITTED)
            .group_by(Run.id, Run.name, Run.created_at)
            .order_by(Run.name)
        )
        with self._session() as s:
            rows = s.execute(query).all()
        return [
            RunInfo(name, int(n), int(latest), int(raw), int(stored), _utc(created))
            for name, n, latest, raw, stored, created in rows
        ]

    # -- the upload protocol: begin (writing) -> commit | abort ---------------------------

    def begin_upload(self, run_id: int, step: int, blob_key: str) -> int:
        """Record an upload in progress; its row names the blob for garbage collection."""
        with self._session() as s:
            return int(
                s.execute(
                    insert(Checkpoint)
                    .values(run_id=run_id, step=step, status=WRITING, blob_key=blob_key)
                    .returning(Checkpoint.id)
                ).scalar_one()
            )

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
    ) -> None:
        """Make the checkpoint visible: one transaction, after all its bytes are durable.

        ``sibling_bases`` maps the position of a chunk in ``chunks`` to the position of its
        base when that base is a chunk of this same checkpoint (a bf16 copy predicted from its
        fp32 master): those get their ``base_id`` once the others have ids.
        """
        siblings = dict(sibling_bases or {})
        tensor_rows = [
            {
                "checkpoint_id": checkpoint_id,
                "idx": t.idx,
                "name": t.name,
                "dtype": t.dtype,
                "shape": json.dumps(list(t.shape)),
                "begin": t.begin,
                "nbytes": t.nbytes,
                "checksum": t.checksum,
            }
            for t in tensors
        ]
        chunk_rows = [
            {"checkpoint_id": checkpoint_id, **{f: getattr(c, f) for f in NewChunk.__slots__}}
            for c in chunks
        ]
        first = [i for i in range(len(chunk_rows)) if i not in siblings]
        # Core inserts of the tables: the ORM's bulk path costs ~5x the CPU per row.
        tensor_table = Base.metadata.tables[TensorRow.__tablename__]
        chunk_table = Base.metadata.tables[Chunk.__tablename__]
        try:
            with self._session() as s:
                if tensor_rows:
                    s.execute(insert(tensor_table), tensor_rows)
                if first and not siblings:
                    s.execute(insert(chunk_table), chunk_rows)
                elif first:
                    ids = s.scalars(
                        insert(chunk_table).returning(
                            chunk_table.c.id, sort_by_parameter_order=True
                        ),
                        [chunk_rows[i] for i in first],
                    ).all()
                    id_of = dict(zip(first, ids, strict=True))
                    for i, base in siblings.items():
                        chunk_rows[i]["base_id"] = id_of[base]
                    s.execute(insert(chunk_table), [chunk_rows[i] for i in siblings])
                s.execute(
                    update(Checkpoint)
                    .where(Checkpoint.id == checkpoint_id)
                    .values(
                        status=COMMITTED,
                        parent_id=parent_id,
                        keyframe=keyframe,
                        chain_depth=chain_depth,
                        since_keyframe=since_keyframe,
                        raw_bytes=raw_bytes,
                        stored_bytes=stored_bytes,
                        n_tensors=len(tensor_rows),
                        metadata_json=json.dumps(metadata),
                        committed_at=datetime.now(UTC),
                    )
                )
        except IntegrityError as exc:
            raise CheckpointExists(
                f"checkpoint {checkpoint_id} was committed concurrently"
            ) from exc

    def abort_upload(self, checkpoint_id: int) -> None:
        with self._session() as s:
            s.execute(
                delete(Checkpoint).where(
                    Checkpoint.id == checkpoint_id, Checkpoint.status == WRITING
                )
            )

    def uploads_in_progress(self) -> list[tuple[int, str, str, datetime]]:
        """``(checkpoint_id, run, blob_key, created_at)`` of every ``writing`` row."""
        query = (
            select(Checkpoint.id, Run.name, Checkpoint.blob_key, Checkpoint.created_at)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Checkpoint.status == WRITING)
        )
        with self._session() as s:
            return [(i, r, k, _utc(c)) for i, r, k, c in s.execute(query).all()]

    # -- tensors and chunks ---------------------------------------------------------------

    def tensors(self, checkpoint_id: int) -> list[TensorInfo]:
        # Core rows, not ORM entities: a checkpoint has hundreds to thousands of these and
        # building ORM instances for them cost more than the query.
        query = (
            select(
                TensorRow.idx,
                TensorRow.name,
                TensorRow.dtype,
                TensorRow.shape,
                TensorRow.begin,
                TensorRow.nbytes,
                TensorRow.checksum,
            )
            .where(TensorRow.checkpoint_id == checkpoint_id)
            .order_by(TensorRow.idx)
        )
        with self._session() as s:
            rows = s.execute(query).all()
        return [
            TensorInfo(idx, name, dtype, tuple(json.loads(shape)), begin, nbytes, digest)
            for idx, name, dtype, shape, begin, nbytes, digest in rows
        ]

    _CHUNK_COLUMNS = (*NewChunk.__slots__, "id")

    def _chunk_query(self) -> Any:
        return select(
            *(getattr(Chunk, name) for name in self._CHUNK_COLUMNS),
            Checkpoint.blob_key,
            Chunk.checkpoint_id,
        ).join(Checkpoint, Checkpoint.id == Chunk.checkpoint_id)

    @classmethod
    def _chunk(cls, row: Any) -> ChunkInfo:
        return ChunkInfo(*row)

    def chunks(self, checkpoint_id: int) -> list[ChunkInfo]:
        query = (
            self._chunk_query()
            .where(Chunk.checkpoint_id == checkpoint_id)
            .order_by(Chunk.tensor_idx, Chunk.offset)
        )
        with self._session() as s:
            return [self._chunk(r) for r in s.execute(query).all()]

    def chunk_tree(self, checkpoint_id: int) -> tuple[list[ChunkInfo], dict[int, ChunkInfo]]:
        """The checkpoint's chunks (in tensor and offset order) and, by id, those chunks plus
        every chunk their chains reach.

        One statement (one recursive query, so one snapshot on SQLite and on PostgreSQL alike):
        a re-root rewrites the chains of committed chunks (codec, base, blob), and reads on
        either side of its commit would mix the old shape and the new one. A chain 8 deep
        also took 8 round trips link by link, 20-35 ms of a cold restore's first byte.
        """
        seed = select(Chunk.id, Chunk.base_id).where(Chunk.checkpoint_id == checkpoint_id)
        reach = seed.cte("reach", recursive=True)
        reach = reach.union(
            select(Chunk.id, Chunk.base_id).join(reach, Chunk.id == reach.c.base_id)
        )
        query = self._chunk_query().where(Chunk.id.in_(select(reach.c.id)))
        with self._session() as s:
            known = {c.id: c for c in map(self._chunk, s.execute(query).all())}
        own = [c for c in known.values() if c.checkpoint_id == checkpoint_id]
        lost = {c.base_id for c in known.values() if c.base_id is not None} - known.keys()
        if lost:
            raise CorruptData(
                f"the catalog's chunks name base chunks it has not: {sorted(lost)[:5]}"
            )
        own.sort(key=lambda c: (c.tensor_idx, c.offset))
        return own, known

    def descendants(self, ids: Collection[int]) -> list[ChunkInfo]:
        """Every chunk whose chain passes through one of the chunks ``ids`` (a delta, ref or
        copy of one of them, or of such a chunk, and so on), not those chunks themselves."""
        found: dict[int, ChunkInfo] = {}
        ordered = sorted(ids)
        with self._session() as s:
            for i in range(0, len(ordered), 500):
                seed = select(Chunk.id).where(Chunk.base_id.in_(ordered[i : i + 500]))
                reach = seed.cte("down", recursive=True)
                reach = reach.union(select(Chunk.id).join(reach, Chunk.base_id == reach.c.id))
                query = self._chunk_query().where(Chunk.id.in_(select(reach.c.id)))
                found.update((c.id, c) for c in map(self._chunk, s.execute(query).all()))
        return [c for c in found.values() if c.id not in ids]

    # -- re-rooting and garbage -------------------------------------------------------------

    def add_garbage(self, run: str, keys: Iterable[str], not_before: datetime) -> list[int]:
        """Name blobs to delete once ``not_before`` has passed; returns the rows' ids."""
        run_id = self.ensure_run(run)
        rows = [{"run_id": run_id, "blob_key": k, "not_before": not_before} for k in keys]
        if not rows:
            return []
        with self._session() as s:
            return list(
                s.scalars(
                    insert(Garbage).returning(Garbage.id, sort_by_parameter_order=True), rows
                ).all()
            )

    def garbage(self, run: str | None, now: datetime) -> list[tuple[int, str, str]]:
        """``(id, run, blob_key)`` of the blobs due for deletion (of one run, or of all)."""
        query = (
            select(Garbage.id, Run.name, Garbage.blob_key)
            .join(Run, Run.id == Garbage.run_id)
            .where(Garbage.not_before <= now)
            .order_by(Garbage.id)
        )
        if run is not None:
            query = query.where(Run.name == run)
        with self._session() as s:
            return [(i, r, k) for i, r, k in s.execute(query).all()]

    def drop_garbage(self, garbage_id: int) -> None:
        with self._session() as s:
            s.execute(delete(Garbage).where(Garbage.id == garbage_id))

    def blob_in_use(self, key: str) -> bool:
        """Whether any checkpoint row (committed or being written) names blob ``key``."""
        with self._session() as s:
            return bool(s.scalar(select(func.count()).where(Checkpoint.blob_key == key)))

    def forget_garbage(self, key: str) -> None:
        """Take blob ``key`` off the table (it was deleted by the one that wrote it)."""
        with self._session() as s:
            s.execute(delete(Garbage).where(Garbage.blob_key == key))

    def commit_reroot(
        self,
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
        run_id = self.ensure_run(run)
        table = Base.metadata.tables[Chunk.__tablename__]
        fields = ("codec", "base_id", "depth", "blob_offset", "stored_len")
        with self._session() as s:
            for ck in checkpoints:
                current = s.scalar(select(Checkpoint.blob_key).where(Checkpoint.id == ck["id"]))
                if current != ck["old_blob_key"]:
                    raise CorruptData(f"checkpoint {ck['id']} changed during its re-root")
            if chunks:
                s.execute(
                    update(table)
                    .where(table.c.id == bindparam("b_id"))
                    .values({f: bindparam(f"b_{f}") for f in fields}),
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

    def warm_up(self) -> None:
        """Run the load path's queries once on ids that do not exist: SQLAlchemy compiles a
        statement on its first use (measured: a cold restore's catalog reads took 29-41 ms
        against 12-15 ms warm), so the first resume after a start-up does not pay for that."""
        self.find("", None)
        self.find("", 0)
        self.parent_of("", 0)
        self.tensors(-1)
        self.chunk_tree(-1)


_MIGRATION_LOCK = 0x636B7074  # "ckpt"


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=60000")
    cur.close()


def _is_connection_error(exc: DBAPIError) -> bool:
    text_ = str(exc.orig).lower()
    return any(
        s in text_ for s in ("connection refused", "could not connect", "server closed", "timeout")
    )
