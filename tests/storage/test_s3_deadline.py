"""Bounded waits on a frozen S3 store (issue 21, item 4): the store's operations fail with
``StorageUnavailable`` within the configured deadline instead of hanging for minutes, its
readiness check answers within the probe timeout, and everything works again once the store
thaws. The store is moto in a child process, frozen with SIGSTOP (it still accepts
connections: the kernel does, so every attempt waits its full read timeout)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest

from ckptstore_core.errors import StorageUnavailable
from ckptstore_service.storage.s3 import MIN_PART_SIZE, S3BlobStore
from support.faultproxy import FaultProxy
from support.s3server import fake_aws_credentials, frozen

pytestmark = [pytest.mark.s3, pytest.mark.timing]

CONNECT_S, READ_S, DEADLINE_S, PROBE_S = 0.5, 1.0, 2.5, 0.5
# A stalled operation fails within max(deadline, connect + read) plus a short back-off and
# the thread hand-offs; generous for a loaded 2-core machine, far below the old minutes.
BOUND_S = DEADLINE_S + 3.0


@pytest.fixture(scope="module")
def moto(own_moto: tuple[str, int]) -> tuple[str, int]:
    return own_moto


@pytest.fixture
def store(moto: tuple[str, int]) -> Iterator[S3BlobStore]:
    with fake_aws_credentials():
        store = S3BlobStore(
            f"test-{uuid.uuid4().hex}",
            endpoint_url=moto[0],
            region="us-east-1",
            path_style=True,
            create_bucket=True,
            part_size=MIN_PART_SIZE,
            connect_timeout=CONNECT_S,
            read_timeout=READ_S,
            deadline=DEADLINE_S,
            probe_timeout=PROBE_S,
        )
        yield store
        store.close()


def _fails_within(call: Callable[[], object], bound_s: float) -> tuple[float, str]:
    """Run ``call``: it must raise StorageUnavailable within ``bound_s`` seconds; returns the
    time it took and the message."""
    start = time.monotonic()
    with pytest.raises(StorageUnavailable) as info:
        call()
    took = time.monotonic() - start
    assert took < bound_s, f"took {took:.1f} s, bound {bound_s} s: {info.value}"
    return took, str(info.value)


def test_a_frozen_store_fails_each_operation_within_the_deadline(
    store: S3BlobStore, moto: tuple[str, int]
) -> None:
    store.put_stream("old", [b"x" * 1000])
    big = bytes(2 * MIN_PART_SIZE + 1)  # a multipart upload: three parts
    with frozen(moto[1]):
        took, message = _fails_within(lambda: store.put_stream("small", [b"y" * 100]), BOUND_S)
        assert took >= READ_S  # it did wait for an answer, once at least
        assert "gave up after" in message or "timeout" in message.lower(), message
        _fails_within(lambda: store.put_stream("big", [big]), BOUND_S + PROBE_S)
        _fails_within(lambda: store.get("old"), BOUND_S)
        _fails_within(lambda: store.exists("old"), BOUND_S)
        _fails_within(store.check_ready, 2 * PROBE_S + 1.0)
        _fails_within(lambda: store.discard("small"), 2 * PROBE_S + 1.0)
    # thawed: everything works again, and nothing half-written became visible
    store.check_ready()
    assert store.get("old") == b"x" * 1000
    assert not store.exists("small") and not store.exists("big")
    assert store.put_stream("small", [b"y" * 100]) == 100
    assert store.get("small") == b"y" * 100


def test_a_pause_shorter_than_the_read_timeout_is_not_cut(
    store: S3BlobStore, moto: tuple[str, int]
) -> None:
    """The deadline bounds stalls, not work: a store that pauses for less than the read
    timeout (half of it) still answers the request that was waiting."""
    done: list[int] = []
    writer = threading.Thread(target=lambda: done.append(store.put_stream("k", [b"z" * 10])))
    with frozen(moto[1]):
        writer.start()
        time.sleep(READ_S / 2)  # the length of the pause is what is tested
    writer.join(BOUND_S)
    assert done == [10]
    assert store.get("k") == b"z" * 10


@pytest.fixture
def throttled(s3_endpoint: str) -> Iterator[tuple[S3BlobStore, FaultProxy]]:
    """A store whose requests go through a fault proxy (http mode) to the session's moto."""
    at = urlsplit(s3_endpoint)
    assert at.hostname and at.port
    with FaultProxy(at.hostname, at.port, http=True) as proxy:
        store = S3BlobStore(
            f"test-{uuid.uuid4().hex}",
            endpoint_url=proxy.url,
            region="us-east-1",
            path_style=True,
            create_bucket=True,
            connect_timeout=CONNECT_S,
            read_timeout=READ_S,
            # room for one throttling back-off (up to 1 s) before the last attempt's start
            deadline=DEADLINE_S + 0.5,
            probe_timeout=PROBE_S,
        )
        yield store, proxy
        store.close()


def test_throttling_is_retried_then_fails_within_the_deadline_naming_slowdown(
    throttled: tuple[S3BlobStore, FaultProxy],
) -> None:
    """S3 answers 503 SlowDown: one is retried away; answered to every request, each
    operation fails within the deadline, and the error names the store's answer (it said
    "no answer" before: only network exceptions were remembered)."""
    store, proxy = throttled
    store.put_stream("k", [b"x" * 100])
    proxy.slowdown(1)
    assert store.get("k") == b"x" * 100
    assert proxy.slowdowns_sent == 1
    proxy.slowdown(10**6)
    for call in (lambda: store.put_stream("j", [b"y"]), lambda: store.get("k")):
        _, message = _fails_within(call, BOUND_S)
        assert "SlowDown (HTTP 503)" in message, message
    proxy.clear()
    assert store.get("k") == b"x" * 100
