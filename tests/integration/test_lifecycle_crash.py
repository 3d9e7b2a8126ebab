"""SIGKILL during a garbage collection and during a fork (issue 20, item 6; a delete's
re-base: ``test_delete.py``): after a restart every remaining checkpoint loads bit-exactly,
and after the next collection (grace 0) the blob store holds exactly the blobs the catalog
names, nothing orphaned and nothing missing.

Each test stops the service at the one point that matters, by a condition it can see,
rather than at a time: the collector between deleting a blob and dropping its garbage row
(the test holds the SQLite catalog's write lock, so the row's drop waits); the fork between
its ``writing`` row and its commit (the S3 server is frozen, so the fork's blob write
waits).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptstore import CheckpointClient
from ckptstore_core.errors import RunNotFound
from support.blobs import blob_files, catalog_blobs, check_store, garbage_blobs
from support.s3server import frozen, s3_store
from support.serviceproc import Service
from support.states import assert_same_state, training_states
from support.waiting import wait_until

ENV = {
    "CKPTSTORE_REROOT_DEPTH": "0",
    "CKPTSTORE_REROOT_QUIET_S": "0",
    "CKPTSTORE_KEYFRAME_INTERVAL": "4",  # keyframes at steps 0 and 4
    "CKPTSTORE_GARBAGE_GRACE_S": "0",
    "CKPTSTORE_CHUNK_BYTES": str(64 << 10),
}


@pytest.fixture(scope="module")
def states() -> list[dict[str, Any]]:
    return training_states(8)


def check_runs(client: CheckpointClient, expected: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Each run holds exactly the steps of ``expected[run]``, each loading to its state."""
    for run, steps in expected.items():
        assert [i.step for i in client.list(run)] == sorted(steps), run
        for step, state in steps.items():
            assert_same_state(state, client.load(run, step), path=f"{run}@{step}")


@pytest.mark.slow
def test_sigkill_during_collection_loses_nothing(
    make_service: Callable[..., Service], tmp_path: Path, states: list[dict[str, Any]]
) -> None:
    """Deletes (the middle of a chain, a fork's source, a whole run) leave their blobs on the
    garbage table; the collection deletes them and is killed before it drops their rows (a
    trigger refuses the drops: the window between a blob's delete and its row's). After a
    restart those rows' blobs are found gone, and every remaining checkpoint (the fork's
    included) loads exactly."""
    data = tmp_path / "data"
    # the deletes' blobs are due 5 s after them, for the sweep (every second) to collect
    env = {**ENV, "CKPTSTORE_GARBAGE_GRACE_S": "5", "CKPTSTORE_SWEEP_INTERVAL_S": "1"}
    svc = make_service(env=env, data_dir=data)
    client = CheckpointClient(svc.url)
    for step in range(8):
        client.save("g", step, states[step])
    for step in range(4):
        client.save("h", step, states[step])
    client.fork("g", 5, "ft")
    client.save("ft", 6, states[7])
    db = data / "catalog.sqlite3"
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as con:
        client.delete("g", 2)  # the middle of a chain: step 3 re-based
        # the fork's source: the chunks ft refers to (and its save's deltas rest on) kept as
        # its shared chunks, moved to a blob of their own; no blob of ft's rewritten
        client.delete("g", 5)
        client.delete_run("h")
        con.execute(
            "CREATE TRIGGER held BEFORE DELETE ON garbage BEGIN SELECT RAISE(ABORT, 'held'); END"
        )
        doomed = garbage_blobs(db)
        assert len(doomed) >= 6 and doomed <= set(blob_files(data))  # none due yet
        wait_until(lambda: not doomed & set(blob_files(data)), 30, "the collector deleted all")
        svc.kill()
        con.execute("DROP TRIGGER held")
    assert garbage_blobs(db) == doomed  # killed before the rows' drop

    svc.start()
    wait_until(lambda: not garbage_blobs(db), 30, "the start-up sweep collected the garbage")
    check_runs(
        client,
        {"g": {s: states[s] for s in (0, 1, 3, 4, 6, 7)}, "ft": {5: states[5], 6: states[7]}},
    )
    with pytest.raises(RunNotFound):
        client.list("h")
    assert not set(blob_files(data)) & doomed
    check_store(svc, client)  # the folder holds exactly the blobs the catalog names


@pytest.mark.slow
@pytest.mark.s3
def test_sigkill_during_a_fork_loses_nothing(
    make_service: Callable[..., Service],
    own_moto: tuple[str, int],
    tmp_path: Path,
    states: list[dict[str, Any]],
) -> None:
    """The fork is killed while it writes its (empty) blob, after its ``writing`` row: the
    restart's collection of crashed uploads deletes both, the source loads exactly, and the
    fork made again is whole; the bucket then holds exactly what the catalog names."""
    url, moto_pid = own_moto
    data = tmp_path / "data"
    env = {
        **ENV,
        "CKPTSTORE_BLOB_URL": f"s3://fork-{uuid.uuid4().hex[:12]}/ckpt",
        "CKPTSTORE_S3_ENDPOINT_URL": url,
        "CKPTSTORE_S3_PATH_STYLE": "true",
        "CKPTSTORE_S3_CREATE_BUCKET": "true",
        "CKPTSTORE_S3_REGION": "us-east-1",
        "CKPTSTORE_SWEEP_INTERVAL_S": "1",  # the fork's run's garbage too, soon
    }
    svc = make_service(env=env, data_dir=data)
    client = CheckpointClient(svc.url)
    for step in range(4):
        client.save("src", step, states[step])
    db = data / "catalog.sqlite3"
    answer: list[object] = []

    def fork() -> None:
        body = {"from_run": "src", "from_step": 2}
        try:
            answer.append(httpx.post(f"{svc.url}/v1/runs/ft/fork", json=body, timeout=60))
        except httpx.TransportError as exc:
            answer.append(exc)

    def writing() -> set[str]:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            rows = conn.execute("SELECT blob_key FROM checkpoints WHERE status = 'writing'")
            return {k for (k,) in rows}

    thread = threading.Thread(target=fork)
    with frozen(moto_pid):  # the fork's blob write waits for an answer
        thread.start()
        key = wait_until(writing, 30, "the fork's writing row", interval=0.005).pop()
        svc.kill()
    thread.join(60)
    assert isinstance(answer[0], httpx.TransportError), "the fork ended before the kill"
    store = s3_store(env)
    try:
        # the store answers again (whether the write the kill cut short landed or not)
        store.exists(key)
        svc.start()  # collects the crashed upload: its blob, then its row
        assert not writing() and not store.exists(key)
        with pytest.raises(RunNotFound):
            client.list("ft")
        check_runs(client, {"src": {s: states[s] for s in range(4)}})
        info = client.fork("src", 2, "ft")
        assert (info.step, info.stored_bytes) == (2, 0)
        client.save("ft", 3, states[5])
        check_runs(
            client, {"src": {s: states[s] for s in range(4)}, "ft": {2: states[2], 3: states[5]}}
        )
        client.delete_run("src")
        check_runs(client, {"ft": {2: states[2], 3: states[5]}})
        wait_until(lambda: not garbage_blobs(db), 30, "the deletes' garbage collected")
        assert set(store.iter_keys()) == catalog_blobs(db)
    finally:
        store.close()
