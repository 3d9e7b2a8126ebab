"""Invariant 6 (docs/architecture.md): bad input gets a clear 4xx and costs nothing.

Every case talks raw HTTP to a real service (uvicorn child process): httpx where it can build
the request, a plain socket where the request itself must be malformed (a Content-Length that
lies, a client that hangs up in the middle of the body). Each case checks the exact status and
error code, that the service still answers, and that no checkpoint of the run appeared.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import quote

import httpx
import pytest

from ckptstore_core.wire import encode_header
from support.bodies import (
    TENSORS,
    B,
    W,
    assert_error,
    assert_nothing_stored,
    chunked,
    client_for,
    data_for,
    framed,
    meta_for,
    partial_upload,
    post,
    read_response,
    stored_data,
    uploading,
    valid_body,
    wait_consumed,
)
from support.serviceproc import Service
from support.waiting import eventually, poll, wait_until

MiB = 1 << 20
META = meta_for("w", "b")
DATA = data_for(56)  # TENSORS' data


def tensors(**changes: object) -> bytes:
    """A header with tensors w and b, where ``changes`` replaces whole entries."""
    return framed({"__metadata__": META, "w": W, "b": B, **changes}, DATA)


def w_with(**fields: object) -> bytes:
    """A header whose tensor w has some fields replaced (or removed when None)."""
    w = {k: v for k, v in {**W, **fields}.items() if v is not None}
    return framed({"__metadata__": META, "w": w, "b": B}, DATA)


# -- malformed bodies --------------------------------------------------------------------------

PREFIX, GOOD = valid_body()
BODY = PREFIX + GOOD


@dataclass(frozen=True)
class Bad:
    content: bytes | Callable[[], Iterator[bytes]]
    status: int = 400
    code: str = "invalid_stream"


BAD_BODIES = {
    # truncation and framing
    "truncated-chunked": Bad(chunked(PREFIX + GOOD[: len(GOOD) // 2])),
    "truncated-content-length": Bad(PREFIX + GOOD[: len(GOOD) // 2]),
    "truncated-in-header-chunked": Bad(chunked(PREFIX[: len(PREFIX) // 2])),
    "empty-body": Bad(b""),
    "shorter-than-length-prefix": Bad(b"\x10\x00\x00"),
    "header-length-beyond-body": Bad(framed({"w": W}, length=4096)),
    "header-length-2-40": Bad(struct.pack("<Q", 2**40) + b"{}      ", 413, "payload_too_large"),
    # no header is 16 EiB long: these 8 bytes are not a length (another format's, garbage)
    "header-length-2-64-minus-1": Bad(b"\xff" * 8 + b"{}      ", 400, "invalid_stream"),
    "header-length-over-limit": Bad(
        struct.pack("<Q", 100 * MiB + 1) + b"{}", 413, "payload_too_large"
    ),
    "header-length-0": Bad(struct.pack("<Q", 0) + DATA),
    "header-length-1": Bad(struct.pack("<Q", 1) + b"{" + DATA),
    "body-longer-chunked": Bad(chunked(BODY + b"\x00" * 8)),
    "body-longer-content-length": Bad(BODY + b"\x00" * 8),
    "no-tensors-but-data": Bad(framed({"__metadata__": META}, b"\x00" * 8)),
    "total-over-upload-limit": Bad(
        framed({"w": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}),
        413,
        "payload_too_large",
    ),
    # the header JSON itself
    "header-not-json": Bad(framed(b"this is not json", DATA)),
    "header-invalid-utf8": Bad(framed(b'{"w\xff\xfe":1}', DATA)),
    "header-truncated-json": Bad(framed(b'{"w": {"dtype": "F32"', DATA)),
    "header-is-list": Bad(framed([W, B], DATA)),
    "header-is-string": Bad(framed("w", DATA)),
    "header-is-null": Bad(framed(None, DATA)),
    # an integer past int()'s 4300-digit limit; JSON nested past the recursion limit
    "header-huge-integer": Bad(
        framed(b'{"w":{"dtype":"F32","shape":[' + b"1" * 5000 + b'],"data_offsets":[0,4]}}')
    ),
    "header-deeply-nested": Bad(framed(b'{"w":' + b"[" * 100_000 + b"]" * 100_000 + b"}")),
    # tensor entries
    "tensor-not-object": Bad(tensors(w=[0, 24])),
    "tensor-empty-name": Bad(framed({"": W, "b": B}, DATA)),
    "missing-dtype": Bad(w_with(dtype=None)),
    "missing-shape": Bad(w_with(shape=None)),
    "missing-offsets": Bad(w_with(data_offsets=None)),
    "extra-key": Bad(w_with(strides=[3, 1])),
    "dtype-F128": Bad(w_with(dtype="F128"), 400, "unsupported_dtype"),
    "dtype-lowercase": Bad(w_with(dtype="f32"), 400, "unsupported_dtype"),
    "dtype-not-string": Bad(w_with(dtype=4)),
    "shape-negative": Bad(w_with(shape=[-2, -3])),
    "shape-float": Bad(w_with(shape=[2.0, 3])),
    "shape-bool": Bad(w_with(shape=[True, 6], data_offsets=[0, 24])),
    "shape-string": Bad(w_with(shape=["2", 3])),
    "shape-not-list": Bad(w_with(shape="2x3")),
    "shape-null-dim": Bad(w_with(shape=[None, 3])),
    "shape-65-dims": Bad(w_with(shape=[1] * 65, data_offsets=[0, 4])),
    # offsets
    "offsets-overlap": Bad(tensors(b={**B, "data_offsets": [16, 48]})),
    "offsets-gap": Bad(tensors(b={**B, "data_offsets": [32, 64]})),
    "offsets-start-nonzero": Bad(
        tensors(w={**W, "data_offsets": [8, 32]}, b={**B, "data_offsets": [32, 64]})
    ),
    "offsets-disagree-with-shape": Bad(w_with(data_offsets=[0, 20])),
    "offsets-reversed": Bad(w_with(data_offsets=[24, 0])),
    "offsets-negative": Bad(w_with(data_offsets=[-24, 0])),
    "offsets-three": Bad(w_with(data_offsets=[0, 12, 24])),
    "offsets-bool": Bad(
        framed({"w": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, b"\x00")
    ),
    "offsets-float": Bad(w_with(data_offsets=[0, 24.0])),
    # __metadata__
    "metadata-int-value": Bad(tensors(__metadata__={"format": 1})),
    "metadata-nested": Bad(tensors(__metadata__={"format": {"v": "1"}})),
    "metadata-list": Bad(tensors(__metadata__=["format", "ckptstore/1"])),
    "metadata-null": Bad(tensors(__metadata__=None)),
}


@pytest.mark.parametrize(("name", "case"), BAD_BODIES.items(), ids=BAD_BODIES.keys())
def test_bad_body_is_rejected_and_leaves_nothing(service: Service, name: str, case: Bad) -> None:
    run = f"bad-{name}"
    response = post(service, run, "1", case.content)
    assert_error(response, case.status, case.code)
    assert_nothing_stored(service, run)


# -- bad runs and steps in the path ------------------------------------------------------------


@dataclass(frozen=True)
class BadPath:
    path: str  # raw, already percent-encoded
    status: int
    code: str
    absent: tuple[str, ...]  # run names that must not appear
    method: str = "POST"


BAD_PATHS = {
    # run names
    "run-dotdot-slash": BadPath(
        "/v1/runs/%2E%2E%2Fx/checkpoints/1", 400, "invalid_request", ("x", "../x")
    ),
    "run-dotdot": BadPath("/v1/runs/%2E%2E/checkpoints/1", 400, "invalid_request", ("..",)),
    "run-slash": BadPath("/v1/runs/a%2Fb/checkpoints/1", 400, "invalid_request", ("a", "b", "a/b")),
    "run-space": BadPath("/v1/runs/a%20b/checkpoints/1", 400, "invalid_request", ("a b", "a")),
    "run-leading-dash": BadPath(
        "/v1/runs/-start/checkpoints/1", 400, "invalid_request", ("-start",)
    ),
    "run-leading-dot": BadPath(
        "/v1/runs/.hidden/checkpoints/1", 400, "invalid_request", (".hidden",)
    ),
    "run-200-chars": BadPath(
        f"/v1/runs/{'r' * 200}/checkpoints/1", 400, "invalid_request", ("r" * 200, "r" * 128)
    ),
    "run-non-ascii": BadPath("/v1/runs/caf%C3%A9/checkpoints/1", 400, "invalid_request", ("café",)),
    "run-nul": BadPath("/v1/runs/x%00/checkpoints/1", 400, "invalid_request", ("x\x00", "x")),
    "run-empty": BadPath("/v1/runs//checkpoints/1", 400, "invalid_request", ("",)),
    # steps
    "step-negative": BadPath(
        "/v1/runs/step-neg/checkpoints/-1", 400, "invalid_request", ("step-neg",)
    ),
    "step-fraction": BadPath(
        "/v1/runs/step-frac/checkpoints/1.5", 400, "invalid_request", ("step-frac",)
    ),
    "step-word": BadPath(
        "/v1/runs/step-word/checkpoints/abc", 400, "invalid_request", ("step-word",)
    ),
    "step-fullwidth-digit": BadPath(
        "/v1/runs/step-fw/checkpoints/" + quote("\uff11"), 400, "invalid_request", ("step-fw",)
    ),
    "step-plus": BadPath(
        "/v1/runs/step-plus/checkpoints/+1", 400, "invalid_request", ("step-plus",)
    ),
    "step-space": BadPath(
        "/v1/runs/step-space/checkpoints/%201", 400, "invalid_request", ("step-space",)
    ),
    "step-leading-zero": BadPath(
        "/v1/runs/step-zero/checkpoints/05", 400, "invalid_request", ("step-zero",)
    ),
    "step-zeros": BadPath("/v1/runs/step-00/checkpoints/00", 400, "invalid_request", ("step-00",)),
    "step-hex": BadPath("/v1/runs/step-hex/checkpoints/0x1", 400, "invalid_request", ("step-hex",)),
    "step-2-64": BadPath(
        f"/v1/runs/step-264/checkpoints/{2**64}", 400, "invalid_request", ("step-264",)
    ),
    "step-2-63": BadPath(
        f"/v1/runs/step-263/checkpoints/{2**63}", 400, "invalid_request", ("step-263",)
    ),
    # past int()'s 4300-digit limit: must still be a 400, not a 500
    "step-5000-digits": BadPath(
        f"/v1/runs/step-long/checkpoints/{'1' * 5000}", 400, "invalid_request", ("step-long",)
    ),
    "step-latest-on-save": BadPath(
        "/v1/runs/step-latest/checkpoints/latest", 400, "invalid_request", ("step-latest",)
    ),
    "get-step-negative": BadPath(
        "/v1/runs/get-neg/checkpoints/-1", 400, "invalid_request", ("get-neg",), "GET"
    ),
    "get-step-5000-digits": BadPath(
        f"/v1/runs/get-long/checkpoints/{'1' * 5000}", 400, "invalid_request", ("get-long",), "GET"
    ),
    "get-run-dotdot": BadPath(
        "/v1/runs/%2E%2E/checkpoints/latest", 400, "invalid_request", (), "GET"
    ),
    "list-run-space": BadPath("/v1/runs/a%20b/checkpoints", 400, "invalid_request", (), "GET"),
}


@pytest.mark.parametrize("case", BAD_PATHS.values(), ids=BAD_PATHS.keys())
def test_bad_path_is_rejected_and_leaves_nothing(service: Service, case: BadPath) -> None:
    client = client_for(service)
    content = BODY if case.method == "POST" else None
    request = client.build_request(case.method, case.path, content=content)
    assert request.url.raw_path == case.path.encode()  # httpx sends it as written
    response = client.send(request)
    assert_error(response, case.status, case.code)
    assert 400 <= response.status_code < 500
    assert_nothing_stored(service, *case.absent)


def test_get_latest_of_unknown_run(service: Service) -> None:
    response = client_for(service).get("/v1/runs/never-saved/checkpoints/latest")
    assert_error(response, 404, "run_not_found")
    response = client_for(service).get("/v1/runs/never-saved/checkpoints/3")
    assert_error(response, 404, "run_not_found")
    assert_nothing_stored(service, "never-saved")


def test_only_canonical_steps_name_a_checkpoint(service: Service) -> None:
    """``05``, ``+5``, `` 5`` and ``5 `` are not step 5: every route that takes a step refuses
    them (400) and touches nothing; ``0`` is step 0."""
    prefix, data = valid_body(seed=4)
    assert post(service, "canonical", "5", prefix + data).status_code == 201
    assert post(service, "canonical", "0", prefix + data).status_code == 201
    client = client_for(service)
    for step in ("05", "005", "+5", "%205", "5%20", "%2B5"):
        for method, suffix in [
            ("GET", ""),
            ("GET", "/info"),
            ("DELETE", ""),
            ("PUT", "/pin"),
            ("PUT", "/parts/rank-0"),
            ("POST", "/commit"),
        ]:
            path = f"/v1/runs/canonical/checkpoints/{step}{suffix}"
            response = client.send(client.build_request(method, path, content=b"{}"))
            assert_error(response, 400, "invalid_request")
    assert stored_data(service, "canonical", "5") == data
    assert stored_data(service, "canonical", "0") == data


def test_get_missing_step_of_existing_run(service: Service) -> None:
    prefix, data = valid_body(seed=3)
    assert post(service, "has-one", "5", prefix + data).status_code == 201
    response = client_for(service).get("/v1/runs/has-one/checkpoints/6")
    assert_error(response, 404, "checkpoint_not_found")
    response = client_for(service).get("/v1/runs/has-one/checkpoints/4")
    assert_error(response, 404, "checkpoint_not_found")
    assert stored_data(service, "has-one", "latest") == data
    assert service.healthy()


# -- Content-Length that lies, clients that hang up --------------------------------------------


def test_content_length_smaller_than_header_says(service: Service) -> None:
    short = BODY[:-16]
    with partial_upload(service.url, "cl-short", 1, short, len(short), timeout=10) as sock:
        status, body = read_response(sock, timeout=10)
    assert status == 400
    assert body["error"]["code"] == "invalid_stream" and body["error"]["message"]
    assert_nothing_stored(service, "cl-short")


@pytest.mark.timing
def test_rejection_does_not_wait_for_a_body_that_never_comes(service: Service) -> None:
    """The client sends part of what its Content-Length announces, then waits for the answer.

    * ``cl-long``: the whole body the header describes arrives, but Content-Length promises
      100 more bytes that never come;
    * ``huge-wait``: only the 8-byte length prefix (2**40) of a body announced as 1 GiB.

    The service knows at once that the upload is bad, so it must answer (it may drain a
    rejected body, for at most 5 s) rather than wait for bytes that will never come. Both
    clients wait side by side, so the test costs one timeout, not two.
    """
    uploads = {
        "cl-long": (len(BODY) + 100, BODY),
        "huge-wait": (1 << 30, struct.pack("<Q", 2**40)),
    }
    expected = {"cl-long": (400, "invalid_stream"), "huge-wait": (413, "payload_too_large")}
    socks = {
        run: partial_upload(service.url, run, 1, sent, length, timeout=10)
        for run, (length, sent) in uploads.items()
    }
    deadline = time.monotonic() + 6.5
    answers: dict[str, object] = {}
    for run, sock in socks.items():
        with sock:
            try:
                status, body = read_response(sock, max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                answers[run] = "no answer within 6.5 s"
                continue
        error = body["error"]
        assert isinstance(error, dict) and error["message"]
        answers[run] = (status, error["code"])
    assert answers == expected
    assert_nothing_stored(service, *uploads)


BIG = [("big", "U8", [8 * MiB])]

HANGUPS = {
    "in-length-prefix": (TENSORS, 4),
    "in-header": (TENSORS, len(PREFIX) // 2),
    "after-header": (TENSORS, len(PREFIX)),
    "half-of-data": (TENSORS, len(PREFIX) + len(GOOD) // 2),
    "5-of-8-MiB": (BIG, 5 * MiB),
}


@pytest.mark.parametrize(
    ("name", "layout", "sent"), [(k, *v) for k, v in HANGUPS.items()], ids=HANGUPS.keys()
)
def test_client_disconnects_mid_upload(
    service: Service, name: str, layout: list[tuple[str, str, list[int]]], sent: int
) -> None:
    run = f"hangup-{name}"
    prefix, data = valid_body(seed=5, tensors=layout)
    body = prefix + data
    sock = partial_upload(service.url, run, 1, body[:sent], len(body), timeout=10)
    wait_consumed(sock)  # the service has read all that was sent, and waits for the rest
    if sent > len(prefix):  # it has data: the upload is in progress (after its header alone
        # it takes nothing: no lock, no row, ckptstore_service.save.header.wait_for_data)
        wait_until(lambda: run in uploading(service), what=f"the upload of {run} began")
    sock.close()  # no response to read: the client is gone

    def nothing_left() -> None:
        assert_nothing_stored(service, run)
        assert os.listdir(service.data_dir / "blobs" / ".tmp") == []  # no half-written blob

    eventually(nothing_left)
    # the aborted upload released the run lock and the step: a retry is a fresh save
    response = post(service, run, "1", body)
    assert response.status_code == 201, response.text
    assert stored_data(service, run, 1) == data


# -- the same step twice -----------------------------------------------------------------------


def test_same_step_same_content_is_idempotent(service: Service) -> None:
    prefix, data = valid_body(seed=7)
    first = post(service, "twice-same", "10", prefix + data)
    assert first.status_code == 201, first.text
    again = post(service, "twice-same", "10", chunked(prefix + data, 5))
    assert again.status_code == 200, again.text
    assert again.json() == first.json()
    checkpoints = client_for(service).get("/v1/runs/twice-same/checkpoints").json()
    assert [c["step"] for c in checkpoints["checkpoints"]] == [10]


CONFLICTS = {
    "different-data": lambda: b"".join(valid_body(seed=8)),
    "different-shape": lambda: b"".join(
        valid_body(seed=7, tensors=[("w", "F32", [3, 2]), ("b", "I64", [4])])
    ),
    "different-metadata": lambda: (
        encode_header(TENSORS, meta_for("b", "w"))[0] + valid_body(seed=7)[1]
    ),
    "extra-tensor": lambda: b"".join(valid_body(seed=7, tensors=[*TENSORS, ("c", "U8", [1])])),
}


@pytest.mark.parametrize(("name", "other"), CONFLICTS.items(), ids=CONFLICTS.keys())
def test_same_step_different_content_conflicts(
    service: Service, name: str, other: Callable[[], bytes]
) -> None:
    run = f"twice-{name}"
    prefix, data = valid_body(seed=7)
    first = post(service, run, "10", prefix + data)
    assert first.status_code == 201, first.text
    response = post(service, run, "10", other())
    assert_error(response, 409, "checkpoint_exists")
    assert service.healthy()
    assert stored_data(service, run, 10) == data
    assert stored_data(service, run, "latest") == data
    listed = client_for(service).get(f"/v1/runs/{run}/checkpoints").json()
    assert [c["step"] for c in listed["checkpoints"]] == [10]
    assert listed["checkpoints"][0] == first.json()


def test_bad_retry_of_existing_step_is_still_rejected_as_bad(service: Service) -> None:
    prefix, data = valid_body(seed=9)
    assert post(service, "twice-bad", "1", prefix + data).status_code == 201
    response = post(service, "twice-bad", "1", chunked(prefix + data[:10]))
    assert_error(response, 400, "invalid_stream")
    assert stored_data(service, "twice-bad", 1) == data


# -- volume ------------------------------------------------------------------------------------


def test_many_bad_requests_cost_nothing(service: Service) -> None:
    crashers = {"header-huge-integer", "header-deeply-nested"}  # 500s, checked above
    cases = [c for k, c in BAD_BODIES.items() if k not in crashers]
    big_prefix, big_data = valid_body(seed=2, tensors=[("big", "U8", [2 * MiB])])
    heavy = [
        big_prefix + big_data[:MiB],  # truncated
        big_prefix + big_data + b"\x00",  # one byte too many
        framed(b" " * (4 * MiB)),  # 4 MiB of header that is not JSON
    ]

    def burst(n: int) -> None:
        for i in range(n):
            if i % 5 == 4:
                response = post(service, f"many-{i}", "1", heavy[i % len(heavy)])
            else:
                case = cases[i % len(cases)]
                response = post(service, f"many-{i}", "1", case.content)
            assert 400 <= response.status_code < 500, response.text

    burst(10)  # warm up allocator and caches
    before = service.rss_bytes()
    burst(50)
    assert service.rss_bytes() - before < 50 * MiB
    assert_nothing_stored(service, *(f"many-{i}" for i in range(50)))


def test_stalled_uploads_do_not_starve_the_service(make_service: Callable[..., Service]) -> None:
    """45 clients each send the header and then stall (then hang up): slow or dead clients must
    not take the service down, neither while they stall nor after they disconnect. 45 is more
    than the 40 worker threads anyio lends by default (shared by every ``to_thread`` call).
    They stand for 45 clients: each may take an upload slot (one address has half by
    default, CKPTSTORE_MAX_UPLOADS_PER_CLIENT)."""
    svc = make_service({"CKPTSTORE_MAX_UPLOADS_PER_CLIENT": "64"})
    prefix, data = valid_body(seed=4)
    body = prefix + data
    socks = [
        partial_upload(svc.url, f"stall-{i}", 1, body[: len(prefix) + 8], len(body), timeout=10)
        for i in range(45)
    ]

    def answers() -> bool:
        try:
            return httpx.get(f"{svc.url}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        # every upload has begun: the service waits for the rest of 45 bodies
        wait_until(lambda: len(uploading(svc)) == 45, what="45 uploads began")
        healthy_while_stalled = answers()
    finally:
        for sock in socks:
            sock.close()
    healthy_after = poll(answers, 3, interval=0.2)
    if not healthy_after:
        svc.kill()  # wedged: do not wait for a graceful stop
    assert healthy_while_stalled, "healthz hung while 45 uploads were stalled"
    assert healthy_after, "service still wedged 3 s after the stalled clients hung up"
    assert_nothing_stored(svc, *(f"stall-{i}" for i in range(45)))
