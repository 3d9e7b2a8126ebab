"""Slow and silent clients against a real service: a body that stalls or crawls is cut with
``408 request_timeout`` and frees the run's lock and its upload slot; a client that sends
only its request's headers holds no slot (issue 21: "slow clients starve everyone")."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ckptstore import CheckpointClient
from support.bodies import assert_nothing_stored, partial_upload, read_response, valid_body
from support.serviceproc import Service

LIMITS = {
    "CKPTSTORE_UPLOAD_IDLE_TIMEOUT_S": "1.5",
    "CKPTSTORE_UPLOAD_MIN_RATE_BYTES_S": "1000",
    "CKPTSTORE_UPLOAD_RATE_WINDOW_S": "1",
    "CKPTSTORE_MAX_CONCURRENT_UPLOADS": "2",
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
