"""Fencing (catalog/locks.py): a commit under a run lock checks, in its own transaction, that
its lease still holds the lock; one whose lock was lost (taken over by another writer)
commits nothing and says why (LockLost, a 503). On both backends; PostgreSQL's leases
(renewed, taken over once expired, surviving the loss of every connection) below."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import create_engine, text

from ckptstore_core.errors import LockLost
from ckptstore_service.catalog import Catalog, Lease, NewChunk, TensorInfo


def _commit(cat: Catalog, run: str, step: int, lease: Lease | None) -> Callable[[], None]:
    """Begin an upload of ``run/step``; returns its commit, fenced by ``lease``."""
    ck = cat.begin_upload(cat.ensure_run(run), step, f"runs/{run}/{step}.blob")

    def commit() -> None:
        cat.commit_upload(
            ck,
            parent_id=None,
            keyframe=True,
            chain_depth=0,
            since_keyframe=0,
            raw_bytes=100,
            stored_bytes=40,
            metadata={"format": "ckptstore/1"},
            tensors=[TensorInfo(0, "w", "F32", (5, 5), 0, 100, b"\1" * 16)],
            chunks=[NewChunk(0, 0, 100, 4, "none/1|planes4/1|zstd/1", None, 0, 0, 40, b"\2" * 16)],
            fence=lease,
        )

    return commit


def _take_over(cat: Catalog, lease: Lease) -> None:
    """What another writer taking the lock over does to its row: a new token."""
    with cat.engine.begin() as conn:
        conn.execute(
            text("UPDATE run_locks SET token = token + 1 WHERE purpose = :p AND name = :n"),
            {"p": lease.purpose.value, "n": lease.name},
        )


def test_a_commit_under_a_held_lock_goes_through(catalog: Catalog) -> None:
    with catalog.run_lock("r") as lease:
        assert lease is not None and lease.fenced
        _commit(catalog, "r", 1, lease)()
    assert catalog.get("r", 1).step == 1


def test_a_commit_whose_lock_was_taken_over_is_refused(catalog: Catalog) -> None:
    with catalog.run_lock("r") as lease:
        assert lease is not None
        commit = _commit(catalog, "r", 1, lease)
        _take_over(catalog, lease)
        with pytest.raises(LockLost, match="lock of 'r' was lost"):
            commit()
    assert catalog.find("r", 1) is None  # nothing of it visible
    assert [r for _, r, *_ in catalog.uploads_in_progress()] == ["r"]  # its row: for the abort


def test_a_lease_is_not_a_fence_for_another_run(catalog: Catalog) -> None:
    with catalog.run_lock("a") as a, catalog.run_lock("b"):
        assert a is not None
        _take_over(catalog, a)
        with pytest.raises(LockLost):
            _commit(catalog, "b", 1, a)()  # a's lease fences a's commits only: refused


@pytest.fixture
def pg_catalogs(pg_url: str) -> Iterator[tuple[Catalog, Catalog]]:
    """Two replicas' catalogs on one PostgreSQL database: a long lease (no renewal during a
    test unless it asks for one) and a short one."""
    a, b = Catalog(pg_url, lease_s=60), Catalog(pg_url, lease_s=1)
    a.upgrade()
    yield a, b
    a.close()
    b.close()


@pytest.mark.postgres
def test_a_lease_survives_the_loss_of_every_connection(
    pg_catalogs: tuple[Catalog, Catalog], pg_url: str
) -> None:
    """What a PostgreSQL restart does to sessions (pg_terminate_backend): a session
    advisory lock died with its session, and a second writer went ahead. A lease is a row:
    still held, and its commit goes through on a new connection."""
    a, b = pg_catalogs
    with a.run_lock("r") as lease:
        commit = _commit(a, "r", 1, lease)
        admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            killed = conn.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
        admin.dispose()
        assert killed >= 1
        with b.run_lock("r", blocking=False) as other:
            assert other is None  # still held
        commit()
    assert a.get("r", 1).step == 1


@pytest.mark.postgres
def test_a_lease_is_renewed_and_an_expired_one_taken_over(
    pg_catalogs: tuple[Catalog, Catalog],
) -> None:
    a, b = pg_catalogs
    with b.run_lock("short") as held:  # 1 s lease, renewed every 1/3 s
        time.sleep(2.5)
        with a.run_lock("short", blocking=False) as other:
            assert held is not None and other is None
    with a.run_lock("r") as lease:
        assert lease is not None
        commit = _commit(a, "r", 1, lease)
        with a.engine.begin() as conn:  # a's lease runs out (as if a could not renew it)
            conn.execute(text("UPDATE run_locks SET expires_at = now() - interval '1 second'"))
        with b.run_lock("r", blocking=False) as taken:
            assert taken is not None  # taken over
            a._locks.renew()  # type: ignore[attr-defined]  # a's heartbeat finds out
            assert lease.lost is not None and "took it over" in lease.lost
            with pytest.raises(LockLost, match="took it over"):
                commit()
            _commit(b, "r", 1, taken)()  # the new holder commits
    assert a.get("r", 1).step == 1


@pytest.mark.postgres
def test_a_replica_releases_the_locks_it_died_holding(pg_url: str) -> None:
    dead = Catalog(pg_url, holder="replica-1", lease_s=60)
    dead.upgrade()
    held = dead.run_lock("r")
    held.__enter__()  # and never left: the process "dies" holding it
    dead._locks._stop.set()  # type: ignore[attr-defined]  # no heartbeat any more
    other = Catalog(pg_url, lease_s=60)
    with other.run_lock("r", blocking=False) as taken:
        assert taken is None
    restarted = Catalog(pg_url, holder="replica-1", lease_s=60)
    assert restarted.release_own_locks() == 1
    with other.run_lock("r", blocking=False) as taken:
        assert taken is not None
    for cat in (dead, other, restarted):
        cat.close()
