"""Slow and silent clients against a real service: a body that stalls or crawls is cut with
``408 request_timeout`` and frees the run's lock and its upload slot; a client that sends
only its request's headers holds no slot, one that sends only its body's header holds no
lock, and one client holds at most its share of the slots (issue 21: "slow clients starve
everyone")."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest
import torch

from ckptstore import CheckpointClient
from ckptstore_core.wire import encode_header
from support.bodies import (
    assert_error,
    assert_nothing_stored,
    partial_upload,
    read_response,
    uploading,
    valid_body,
    wait_consumed,
)
from support.serviceproc import Service
from support.waiting import wait_until

pytestmark = pytest.mark.timing  # each test waits out a timeout and bounds how long

LIMITS = {
    "CKPTSTORE_UPLOAD_IDLE_TIMEOUT_S": "1.5",
    "CKPTSTORE_UPLOAD_MIN_RATE_BYTES_S": "1000",
    "CKPTSTORE_UPLOAD_RATE_WINDOW_S": "1",
    "CKPTSTORE_MAX_CONCURRENT_UPLOADS": "2",
    "CKPTSTORE_MAX_UPLOADS_PER_CLIENT": "2",  # the tests' clients share one address
}


def test_a_stalled_body_is_cut_and_frees_the_runs_lock(
    make_service: Callable[..., Service],
) -> None:
    svc = make_service(LIMITS)
    prefix, data = valid_body(seed=1)
    body = prefix + data
    t0 = time.perf_counter()
    # the header and a few bytes, then nothing: the upload holds the run's lock
    sock = partial_upload(svc.url, "stalled", 1, body[: len(prefix) + 8], len(body), timeout=20)
    try:
        status, answer = read_response(sock, timeout=20)
    finally:
        sock.close()
    took = time.perf_counter() - t0
    assert status == 408 and answer["error"]["code"] == "request_timeout", answer  # type: ignore[index]
    assert 1.0 < took < 8.0, took  # the idle timeout, not the 5 s drain of a rejected body
    assert_nothing_stored(svc, "stalled")
    # the run's lock is free again: a save of that run goes through at once
    with CheckpointClient(svc.url, retries=0) as client:
        t1 = time.perf_counter()
        assert client.save("stalled", 1, {"w": torch.ones(8)}).step == 1
        assert time.perf_counter() - t1 < 5.0


def test_a_crawling_body_is_cut(make_service: Callable[..., Service]) -> None:
    svc = make_service(LIMITS)
    prefix, data = valid_body(seed=2)
    body = prefix + data
    sock = partial_upload(svc.url, "crawl", 1, body[:16], len(body), timeout=20)
    try:
        sent, t0 = 16, time.perf_counter()
        # 10 bytes every 0.2 s: 50 bytes/s, under the 1000 bytes/s minimum, never idle
        while time.perf_counter() - t0 < 10:
            try:
                sock.sendall(body[sent : sent + 10])
            except OSError:  # the service answered and closed
                break
            sent += 10
            sock.settimeout(0.2)
            try:
                if sock.recv(1, 2):  # MSG_PEEK: the answer has come
                    break
            except TimeoutError:
                continue
        status, answer = read_response(sock, timeout=10)
    finally:
        sock.close()
    assert status == 408, answer
    assert "bytes/s" in answer["error"]["message"]  # type: ignore[index]
    assert time.perf_counter() - t0 < 8
    assert_nothing_stored(svc, "crawl")


def test_connections_sending_only_headers_hold_no_upload_slot(
    make_service: Callable[..., Service],
) -> None:
    # 2 upload slots; a long idle timeout, so only holding no slot lets the save through
    svc = make_service({**LIMITS, "CKPTSTORE_UPLOAD_IDLE_TIMEOUT_S": "30"})
    prefix, data = valid_body(seed=3)
    silent = [
        partial_upload(svc.url, f"silent-{i}", 1, b"", len(prefix) + len(data), timeout=20)
        for i in range(4)
    ]
    try:
        # twice as many silent uploads as slots: a real save still goes through
        with CheckpointClient(svc.url, retries=0) as client:
            t0 = time.perf_counter()
            assert client.save("busy", 1, {"w": torch.arange(16.0)}).step == 1
            assert time.perf_counter() - t0 < 10.0
    finally:
        for sock in silent:
            sock.close()
    assert_nothing_stored(svc, *(f"silent-{i}" for i in range(4)))


def test_a_silent_upload_is_cut_after_the_idle_timeout(
    make_service: Callable[..., Service],
) -> None:
    svc = make_service(LIMITS)
    prefix, data = valid_body(seed=4)
    sock = partial_upload(svc.url, "silent", 1, b"", len(prefix) + len(data), timeout=20)
    try:
        status, answer = read_response(sock, timeout=20)
    finally:
        sock.close()
    assert status == 408 and "no byte for 1.5 s" in answer["error"]["message"], answer  # type: ignore[index]


def test_a_client_silent_after_its_body_header_blocks_no_save_to_its_run(
    make_service: Callable[..., Service],
) -> None:
    """The run's lock is taken once tensor bytes arrive, not once the header is read: a
    valid header and then nothing held the run's lock until the idle timeout (150 s were
    tried before there was one). Here the idle timeout is 30 s, and the save must not wait."""
    svc = make_service({**LIMITS, "CKPTSTORE_UPLOAD_IDLE_TIMEOUT_S": "30"})
    prefix, data = valid_body(seed=5)
    sock = partial_upload(svc.url, "quiet", 1, prefix, len(prefix) + len(data), timeout=20)
    try:
        wait_consumed(sock)  # the service read the header
        with CheckpointClient(svc.url, retries=0) as client:
            t0 = time.perf_counter()
            assert client.save("quiet", 2, {"w": torch.arange(16.0)}).step == 2
            assert time.perf_counter() - t0 < 10.0
        assert uploading(svc) == []  # the silent one began no upload: no writing row
    finally:
        sock.close()
    with CheckpointClient(svc.url) as client:
        assert [c.step for c in client.list("quiet")] == [2]


def test_one_client_holds_at_most_its_share_of_the_upload_slots(
    make_service: Callable[..., Service],
) -> None:
    """CKPTSTORE_MAX_UPLOADS_PER_CLIENT=2 (of 8 slots): a third upload of the same client
    (the same address, tokens being off) is a 503 too_many_uploads with Retry-After, which
    the client retries until one of its uploads is done."""
    svc = make_service(
        {
            **LIMITS,
            "CKPTSTORE_UPLOAD_IDLE_TIMEOUT_S": "30",
            "CKPTSTORE_MAX_CONCURRENT_UPLOADS": "8",
            "CKPTSTORE_MAX_UPLOADS_PER_CLIENT": "2",
        }
    )
    prefix, data = valid_body(seed=6)
    total = len(prefix) + len(data)
    held = [
        partial_upload(svc.url, f"hog-{i}", 1, prefix + data[:8], total, timeout=20)
        for i in range(2)
    ]
    try:
        wait_until(lambda: sorted(uploading(svc)) == ["hog-0", "hog-1"], what="2 uploads")
        refused = httpx.post(
            f"{svc.url}/v1/runs/third/checkpoints/1", content=prefix + data, timeout=30
        )
        assert_error(refused, 503, "too_many_uploads")
        assert refused.headers["retry-after"] == "1"
        assert "CKPTSTORE_MAX_UPLOADS_PER_CLIENT" in refused.json()["error"]["message"]

        saved = threading.Event()

        def save() -> None:
            with CheckpointClient(svc.url, retries=8, backoff=0.2) as client:
                client.save("third", 1, {"w": torch.arange(16.0)})
            saved.set()

        saver = threading.Thread(target=save)
        saver.start()
        assert not saved.wait(1.0)  # refused and retried while the client holds its share
    finally:
        for sock in held:
            sock.close()
    assert saved.wait(30)
    saver.join()
    with CheckpointClient(svc.url) as client:
        assert torch.equal(client.load("third")["w"], torch.arange(16.0))


def test_one_client_holds_at_most_one_headers_worth_of_header_memory(
    make_service: Callable[..., Service],
) -> None:
    """Headers in flight cost memory (a multiple of their size) until their upload ends:
    one client's add up to at most CKPTSTORE_MAX_HEADER_BYTES at once (4 of its 78 MB
    headers took 4 GB). One more that would pass it is a 503 too_many_uploads, refused on
    its first 8 bytes, before its header is buffered; a small one still goes through."""
    svc = make_service(
        {
            **LIMITS,
            "CKPTSTORE_UPLOAD_IDLE_TIMEOUT_S": "30",
            "CKPTSTORE_MAX_CONCURRENT_UPLOADS": "8",
            "CKPTSTORE_MAX_UPLOADS_PER_CLIENT": "8",
            "CKPTSTORE_MAX_HEADER_BYTES": str(1 << 20),
        }
    )
    prefix, _ = encode_header([("w", "F32", (4,))], {"pad": "x" * (600 << 10)})  # 600 KiB
    big = prefix + bytes(16)
    held = partial_upload(svc.url, "big-0", 1, big[:-8], len(big), timeout=20)
    try:
        wait_until(lambda: "big-0" in uploading(svc), what="the first big header in flight")
        refused = httpx.post(f"{svc.url}/v1/runs/big-1/checkpoints/1", content=big, timeout=30)
        assert_error(refused, 503, "too_many_uploads")
        assert "CKPTSTORE_MAX_HEADER_BYTES" in refused.json()["error"]["message"]
        prefix, data = valid_body(seed=7)
        small = httpx.post(
            f"{svc.url}/v1/runs/small/checkpoints/1", content=prefix + data, timeout=30
        )
        assert small.status_code == 201, small.text
    finally:
        held.close()
    wait_until(lambda: "big-0" not in uploading(svc), what="the first upload gone")
    again = httpx.post(f"{svc.url}/v1/runs/big-1/checkpoints/1", content=big, timeout=30)
    assert again.status_code == 201, again.text
    assert_nothing_stored(svc, "big-0")
