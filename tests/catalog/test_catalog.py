"""The catalog on both backends: SQLite and the machine's real PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import event
from sqlalchemy.engine.interfaces import CacheStats

from ckptstore_core.errors import CheckpointExists, CheckpointNotFound, RunNotFound
from ckptstore_service.catalog import Catalog, NewChunk, TensorInfo
from ckptstore_service.catalog.models import Base


def commit(cat: Catalog, run: str, step: int, parent_id: int | None = None, **kw: object) -> int:
    run_id = cat.ensure_run(run)
    ck = cat.begin_upload(run_id, step, f"runs/{run}/{step}.blob")
    cat.commit_upload(
        ck,
        parent_id=parent_id,
        keyframe=parent_id is None,
        chain_depth=0,
        since_keyframe=0,
        raw_bytes=100,
        stored_bytes=40,
        metadata={"format": "ckptstore/1"},
        tensors=[TensorInfo(0, "w", "F32", (5, 5), 0, 100, b"\1" * 16)],
        chunks=kw.get("chunks", [])  # type: ignore[arg-type]
        or [NewChunk(0, 0, 100, 4, "none/1|planes4/1|zstd/1", None, 0, 0, 40, b"\2" * 16)],
    )
    return ck


def test_migrations_match_the_models(catalog: Catalog) -> None:
    catalog.upgrade()  # idempotent
    assert catalog.revision() == "0012"
    with catalog.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_upload_protocol(catalog: Catalog) -> None:
    run_id = catalog.ensure_run("r")
    assert catalog.ensure_run("r") == run_id
    writing = catalog.begin_upload(run_id, 5, "runs/r/5.blob")
    # an upload in progress is invisible
    assert catalog.find("r", 5) is None
    assert catalog.list_runs() == []
    with pytest.raises(RunNotFound):
        catalog.get("r", None)
    assert [(i, r) for i, r, *_ in catalog.uploads_in_progress()] == [(writing, "r")]
    catalog.abort_upload(writing)
    assert catalog.uploads_in_progress() == []

    # a dead upload's row does not block the retry of the same step
    catalog.begin_upload(run_id, 5, "runs/r/5-dead.blob")
    first = commit(catalog, "r", 5)
    info = catalog.get("r", 5)
    assert (info.id, info.step, info.parent_step, info.keyframe) == (first, 5, None, True)
    assert catalog.tensors(first)[0].shape == (5, 5)
    assert catalog.chunks(first)[0].blob_key == "runs/r/5.blob"
    # a second commit of the same step loses
    with pytest.raises(CheckpointExists):
        commit(catalog, "r", 5)


def test_parents_latest_and_listing(catalog: Catalog) -> None:
    a = commit(catalog, "run-a", 10)
    b = commit(catalog, "run-a", 20, parent_id=a)
    commit(catalog, "run-b", 1)
    assert catalog.parent_of("run-a", 15).id == a  # type: ignore[union-attr]
    assert catalog.parent_of("run-a", 10) is None
    assert catalog.parent_of("run-a", 10**12).id == b  # type: ignore[union-attr]
    latest = catalog.get("run-a", None)
    assert (latest.step, latest.parent_step) == (20, 10)
    with pytest.raises(CheckpointNotFound):
        catalog.get("run-a", 11)
    assert [c.step for c in catalog.list_checkpoints("run-a")] == [10, 20]
    runs = {r.name: r for r in catalog.list_runs()}
    assert runs["run-a"].checkpoints == 2 and runs["run-a"].latest_step == 20
    assert runs["run-a"].raw_bytes == 200 and runs["run-a"].stored_bytes == 80


def test_chunk_tree_follows_chains(catalog: Catalog) -> None:
    a = commit(catalog, "c", 1)
    (ca,) = catalog.chunks(a)
    delta = NewChunk(0, 0, 100, 4, "sub/1|planes4/1|zstd/1", ca.id, 1, 0, 10, b"\3" * 16)
    b = commit(catalog, "c", 2, parent_id=a, chunks=[delta])
    (cb,) = catalog.chunks(b)
    ref = NewChunk(0, 0, 100, 4, "ref", cb.id, 1, 0, 0, b"\3" * 16)
    c = commit(catalog, "c", 3, parent_id=b, chunks=[ref])
    own, closure = catalog.chunk_tree(c)
    assert own == catalog.chunks(c)
    assert set(closure) == {ca.id, cb.id, catalog.chunks(c)[0].id}


def test_chunk_tree_reaches_the_ends_of_deep_chains_in_one_query(catalog: Catalog) -> None:
    # two tensors' chunks: one chain 9 links deep, one that starts over at step 5; the
    # closure of the last checkpoint holds every link of both, and nothing else
    first = commit(catalog, "deep", 0)
    (start,) = catalog.chunks(first)
    ids, parent, tip = [start.id], first, start.id
    other: list[int] = []
    for step in range(1, 10):
        delta = NewChunk(0, 0, 100, 4, "zsub/1|planes4/1|zstd/1", tip, step, 0, 10, b"\3" * 16)
        if step < 5:
            second = NewChunk(1, 0, 100, 4, "none/1|planes4/1|zstd/1", None, 0, 10, 40, b"\4" * 16)
        else:
            base = other[-1]
            second = NewChunk(1, 0, 100, 4, "xor/1|planes4/1|zstd/1", base, 1, 50, 10, b"\4" * 16)
        parent = commit(catalog, "deep", step, parent_id=parent, chunks=[delta, second])
        tip, top = (c.id for c in catalog.chunks(parent))
        ids.append(tip)
        other.append(top)
    chunks = catalog.chunks(parent)
    statements: list[str] = []
    event.listen(catalog.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    own, closure = catalog.chunk_tree(parent)
    assert own == chunks
    assert sorted(closure) == sorted(ids + other[3:])
    assert len(statements) == 1, statements


def test_warm_up_compiles_every_statement_of_a_restore(database_url: str, catalog: Catalog) -> None:
    first = commit(catalog, "warm", 0)
    (start,) = catalog.chunks(first)
    delta = NewChunk(0, 0, 100, 4, "zsub/1|planes4/1|zstd/1", start.id, 1, 0, 10, b"\3" * 16)
    commit(catalog, "warm", 1, parent_id=first, chunks=[delta])

    def restore_reads(warm: bool) -> list[object]:
        """A fresh catalog (a new engine: nothing compiled) reads what a restore of step 1
        reads; SQLAlchemy's cache verdict on each statement."""
        fresh = Catalog(database_url)
        if warm:
            fresh.warm_up()
        verdicts: list[object] = []
        event.listen(
            fresh.engine, "after_cursor_execute", lambda *a: verdicts.append(a[4].cache_hit)
        )
        info = fresh.get("warm", 1)
        assert len(fresh.tensors(info.id)) == 1
        assert len(fresh.chunk_tree(info.id)[1]) == 2
        fresh.close()
        return verdicts

    assert CacheStats.CACHE_MISS in restore_reads(warm=False)  # the test can tell
    assert set(restore_reads(warm=True)) == {CacheStats.CACHE_HIT}


def test_run_lock_serializes_writers_across_catalogs(database_url: str) -> None:
    """Two Catalog objects stand for two replicas sharing one database."""
    one, two = Catalog(database_url), Catalog(database_url)
    one.upgrade()
    order: list[str] = []
    holding, release, second_done = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with one.run_lock("shared"):
            holding.set()
            release.wait(30)  # holds the lock until the test has seen the second one wait
            order.append("one")

    def second() -> None:
        with two.run_lock("shared"):
            order.append("two")
        second_done.set()

    t = threading.Thread(target=first)
    t.start()
    assert holding.wait(5)
    if one.is_postgres:  # across processes only the database can tell
        with two.run_lock("shared", blocking=False) as held:
            assert not held
        with two.run_lock("other", blocking=False) as held:
            assert held  # another run is not blocked
    u = threading.Thread(target=second)
    u.start()
    # that something does not happen takes a time window: the second writer must not get
    # the lock within 0.5 s while the first one holds it, and gets it once it is released
    assert not second_done.wait(0.5), "two writers held the run's lock at once"
    release.set()
    t.join()
    assert second_done.wait(30)
    u.join()
    assert order == ["one", "two"]
    one.close()
    two.close()
