"""Production backends end to end: PostgreSQL + S3 (moto) behind two service replicas."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from ckptstore import CheckpointClient
from ckptstore_core.wire import FORMAT, encode_header
from ckptstore_service.catalog import Catalog
from support.bodies import partial_upload
from support.s3server import s3_store
from support.serviceproc import Service
from support.states import assert_same_state, training_states
from support.waiting import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


@pytest.mark.slow
def test_two_replicas_share_postgres_and_s3(
    make_service: Callable[..., Service], backends: dict[str, str]
) -> None:
    a, b = make_service(backends), make_service(backends)
    states = training_states(8)
    ca, cb = CheckpointClient(a.url), CheckpointClient(b.url)
    # alternate replicas: each save's base was written by the other one, so every save
    # rebuilds its base cache from S3 first
    for i, state in enumerate(states):
        info = (ca if i % 2 == 0 else cb).save("shared", i, state)
        assert info.parent_step == (None if i == 0 else i - 1)
        assert info.keyframe == (i % 4 == 0)
    for client in (ca, cb):
        assert [c.step for c in client.list("shared")] == list(range(8))
        for i, state in enumerate(states):
            assert_same_state(state, client.load("shared", i))
        assert_same_state(states[-1], client.load("shared"))
    assert s3_store(backends).list_open_uploads() == []
    ca.close()
    cb.close()


def small_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 1024, generator=g), "step": seed}


@pytest.mark.slow
def test_parallel_posts_to_one_run_are_serialized(
    make_service: Callable[..., Service], backends: dict[str, str]
) -> None:
    replicas = [make_service(backends), make_service(backends)]
    clients = [CheckpointClient(r.url) for r in replicas]
    steps = list(range(1, 13))
    random.Random(0).shuffle(steps)

    def save(step: int) -> None:
        clients[step % 2].save("race", step, small_state(step))

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(save, steps))
    listed = httpx.get(f"{replicas[0].url}/v1/runs/race/checkpoints").json()["checkpoints"]
    assert [c["step"] for c in listed] == sorted(steps)  # nothing lost
    # serialized: each parent is the greatest smaller step committed before it
    by_start = sorted(listed, key=lambda c: c["created"])
    for i, c in enumerate(by_start):
        earlier = [e["step"] for e in by_start[:i] if e["step"] < c["step"]]
        assert c["parent_step"] == (max(earlier) if earlier else None)
    for step in steps:
        assert_same_state(small_state(step), clients[(step + 1) % 2].load("race", step))
    for c in clients:
        c.close()


@pytest.mark.timing
def test_other_runs_proceed_while_one_upload_holds_its_run(
    make_service: Callable[..., Service], backends: dict[str, str]
) -> None:
    a, b = make_service(backends), make_service(backends)
    prefix, header = encode_header([("w", "F32", (1 << 20,))], {"format": FORMAT})
    held = partial_upload(a.url, "busy", 1, prefix + b"\0" * 1000, header.total_len)
    catalog = Catalog(backends["CKPTSTORE_DATABASE_URL"])
    try:
        # the upload's writing row is made under its run's lock: replica a now holds "busy"
        wait_until(
            lambda: [r for _, r, *_ in catalog.uploads_in_progress()] == ["busy"],
            what="replica a began the upload of run busy",
        )
        t0 = time.perf_counter()
        with CheckpointClient(b.url) as client:
            client.save("free", 1, small_state(1))  # another run: not blocked
        assert time.perf_counter() - t0 < 10
        done = threading.Event()

        def same_run() -> None:
            with CheckpointClient(b.url) as client:
                client.save("busy", 2, small_state(2))
            done.set()

        waiter = threading.Thread(target=same_run)
        waiter.start()
        assert not done.wait(2.0)  # the same run waits for the upload in progress
    finally:
        held.close()  # the client goes away mid-upload: its lock is released
        catalog.close()
    assert done.wait(30)
    waiter.join()
    listed = httpx.get(f"{b.url}/v1/runs/busy/checkpoints").json()["checkpoints"]
    assert [c["step"] for c in listed] == [2]


@pytest.mark.slow
def test_killed_mid_upload_leaves_nothing_after_restart(
    make_service: Callable[..., Service], backends: dict[str, str], tmp_path: Any
) -> None:
    a = make_service(backends, tmp_path / "a")
    b = make_service(backends, tmp_path / "b")
    n = 24 << 20  # several 8 MiB S3 parts, so a multipart upload is open
    prefix, header = encode_header([("w", "U8", (n,))], {"format": FORMAT})
    sock = partial_upload(a.url, "crash", 5, prefix + os.urandom(n // 2), header.total_len)
    store = s3_store(backends)
    wait_until(store.list_open_uploads, 30, "the upload reached S3", interval=0.1)
    assert store.list_open_uploads(), "the upload never reached S3"
    a.kill()  # SIGKILL mid-upload: no clean-up runs
    sock.close()

    # invisible everywhere, even before any clean-up
    assert httpx.get(f"{b.url}/v1/runs/crash/checkpoints").status_code == 404
    assert "crash" not in [r["name"] for r in httpx.get(f"{b.url}/v1/runs").json()["runs"]]
    catalog = Catalog(backends["CKPTSTORE_DATABASE_URL"])
    assert [r for _, r, *_ in catalog.uploads_in_progress()] == ["crash"]

    make_service(backends, tmp_path / "a")  # the restart collects the crashed upload
    assert catalog.uploads_in_progress() == []
    assert store.list_open_uploads() == []
    assert list(store.iter_keys("runs/crash/")) == []
    catalog.close()
