"""The fault-injection suite (issue 21, item 7): a real service on PostgreSQL + S3 (moto)
with a fault-injecting proxy (support.faultproxy) between it and each of them, and one
between the client and the service to keep a save in flight while a fault hits.

Faults: connection resets (one, or every connection while the peer is "down"), stalls,
S3's ``503 SlowDown``, latency, a PostgreSQL restart (every connection reset, new ones
refused for a while) and ``pg_terminate_backend`` mid-save. Each test's docstring names
the guarantees it checks, among:

- **no wrong bytes**: every committed checkpoint loads bit-exactly (from S3: the base
  cache is off);
- **nothing half-visible**: a save that failed is not listed, and leaves no open multipart
  upload;
- **a clean typed error within a bound**: the client (``retries=0``) gets a 503
  ``StorageUnavailable`` (a ckptstore error class) within ``BOUND_S``: the documented
  bound of docs/deployment.md "Bounded waits on storage" with the small S3 timeouts set
  here, plus the failed save's clean-up and slack for a loaded 2-core machine;
- **success on retry**: once the fault clears, the same call succeeds (or a retrying client
  rides the fault out by itself).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from ckptstore import CheckpointClient
from ckptstore_core.errors import (
    CkptStoreError,
    RunNotFound,
    ServiceUnavailable,
    StorageUnavailable,
)
from support.faultproxy import FaultProxy
from support.s3server import s3_store
from support.serviceproc import Service
from support.states import assert_same_state
from support.waiting import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.s3, pytest.mark.timing]

CONNECT_S, READ_S, DEADLINE_S, READINESS_S = 0.5, 1.0, 3.0, 0.5
# docs/deployment.md: a stalled store fails a request within about max(deadline, connect +
# read) plus a back-off; a failed save then cleans up (READINESS_S per call). As in
# test_frozen_store.py: generous for a loaded 2-core machine, far below the minutes of old.
BOUND_S = 4 * DEADLINE_S
# CKPTSTORE_DATABASE_TIMEOUT_S: a stalled PostgreSQL fails a request within about twice this
# (docs/operations.md), well within BOUND_S; the smallest connect_timeout libpq takes
DB_TIMEOUT_S = 2.0
# the run lock's lease (PostgreSQL): a lock its holder could not release (the database was
# down) blocks the run this long at most; renewed every third of it
LOCK_LEASE_S = 5.0
LONG_LEASE_S = 120.0
RUN = "faulty"


@dataclass
class Faulty:
    """A service whose S3 and PostgreSQL links go through proxies, and the ways in."""

    service: Service
    s3: FaultProxy  # service <-> moto (http mode)
    pg: FaultProxy  # service <-> PostgreSQL
    front: FaultProxy  # client <-> service
    env: dict[str, str]  # the service's settings, S3 endpoint direct (for s3_store)
    pg_url: str  # the service's database, direct

    def client(self, retries: int = 0, *, through_front: bool = False) -> CheckpointClient:
        """A client of the service (``through_front``: through :attr:`front`); ``retries=0``
        shows each failure as it is, else it retries 503s quickly."""
        url = self.front.url if through_front else self.service.url
        return CheckpointClient(url, retries=retries, backoff=0.2, timeout=60)


@pytest.fixture
def make_faulty(
    make_service: Callable[..., Service], pg_url: str, s3_endpoint: str
) -> Iterator[Callable[..., Faulty]]:
    """``make_faulty(base_cache=False, lock_lease_s=LOCK_LEASE_S)``: the service behind its
    proxies. Without a base
    cache every load and every save's base reads S3 (through the proxy); with one, a save
    on the run's newest checkpoint reads its base from local disk, and needs neither S3 nor
    the database while its body arrives."""
    s3_at, pg_at = urlsplit(s3_endpoint), make_url(pg_url)
    assert s3_at.hostname and s3_at.port and pg_at.host
    with contextlib.ExitStack() as proxies:

        def make(base_cache: bool = False, lock_lease_s: float = LOCK_LEASE_S) -> Faulty:
            s3 = proxies.enter_context(FaultProxy(s3_at.hostname, s3_at.port, http=True))
            pg = proxies.enter_context(FaultProxy(pg_at.host, pg_at.port or 5432))
            direct = {
                "CKPTSTORE_BLOB_URL": f"s3://faults-{uuid.uuid4().hex[:12]}/ckpt",
                "CKPTSTORE_S3_ENDPOINT_URL": s3_endpoint,
                "CKPTSTORE_S3_PATH_STYLE": "true",
                "CKPTSTORE_S3_CREATE_BUCKET": "true",
                "CKPTSTORE_S3_REGION": "us-east-1",
                "CKPTSTORE_S3_CONNECT_TIMEOUT_S": str(CONNECT_S),
                "CKPTSTORE_S3_READ_TIMEOUT_S": str(READ_S),
                "CKPTSTORE_S3_DEADLINE_S": str(DEADLINE_S),
                "CKPTSTORE_READINESS_TIMEOUT_S": str(READINESS_S),
                "CKPTSTORE_CACHE_BYTES": str(64 << 20 if base_cache else 0),
                "CKPTSTORE_KEYFRAME_INTERVAL": "4",
                "CKPTSTORE_LOCK_LEASE_S": str(lock_lease_s),
                "CKPTSTORE_DATABASE_TIMEOUT_S": str(DB_TIMEOUT_S),
            }
            database = pg_at.set(host="127.0.0.1", port=pg.port)
            proxied = {
                **direct,
                "CKPTSTORE_S3_ENDPOINT_URL": s3.url,
                "CKPTSTORE_DATABASE_URL": database.render_as_string(hide_password=False),
            }
            svc = make_service(proxied)
            proxies.callback(svc.stop)  # before its proxies go (make_service's is too late)
            port = urlsplit(svc.url).port
            assert port
            # small chunks: its latency can stretch a 1 MiB body over seconds
            front = proxies.enter_context(FaultProxy("127.0.0.1", port, chunk_bytes=8 << 10))
            return Faulty(svc, s3, pg, front, direct, pg_url)

        yield make


@pytest.fixture
def faulty(make_faulty: Callable[..., Faulty]) -> Faulty:
    """The service behind its proxies, no base cache: every load reads S3."""
    return make_faulty()


def _state(seed: int, rows: int = 16) -> dict[str, Any]:
    """A tiny training-like state: ``rows`` x 256 fp32 weights, a bias, a step counter."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 256, generator=g), "b": torch.randn(256, generator=g), "n": seed}


BIG_ROWS = 1024  # 1 MiB of weights: 128 of the front proxy's chunks, 6 s at 50 ms each


def _timed_failure(call: Callable[[], object]) -> tuple[CkptStoreError, float]:
    """The ckptstore error ``call`` raises and how long it took; fails the test if it
    raises nothing (or something untyped)."""
    start = time.monotonic()
    with pytest.raises(CkptStoreError) as caught:
        call()
    return caught.value, time.monotonic() - start


def _assert_failed_cleanly(call: Callable[[], object]) -> CkptStoreError:
    """``call`` fails with a 503 StorageUnavailable within BOUND_S."""
    error, took = _timed_failure(call)
    assert isinstance(error, StorageUnavailable), repr(error)
    assert error.status == 503
    assert took < BOUND_S, f"{took:.1f} s"
    return error


def _steps(client: CheckpointClient) -> list[int]:
    try:
        return [c.step for c in client.list(RUN)]
    except RunNotFound:
        return []


def _assert_exactly(f: Faulty, saved: dict[int, dict[str, Any]]) -> None:
    """The run lists exactly ``saved``'s steps, each loads bit-exactly (from S3), and no
    multipart upload is left open in the bucket."""
    with f.client(retries=3) as client:
        assert _steps(client) == sorted(saved)
        for step, state in saved.items():
            assert_same_state(state, client.load(RUN, step))
    assert s3_store(f.env).list_open_uploads() == []


class _Background:
    """A save in a thread: its result or its error."""

    def __init__(self, client: CheckpointClient, step: int, state: dict[str, Any]) -> None:
        self.error: BaseException | None = None
        self.done = False
        self._thread = threading.Thread(target=self._run, args=(client, step, state))
        self._thread.start()

    def _run(self, client: CheckpointClient, step: int, state: dict[str, Any]) -> None:
        try:
            client.save(RUN, step, state)
        except BaseException as exc:
            self.error = exc
        self.done = True

    def join(self, timeout: float = BOUND_S + 30) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the save still runs after {timeout} s"


def _mid_save(f: Faulty, step: int, state: dict[str, Any]) -> _Background:
    """Start a save through the front proxy, slowed to a crawl, and return once the
    service is past the save's first queries and waits on its body (its run lock held, its
    ``writing`` row in the catalog)."""
    f.front.set_latency(0.05)
    saving = _Background(f.client(through_front=True), step, state)
    wait_until(lambda: _writing_rows(f.pg_url) > 0, 20, "the save is in flight", interval=0.02)
    return saving


def _writing_rows(pg_url: str) -> int:
    """Checkpoints being written now (``writing`` rows of the catalog at ``pg_url``)."""
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            query = text("SELECT count(*) FROM checkpoints WHERE status = 'writing'")
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


# -- S3 ------------------------------------------------------------------------------------


def test_a_reset_mid_request_to_s3_is_absorbed(faulty: Faulty) -> None:
    """A connection to S3 reset in the middle of a request (the save's PUT or its base's
    GET, caught by a stall, then reset): the service retries the request within its
    deadline. Guarantees: success without a client retry (``retries=0``); no wrong
    bytes."""
    states = {0: _state(0), 1: _state(1)}
    with faulty.client() as client:
        client.save(RUN, 0, states[0])
        faulty.s3.stall()
        saving = _Background(client, 1, states[1])
        wait_until(lambda: faulty.s3.held > 0, 10, "an S3 request is caught", interval=0.01)
        assert faulty.s3.reset() >= 1
        faulty.s3.resume()
        saving.join()
        assert saving.error is None, repr(saving.error)
    _assert_exactly(faulty, states)


@pytest.mark.slow
def test_a_reset_mid_multipart_upload_is_absorbed(faulty: Faulty) -> None:
    """A checkpoint larger than an S3 part (8 MiB) goes up as a multipart upload; the
    connections carrying it are reset in the middle of its first part: the service retries
    the part within its deadline. Guarantees: success without a client retry, no wrong
    bytes, no multipart upload left open."""
    g = torch.Generator().manual_seed(7)
    states = {0: {"w": torch.randn(3072, 1024, generator=g)}}  # 12 MiB: two parts
    faulty.s3.set_latency(0.01)  # the part crawls: 8 MiB in 64 KiB chunks, over a second
    before = faulty.s3.forwarded
    with faulty.client() as client:
        saving = _Background(client, 0, states[0])
        wait_until(
            lambda: faulty.s3.forwarded - before > 2 << 20, 60, "a part is going up", interval=0.01
        )
        assert faulty.s3.reset() >= 1
        faulty.s3.set_latency(0)
        saving.join()
    assert saving.error is None, repr(saving.error)
    _assert_exactly(faulty, states)


def test_s3_down_fails_saves_and_loads_cleanly_then_they_succeed(faulty: Faulty) -> None:
    """S3 unreachable (every connection reset, new ones reset on accept): a save and a
    load fail with 503 StorageUnavailable within the bound; the failed save is not listed;
    once S3 is back the same save and load succeed. Guarantees: a clean typed error within
    a bound, nothing half-visible, success on retry, no wrong bytes."""
    states = {0: _state(0)}
    with faulty.client() as client:
        client.save(RUN, 0, states[0])
        faulty.s3.refuse()
        faulty.s3.reset()
        error = _assert_failed_cleanly(lambda: client.save(RUN, 1, _state(1)))
        # botocore names the cause: "Connection was closed", "Could not connect to ..."
        assert any(word in error.message.lower() for word in ("reset", "connect", "closed"))
        _assert_failed_cleanly(lambda: client.load(RUN, 0))
        assert _steps(client) == [0]  # the catalog answers; the failed save is not there
        faulty.s3.clear()
        states[1] = _state(1)
        client.save(RUN, 1, states[1])
    _assert_exactly(faulty, states)


@pytest.mark.slow
def test_a_stalled_s3_fails_saves_and_loads_within_the_bound(faulty: Faulty) -> None:
    """S3 stalls (connections open, nothing forwarded: a hung store or a black-holed
    network): a save and a load fail with 503 StorageUnavailable within the bound, not
    after minutes; /readyz says the blob store is not ready while /healthz stays 200; once
    the stall ends the save succeeds. Guarantees: a clean typed error within a bound,
    nothing half-visible, success on retry, no wrong bytes."""
    states = {0: _state(0)}
    url = faulty.service.url
    with faulty.client() as client:
        client.save(RUN, 0, states[0])
        faulty.s3.stall()
        _assert_failed_cleanly(lambda: client.save(RUN, 1, _state(1)))
        _assert_failed_cleanly(lambda: client.load(RUN, 0))
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 503
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        assert _steps(client) == [0]
        faulty.s3.resume()
        states[1] = _state(1)
        client.save(RUN, 1, states[1])
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    _assert_exactly(faulty, states)


def test_a_slowdown_is_retried_by_the_service(faulty: Faulty) -> None:
    """S3 throttles (503 SlowDown) one request: the service's S3 client backs off and
    retries it within its deadline. Guarantees: success without a client retry; no wrong
    bytes."""
    states = {0: _state(0), 1: _state(1)}
    with faulty.client() as client:
        client.save(RUN, 0, states[0])
        faulty.s3.slowdown(1)
        client.save(RUN, 1, states[1])
        assert faulty.s3.slowdowns_sent == 1
    _assert_exactly(faulty, states)


def test_persistent_slowdown_is_a_clean_503_then_retries_succeed(faulty: Faulty) -> None:
    """S3 throttles every request: a save fails with 503 StorageUnavailable within the
    bound, naming SlowDown as the cause; nothing of it is listed; once the throttling stops
    the save succeeds. Then S3 throttles a few requests more than the service's own retries
    absorb within its deadline: a client that retries rides it out. Guarantees: a clean
    typed error within a bound, nothing half-visible, success on retry, no wrong bytes."""
    states = {0: _state(0)}
    with faulty.client() as client:
        client.save(RUN, 0, states[0])
        faulty.s3.slowdown(10**6)
        error = _assert_failed_cleanly(lambda: client.save(RUN, 1, _state(1)))
        assert "SlowDown" in error.message
        assert _steps(client) == [0]
        faulty.s3.clear()
        states[1] = _state(1)
        client.save(RUN, 1, states[1])
    faulty.s3.slowdown(4)
    sent = faulty.s3.slowdowns_sent
    states[2] = _state(2)
    with faulty.client(retries=5) as client:
        client.save(RUN, 2, states[2])
    assert faulty.s3.slowdowns_sent == sent + 4  # every throttled answer was met
    _assert_exactly(faulty, states)


@pytest.mark.slow
def test_latency_to_s3_slows_but_never_breaks(faulty: Faulty) -> None:
    """Latency on every chunk to and from S3: below the read timeout, saves and loads
    succeed (bit-exact, from S3); above it (each answer later than
    CKPTSTORE_S3_READ_TIMEOUT_S), a save fails with 503 within the bound, and succeeds
    once the latency drops. Guarantees: no wrong bytes, a clean typed error within a
    bound, nothing half-visible, success on retry."""
    states: dict[int, dict[str, Any]] = {}
    with faulty.client() as client:
        faulty.s3.set_latency(0.1)
        for step in range(3):
            states[step] = _state(step)
            client.save(RUN, step, states[step])
        for step, state in states.items():
            assert_same_state(state, client.load(RUN, step))
        faulty.s3.set_latency(READ_S * 1.5)
        _assert_failed_cleanly(lambda: client.save(RUN, 3, _state(3)))
        assert _steps(client) == [0, 1, 2]
        faulty.s3.set_latency(0)
        states[3] = _state(3)
        client.save(RUN, 3, states[3])
    _assert_exactly(faulty, states)


# -- PostgreSQL ----------------------------------------------------------------------------


def test_postgres_connections_reset_mid_save(make_faulty: Callable[..., Faulty]) -> None:
    """Every connection between the service and PostgreSQL is reset while a save's body
    is arriving (its run lock held): the save commits, no client retry needed (the pool
    reconnects; the upload held no connection while it waited on the network).
    Guarantees: success, no wrong bytes, nothing duplicated or lost."""
    faulty = make_faulty(base_cache=True)
    states = {0: _state(0, BIG_ROWS), 1: _state(1, BIG_ROWS)}
    with faulty.client() as client:
        client.save(RUN, 0, states[0])
    saving = _mid_save(faulty, 1, states[1])
    assert faulty.pg.reset() >= 1
    faulty.front.set_latency(0)
    saving.join()
    assert saving.error is None, repr(saving.error)
    _assert_exactly(faulty, states)


@pytest.mark.slow
def test_postgres_restart_during_the_body_costs_the_save_nothing(
    make_faulty: Callable[..., Faulty],
) -> None:
    """PostgreSQL "restarts" (every connection reset, new ones refused for 2 s: shorter
    than the run lock's lease) while a save's body is arriving, and is back before the
    body ends: the save commits without a client retry. Guarantees: success, no wrong
    bytes, nothing half-visible."""
    faulty = make_faulty(base_cache=True)
    states = {0: _state(0, BIG_ROWS), 1: _state(1, BIG_ROWS)}
    with faulty.client() as client:
        client.save(RUN, 0, states[0])
    saving = _mid_save(faulty, 1, states[1])
    faulty.pg.refuse()
    faulty.pg.reset()
    time.sleep(2.0)  # the database is down this long (simulated time, not a wait)
    assert not saving.done, f"the save ended during the outage: {saving.error!r}"
    faulty.pg.clear()
    faulty.front.set_latency(0)
    saving.join()
    assert saving.error is None, repr(saving.error)
    _assert_exactly(faulty, states)


@pytest.mark.slow
def test_postgres_down_at_commit_is_a_clean_503_then_the_retry_commits(
    make_faulty: Callable[..., Faulty],
) -> None:
    """PostgreSQL goes down while a save's body is arriving and is still down when the body
    ends: the save fails with 503 StorageUnavailable within the bound and is not listed
    once the database is back; the same save then succeeds at once (the failed save's lock
    could not be released while the database was down: it is released once it answers,
    not left to its lease). Guarantees:
    a clean typed error within a bound, nothing half-visible, success on retry, no wrong
    bytes."""
    # a lease far longer than the test: only its release lets the retry through
    faulty = make_faulty(base_cache=True, lock_lease_s=LONG_LEASE_S)
    states = {0: _state(0, BIG_ROWS)}
    with faulty.client() as client:
        client.save(RUN, 0, states[0])
    saving = _mid_save(faulty, 1, _state(1, BIG_ROWS))
    faulty.pg.refuse()
    faulty.pg.reset()
    start = time.monotonic()
    faulty.front.set_latency(0)
    saving.join()
    took = time.monotonic() - start
    assert isinstance(saving.error, StorageUnavailable), repr(saving.error)
    assert took < BOUND_S, f"{took:.1f} s"
    faulty.pg.clear()
    states[1] = _state(1, BIG_ROWS)
    with faulty.client() as client:
        assert _steps(client) == [0]
        # the failed save could not release its run lock (the database was down): its
        # replica releases it once the database answers, so the retry does not wait for
        # the lease to expire
        start = time.monotonic()
        client.save(RUN, 1, states[1])
        took = time.monotonic() - start
        assert took < BOUND_S, f"{took:.1f} s"
    _assert_exactly(faulty, states)


def test_pg_terminate_backend_mid_save(make_faulty: Callable[..., Faulty]) -> None:
    """The service's PostgreSQL backends are killed (``pg_terminate_backend``: what an
    operator, a failover or an idle-session killer does) while a save's body is arriving:
    the pool finds its connections dead and opens new ones, and the save commits without a
    client retry. Guarantees: success, no wrong bytes, nothing half-visible."""
    faulty = make_faulty(base_cache=True)
    states = {0: _state(0, BIG_ROWS), 1: _state(1, BIG_ROWS)}
    with faulty.client() as client:
        client.save(RUN, 0, states[0])
    saving = _mid_save(faulty, 1, states[1])
    assert _terminate_backends(faulty.pg_url) >= 1
    faulty.front.set_latency(0)
    saving.join()
    assert saving.error is None, repr(saving.error)
    _assert_exactly(faulty, states)


def test_the_client_connection_reset_mid_save(make_faulty: Callable[..., Faulty]) -> None:
    """The connection between the client and the service is reset while the save's body is
    arriving: the client (``retries=0``) gets a typed ServiceUnavailable at once; the
    service drops the upload (no ``writing`` row stays, nothing is listed); the same save
    through the same proxy then succeeds. Guarantees: a clean typed error within a bound,
    nothing half-visible, success on retry, no wrong bytes."""
    faulty = make_faulty(base_cache=True)
    states = {0: _state(0, BIG_ROWS), 1: _state(1, BIG_ROWS)}
    with faulty.client() as client:
        client.save(RUN, 0, states[0])
    saving = _mid_save(faulty, 1, states[1])
    start = time.monotonic()
    assert faulty.front.reset() >= 1
    faulty.front.set_latency(0)
    saving.join()
    took = time.monotonic() - start
    assert isinstance(saving.error, ServiceUnavailable), repr(saving.error)
    assert took < BOUND_S, f"{took:.1f} s"
    wait_until(lambda: _writing_rows(faulty.pg_url) == 0, 20, "the upload was dropped")
    with faulty.client(through_front=True) as client:
        assert _steps(client) == [0]
        client.save(RUN, 1, states[1])
    _assert_exactly(faulty, states)


def _terminate_backends(pg_url: str) -> int:
    """``pg_terminate_backend`` every other session on ``pg_url``'s database; how many."""
    engine = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            killed = conn.execute(
                text(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM "
                    "pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
            return int(killed)
    finally:
        engine.dispose()


@pytest.mark.slow
def test_a_stalled_database_fails_requests_within_a_bound(faulty: Faulty) -> None:
    """PostgreSQL stalls (connections open, nothing answers: a hung server, or a network
    that drops packets while the proxy's kernel still acknowledges them): a listing, a save
    and ``/healthz`` each fail with 503 StorageUnavailable within the bound, as on a stalled
    S3, and once the stall ends the service recovers by itself: the next save (no client
    retry) succeeds. Each database call has a client-side deadline
    (CKPTSTORE_DATABASE_TIMEOUT_S, DB_TIMEOUT_S here): the check of a pooled connection is
    cut after it, then a new connection times out after it too, so a request fails within
    about twice it. Before the deadline a listing still hung at 150 s. Guarantees: a clean
    typed error within a bound, nothing half-visible, success on retry, no wrong bytes."""
    states = {0: _state(0)}
    with faulty.client() as client:
        client.save(RUN, 0, states[0])
    faulty.pg.stall()
    try:
        with CheckpointClient(faulty.service.url, retries=0, timeout=BOUND_S) as client:
            _assert_failed_cleanly(lambda: client.list(RUN))
            _assert_failed_cleanly(lambda: client.save(RUN, 1, _state(1)))
        start = time.monotonic()
        health = httpx.get(f"{faulty.service.url}/healthz", timeout=BOUND_S)
        took = time.monotonic() - start
        assert health.status_code == 503, health.text
        assert health.json()["error"]["code"] == "storage_unavailable", health.text
        assert took < BOUND_S, f"{took:.1f} s"
    finally:
        faulty.pg.resume()
    states[1] = _state(1)
    with faulty.client() as client:
        client.save(RUN, 1, states[1])
    _assert_exactly(faulty, states)
