"""PostgreSQL: uploads in progress must not starve the service of database connections.

Each upload holds its run's advisory lock for its whole duration, on a connection of its own.
When those connections came from the catalog's pool (10 + 20 overflow), 30 uploads in
progress (30 ranks saving their shards through one replica, or 30 slow clients) took every
connection: each upload's next query, and every other request of the replica (healthz, list,
load), waited the pool's 30 s timeout and failed with a 500 internal_error.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
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
    from sqlalchemy import create_engine, text

    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                        " AND database = (SELECT oid FROM pg_database"
                        " WHERE datname = current_database())"
                    )
                ).scalar_one()
            )
    finally:
        engine.dispose()


def test_uploads_in_progress_do_not_starve_other_requests(
    make_service: Callable[..., Service], pg_url: str
) -> None:
    svc = make_service({"CKPTSTORE_DATABASE_URL": pg_url})
    prefix, header = encode_header([("w", "F32", (1 << 20,))], {"format": FORMAT})
    socks: list[socket.socket] = []
    try:
        for i in range(HELD):
            socks.append(
                partial_upload(svc.url, f"held-{i}", 1, prefix + b"\0" * 64, header.total_len)
            )
        wait_until(lambda: _held_locks(pg_url) >= HELD, what=f"{HELD} run locks held", interval=0.1)
        assert _held_locks(pg_url) == HELD  # every upload holds its run's lock

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
    svc = make_service({"CKPTSTORE_DATABASE_URL": pg_url})
    n = 40

    def save(i: int) -> int:
        with CheckpointClient(svc.url, retries=0) as client:
            return client.save(f"rank-{i}", 7, {"w": torch.full((256, 1024), float(i))}).step

    with ThreadPoolExecutor(n) as pool:
        assert list(pool.map(save, range(n))) == [7] * n
    runs = httpx.get(f"{svc.url}/v1/runs", timeout=60).json()["runs"]
    assert sorted(r["name"] for r in runs) == sorted(f"rank-{i}" for i in range(n))
