"""A frozen S3 store, end to end (issue 21, item 4): with small timeouts set in the
environment, a save and a load against a frozen store (moto SIGSTOPped: it accepts
connections but never answers) fail with 503 ``storage_unavailable`` within the configured
bound instead of hanging for minutes; ``/readyz`` answers 503 naming the blob store while
``/healthz`` (liveness) still answers 200; once the store thaws, a retry succeeds and
``/readyz`` is 200 again. A service asked to stop while a save waits on the frozen store
exits within the bound too."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from ckptstore import CheckpointClient
from ckptstore_core.errors import StorageUnavailable
from support.s3server import fake_aws_credentials, frozen
from support.serviceproc import Service
from support.states import assert_same_state
from support.waiting import wait_until

pytestmark = [pytest.mark.s3, pytest.mark.timing]

DEADLINE_S, READINESS_S = 2.5, 0.5
# connect 0.5 + read 1.0 per attempt, 2.5 s per request; a save also cleans up (probe
# timeouts) and a load may make a request or two before the one that stalls: generous
# bounds for a loaded 2-core machine, far below the minutes this took before
SAVE_BOUND_S = 4 * DEADLINE_S
READY_BOUND_S = READINESS_S + 2.0


@pytest.fixture(scope="module")
def moto(own_moto: tuple[str, int]) -> tuple[str, int]:
    return own_moto


def _service(tmp_path: Path, endpoint: str) -> Service:
    with fake_aws_credentials():  # the child inherits them
        return Service(
            tmp_path / "svc",
            {
                "CKPTSTORE_BLOB_URL": "s3://frozen/ckpt",
                "CKPTSTORE_S3_ENDPOINT_URL": endpoint,
                "CKPTSTORE_S3_PATH_STYLE": "true",
                "CKPTSTORE_S3_CREATE_BUCKET": "true",
                "CKPTSTORE_S3_REGION": "us-east-1",
                "CKPTSTORE_S3_CONNECT_TIMEOUT_S": "0.5",
                "CKPTSTORE_S3_READ_TIMEOUT_S": "1.0",
                "CKPTSTORE_S3_DEADLINE_S": str(DEADLINE_S),
                "CKPTSTORE_READINESS_TIMEOUT_S": str(READINESS_S),
                "CKPTSTORE_CACHE_BYTES": "0",  # loads read S3, not the base cache
            },
        )


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))}


def _timed(fn: object) -> float:
    start = time.monotonic()
    assert callable(fn)
    fn()
    return time.monotonic() - start


def test_a_frozen_store_answers_503_within_the_bound_and_recovers(
    tmp_path: Path, moto: tuple[str, int]
) -> None:
    with _service(tmp_path, moto[0]) as svc, CheckpointClient(svc.url, retries=0) as client:
        client.save("run", 0, _state(0))
        assert httpx.get(f"{svc.url}/readyz", timeout=10).json() == {
            "status": "ready",
            "database": "ok",
            "blob_store": "ok",
        }
        with frozen(moto[1]):
            for call in (
                lambda: client.save("run", 1, _state(1)),
                lambda: client.load("run", 0),
            ):
                start = time.monotonic()
                with pytest.raises(StorageUnavailable):
                    call()
                took = time.monotonic() - start
                assert took < SAVE_BOUND_S, f"{took:.1f} s"
            start = time.monotonic()
            ready = httpx.get(f"{svc.url}/readyz", timeout=30)
            assert time.monotonic() - start < READY_BOUND_S
            assert ready.status_code == 503
            body = ready.json()
            assert body["status"] == "not_ready"
            assert body["database"] == "ok"
            assert body["blob_store"] != "ok"
            assert body["error"]["code"] == "storage_unavailable"
            assert "blob store" in body["error"]["message"]
            assert "frozen" not in ready.text  # no bucket or endpoint on an open route
            live = httpx.get(f"{svc.url}/healthz", timeout=READY_BOUND_S)
            assert live.status_code == 200
        # thawed: ready again, the failed step saves on a retry, everything loads exactly
        assert httpx.get(f"{svc.url}/readyz", timeout=10).status_code == 200
        client.save("run", 1, _state(1))
        assert_same_state(_state(0), client.load("run", 0))
        assert_same_state(_state(1), client.load("run", 1))


def test_stopping_while_a_save_waits_on_a_frozen_store_is_bounded(
    tmp_path: Path, moto: tuple[str, int]
) -> None:
    svc = _service(tmp_path, moto[0]).start()
    errors: list[BaseException] = []

    def save() -> None:
        with CheckpointClient(svc.url, retries=0) as client:
            try:
                client.save("run", 0, _state(0))
            except Exception as exc:
                errors.append(exc)

    try:
        with frozen(moto[1]):
            saver = threading.Thread(target=save)
            saver.start()
            wait_until(
                lambda: (
                    "ckptstore_uploads_in_flight 1.0"
                    in httpx.get(f"{svc.url}/metrics", timeout=5).text
                ),
                10,
                "the save is in flight",
            )
            assert svc.proc is not None
            start = time.monotonic()
            svc.proc.terminate()
            svc.proc.wait(SAVE_BOUND_S + 5)
            took = time.monotonic() - start
            saver.join(10)
        assert took < SAVE_BOUND_S + 5, f"{took:.1f} s"
        assert errors, "the save cannot have succeeded against a frozen store"
    finally:
        svc.stop()


def test_queued_loads_each_get_their_503_within_the_bound(
    tmp_path: Path, moto: tuple[str, int]
) -> None:
    """Eight loads at once during a freeze: each answers 503 within its own deadline counted
    from its arrival (the documented bound, docs/deployment.md), not one deadline after the
    other (issue 33: loads queued behind each other waited 40, 80, 120 s with a 40 s
    deadline). A load queued a little still starts one stalled attempt, so not all answer
    at once."""
    with _service(tmp_path, moto[0]) as svc:
        with CheckpointClient(svc.url, retries=0) as client:
            for run in range(8):
                client.save(f"r{run}", 0, _state(run))
        took: dict[int, float] = {}
        codes: dict[int, int] = {}

        def load(run: int) -> None:
            start = time.monotonic()
            answer = httpx.get(f"{svc.url}/v1/runs/r{run}/checkpoints/0", timeout=120)
            took[run], codes[run] = time.monotonic() - start, answer.status_code

        with frozen(moto[1]):
            loads = [threading.Thread(target=load, args=(run,)) for run in range(8)]
            for t in loads:
                t.start()
            for t in loads:
                t.join(150)
        print("\n8 loads during a freeze answered after", sorted(f"{s:.1f}" for s in took.values()))
        assert set(codes.values()) == {503}, codes
        # each within the deadline from its arrival, plus a little for a back-off: before,
        # they came in pairs one read timeout apart (2 codec threads: 1.3, 1.3, 2.3, 2.3,
        # 3.3, 3.4, 4.4, 4.4 s); now 1.3-1.4 s (seven) and 2.3 s
        assert max(took.values()) < DEADLINE_S + 0.5, took
