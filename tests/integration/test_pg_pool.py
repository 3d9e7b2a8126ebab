"""PostgreSQL: uploads in progress must not starve the service (or the server) of database
connections.

Each upload holds its run's lock for its whole duration. When those were session advisory
locks, each held a connection: from the catalog's pool (10 + 20 overflow), 30 uploads in
progress took every connection and every other request failed with a 500; on connections of
their own, ~100 slow uploads across two replicas took the server's max_connections, and every
save failed ("too many clients already"). A lock is now a row with a lease (catalog/locks.py):
an upload holds no connection while it waits on the network.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest
import torch

from ckptstore import CheckpointClient
from ckptstore_core.wire import FORMAT, encode_header
from support.bodies import partial_upload
from support.serviceproc import Service
from support.waiting import wait_until

pytestmark = pytest.mark.postgres

HELD = 32  # more uploads in progress than the catalog's pool has connections (30)


def _held_locks(pg_url: str) -> int:
    """Run locks held now (rows of run_locks)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM run_locks")).scalar_one())
    finally:
        engine.dispose()


def _connections(pg_url: str) -> int:
    """Connections open to the test's database (its own database: the service's, and the
    one asking)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
                ).scalar_one()
            )
    finally:
        engine.dispose()


#: every upload slot open to one address (CKPTSTORE_MAX_UPLOADS_PER_CLIENT, default half of
#: them): these tests' clients stand for many, from the one address a test has
ONE_ADDRESS_MANY_CLIENTS = {"CKPTSTORE_MAX_UPLOADS_PER_CLIENT": "64"}


@pytest.mark.timing
def test_uploads_in_progress_do_not_starve_other_requests(
    make_service: Callable[..., Service], pg_url: str
) -> None:
    # the held uploads stand for many clients: all of them come from one address here
    svc = make_service({"CKPTSTORE_DATABASE_URL": pg_url, **ONE_ADDRESS_MANY_CLIENTS})
    prefix, header = encode_header([("w", "F32", (1 << 20,))], {"format": FORMAT})
    socks: list[socket.socket] = []
    try:
        for i in range(HELD):
            socks.append(
                partial_upload(svc.url, f"held-{i}", 1, prefix + b"\0" * 64, header.total_len)
            )
        wait_until(lambda: _held_locks(pg_url) >= HELD, what=f"{HELD} run locks held", interval=0.1)
        assert _held_locks(pg_url) == HELD  # every upload holds its run's lock
        # and no connection for it once its first queries are done: at most the pool's
        # idle ones (10) and this one (with a connection per lock: 32 + the pool's)
        wait_until(lambda: _connections(pg_url) <= 11, 20, "connections back to the pool")

        t0 = time.perf_counter()
        assert httpx.get(f"{svc.url}/healthz", timeout=60).status_code == 200
        assert httpx.get(f"{svc.url}/v1/runs", timeout=60).status_code == 200
        with CheckpointClient(svc.url, retries=0) as client:
            info = client.save("free", 1, {"w": torch.arange(1000.0)})
            assert info.step == 1
            assert torch.equal(client.load("free")["w"], torch.arange(1000.0))
        assert time.perf_counter() - t0 < 15
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: _held_locks(pg_url) == 0, what="every run lock released", interval=0.1)
    assert _held_locks(pg_url) == 0  # the abandoned uploads released their locks
    assert svc.healthy()


@pytest.mark.slow
def test_many_concurrent_saves_of_different_runs(
    make_service: Callable[..., Service], pg_url: str
) -> None:
    """40 ranks save their shards at once through one replica: none fails."""
    svc = make_service({"CKPTSTORE_DATABASE_URL": pg_url, **ONE_ADDRESS_MANY_CLIENTS})
    n = 40

    def save(i: int) -> int:
        with CheckpointClient(svc.url, retries=0) as client:
            return client.save(f"rank-{i}", 7, {"w": torch.full((256, 1024), float(i))}).step

    with ThreadPoolExecutor(n) as pool:
        assert list(pool.map(save, range(n))) == [7] * n
    runs = httpx.get(f"{svc.url}/v1/runs", timeout=60).json()["runs"]
    assert sorted(r["name"] for r in runs) == sorted(f"rank-{i}" for i in range(n))


LIMIT = 6  # connections the service's role may open


@pytest.fixture
def limited_url(pg_url: str) -> Iterator[str]:
    """``pg_url`` as a role of its own, the database's owner, that may open ``LIMIT``
    connections (the tests' superuser has no such limit)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    role = f"ckpt_limited_{uuid.uuid4().hex[:8]}"
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT {LIMIT}'))
        conn.execute(text(f'ALTER DATABASE "{url.database}" OWNER TO "{role}"'))
        conn.execute(text(f'ALTER SCHEMA public OWNER TO "{role}"'))
    yield url.set(username=role).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(
            text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"),
            {"r": role},
        )
        conn.execute(text(f'REASSIGN OWNED BY "{role}" TO CURRENT_USER'))
        conn.execute(text(f'DROP OWNED BY "{role}"'))
        conn.execute(text(f'DROP ROLE "{role}"'))
    admin.dispose()


def _take_every_connection(url: str) -> list[psycopg.Connection]:
    """Connections of ``url``'s role until the server refuses more ("too many connections
    for role"), the service's own connections killed (as a restart or a neighbour's burst
    would leave it): the service can open none."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    conninfo = f"host={u.host} port={u.port} user={u.username} dbname={u.database}"
    hogs: list[psycopg.Connection] = []
    for _ in range(20):
        try:
            hogs.append(psycopg.connect(conninfo, autocommit=True))
            continue
        except psycopg.OperationalError as exc:
            assert "too many connections" in str(exc), exc
        others = (
            hogs[0]
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE usename = current_user AND NOT pid = ANY(%s)",
                ([h.info.backend_pid for h in hogs],),
            )
            .fetchall()
        )
        if not others:
            return hogs
    raise AssertionError("the service kept its connections")


def test_a_database_out_of_connections_is_a_503_the_client_retries(
    make_service: Callable[..., Service], limited_url: str
) -> None:
    """A server refusing connections ("too many clients already", here its per-role form)
    was a 500 internal_error that the client did not retry: it is a 503
    storage_unavailable, retried until the server has room again; nothing half-saved."""
    svc = make_service({"CKPTSTORE_DATABASE_URL": limited_url})
    w = torch.arange(4096.0)
    hogs = _take_every_connection(limited_url)
    saved: list[int] = []
    try:
        answer = httpx.get(f"{svc.url}/v1/runs", timeout=60)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "storage_unavailable"

        def save() -> None:
            with CheckpointClient(svc.url, retries=8, backoff=0.3) as client:
                saved.append(client.save("full", 1, {"w": w}).step)

        saver = threading.Thread(target=save)
        saver.start()
        saver.join(1.5)
        assert saver.is_alive() and not saved  # refused, and retried
    finally:
        for hog in hogs:
            hog.close()
    saver.join(60)
    assert saved == [1]
    with CheckpointClient(svc.url) as client:
        assert [c.step for c in client.list("full")] == [1]
        assert torch.equal(client.load("full")["w"], w)
