"""Direct saves and loads (writers that encode their own chunks, readers that decode them) on
the production backends: two replicas on PostgreSQL + S3 (moto), chains that alternate
direct and service-encoded saves across the replicas, loaded by both kinds of client (a
direct one through presigned S3 URLs), and a replica killed while a writer's encoded part
streams in."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from ckptstore import CheckpointClient
from ckptstore.direct import DirectWriter, pieces_of
from ckptstore.transport import Transport
from ckptstore_core.wire import TensorPiece
from ckptstore_service.catalog import Catalog
from support.s3server import s3_store
from support.serviceproc import Service
from support.states import assert_same_state, training_states
from support.waiting import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.s3, pytest.mark.slow]

FAST_VERIFIER = {"CKPTSTORE_VERIFY_INTERVAL_S": "0.2", "CKPTSTORE_VERIFY_CPU_SHARE": "1"}


def verifications(url: str, run: str) -> dict[int, str]:
    listed = httpx.get(f"{url}/v1/runs/{run}/checkpoints").json()["checkpoints"]
    return {c["step"]: c["verification"] for c in listed}


def test_direct_and_service_saves_alternate_over_two_replicas(
    make_service: Callable[..., Service], backends: dict[str, str]
) -> None:
    env = {**backends, **FAST_VERIFIER}
    a, b = make_service(env), make_service(env)
    states = training_states(6)
    with (
        CheckpointClient(a.url, direct=True) as direct,
        CheckpointClient(b.url) as plain,
    ):
        for step, state in enumerate(states):
            # even steps encoded by the writer through a, odd ones by b's service
            (direct if step % 2 == 0 else plain).save("mixed", step, state)
        # direct loads read the bucket through presigned URLs, decoding here
        for client in (direct, plain):
            for step, state in enumerate(states):
                assert_same_state(state, client.load("mixed", step), path=f"step {step}")
    layout = httpx.post(f"{b.url}/v1/runs/mixed/checkpoints/5/ranges", json={}).json()
    assert len(layout["blobs"]) > 1  # its chains reach back over several checkpoints
    assert all(
        blob["url"].startswith(backends["CKPTSTORE_S3_ENDPOINT_URL"]) for blob in layout["blobs"]
    )
    judged = wait_until(
        lambda: (got := verifications(b.url, "mixed")) and "pending" not in got.values() and got,
        what="the verifier's verdicts",
    )
    assert judged == {s: "verified" if s % 2 == 0 else "service" for s in range(6)}
    assert s3_store(backends).list_open_uploads() == []


def test_a_replica_killed_while_a_part_streams_leaves_nothing_and_the_save_is_retried(
    make_service: Callable[..., Service], backends: dict[str, str], tmp_path: Path
) -> None:
    # the encoded part streams through replica a (not straight to S3): what its death cuts
    backends = {**backends, "CKPTSTORE_PRESIGN": "false"}
    a = make_service(backends, tmp_path / "a")
    b = make_service(backends, tmp_path / "b")
    w = np.random.default_rng(0).standard_normal(3 << 20).astype(np.float32)  # 12 MiB
    spec = [("w", "F32", w.shape)]
    halfway, release = threading.Event(), threading.Event()

    def stalled() -> Iterator[TensorPiece]:
        pieces = list(pieces_of([memoryview(w.tobytes())]))
        yield pieces[0]
        halfway.set()
        release.wait(60)  # the replica dies meanwhile
        yield from pieces[1:]

    writer = DirectWriter(workers=1)
    failed: list[BaseException] = []

    def send() -> None:
        transport = Transport(a.url, retries=0)
        try:
            writer.save_part(
                transport, "/v1/runs/killed/checkpoints/1", "killed", "p", spec, stalled
            )
        except BaseException as exc:
            failed.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    catalog = Catalog(backends["CKPTSTORE_DATABASE_URL"])
    try:
        assert halfway.wait(60)
        wait_until(catalog.parts_in_progress, 30, "the part being written")
        a.kill()  # SIGKILL: no clean-up runs
        release.set()
        sender.join(60)
        assert failed, "the part was stored although its replica died"
        # nothing visible through the other replica
        assert httpx.get(f"{b.url}/v1/runs/killed/checkpoints").status_code == 404
        # the restart frees the dead replica's locks; its first sweep collects the part
        make_service(backends, tmp_path / "a")
        wait_until(lambda: catalog.parts_in_progress() == [], 60, "the crashed part collected")
        wait_until(lambda: s3_store(backends).list_open_uploads() == [], 30, "uploads aborted")
        # the save again, whole, through the other replica
        with CheckpointClient(b.url, direct=True) as client:
            client.save("killed", 1, {"w": torch.from_numpy(w)})
            assert torch.equal(client.load("killed", 1)["w"], torch.from_numpy(w))
    finally:
        release.set()
        catalog.close()
        writer.close()
