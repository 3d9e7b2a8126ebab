"""A PostgreSQL restart in the middle of a save, with two replicas (issue 21, item 3).

When run locks were session advisory locks, every connection's loss (what a database restart
does) silently dropped them: a second save to the same run then ran concurrently, a replica
started afterwards "collected" another replica's live upload as crashed, and a save that did
commit was reported as a 503. Locks are now leased rows with fencing tokens
(``catalog/locks.py``): here every connection of the service to the database is killed
(``pg_terminate_backend``, as a restart does) while replica A holds a run's lock mid-upload;
replica B then starts (its start-up collection runs) and a second writer asks B to save to
the same run. Guarantees checked: B's collector leaves A's live upload alone, the second
writer waits for A's lock (never two writers in one run), A's upload commits (201, its lease
survived), the second save then commits on top of it, and both load exactly through B.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from sqlalchemy import create_engine, text

from ckptstore import CheckpointClient
from ckptstore_core.wire import encode_header
from ckptstore_service.catalog import Catalog
from support.bodies import meta_for, partial_upload, read_response
from support.serviceproc import Service
from support.waiting import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

N = 1 << 16  # floats of the tensor the upload sends


def _sql(pg_url: str, query: str) -> list[tuple[object, ...]]:
    engine = create_engine(pg_url)
    try:
        with engine.begin() as conn:
            return [tuple(r) for r in conn.execute(text(query))]
    finally:
        engine.dispose()


def _uploading(pg_url: str) -> list[str]:
    """The runs with a ``writing`` checkpoint row: uploads begun and not ended."""
    catalog = Catalog(pg_url)
    try:
        return [run for _, run, *_ in catalog.uploads_in_progress()]
    finally:
        catalog.close()


def test_a_database_restart_mid_save_lets_no_second_writer_in_and_no_collection(
    make_service: Callable[..., Service], pg_url: str, tmp_path: Path
) -> None:
    env = {
        "CKPTSTORE_DATABASE_URL": pg_url,
        "CKPTSTORE_BLOB_URL": (tmp_path / "shared" / "blobs").as_uri(),
        "CKPTSTORE_UPLOAD_IDLE_TIMEOUT_S": "60",
        "CKPTSTORE_LOCK_LEASE_S": "3",  # renewed every second: it must survive the kill
    }
    a = make_service(env=env)
    w1 = np.arange(N, dtype=np.float32)
    prefix, _ = encode_header([("w", "F32", (N,))], meta_for("w"))
    body = prefix + w1.tobytes()
    half = len(prefix) + len(w1.tobytes()) // 2
    sock = partial_upload(a.url, "r", 1, body[:half], len(body), timeout=60)
    try:
        # the lock comes first, then the ``writing`` row: both must exist before the "restart"
        wait_until(
            lambda: (
                _sql(pg_url, "SELECT count(*) FROM run_locks")[0][0] == 1
                and _uploading(pg_url) == ["r"]
            ),
            20,
        )
        killed = _sql(
            pg_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        assert killed  # the service's connections: a database restart, as A sees it
        b = make_service(env=env)  # its start-up collection runs now
        assert _uploading(pg_url) == ["r"]  # A's upload: not taken

        second: list[object] = []
        w2 = torch.full((N,), 2.0)

        def save_through_b() -> None:
            with CheckpointClient(b.url, retries=0) as client:
                second.append(client.save("r", 2, {"w": w2}))

        saver = threading.Thread(target=save_through_b)
        saver.start()
        saver.join(3.0)
        assert saver.is_alive() and not second  # it waits for A's lock: one writer at once
        sock.sendall(body[half:])
        status, answer = read_response(sock, timeout=60)
    finally:
        sock.close()
    assert status == 201, answer  # A's lease survived the connections' loss: it committed
    saver.join(60)
    assert len(second) == 1
    with CheckpointClient(b.url) as client:
        assert [(c.step, c.parent_step) for c in client.list("r")] == [(1, None), (2, 1)]
        assert torch.equal(client.load("r", 1)["w"], torch.from_numpy(w1))
        assert torch.equal(client.load("r", 2)["w"], w2)
