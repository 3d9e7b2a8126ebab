"""A run name with a ``/`` is refused by the run-name rule, not by routing (issue 18, step 7).

``team/exp1`` reaches the service as ``team%2Fexp1`` (the client quotes it) or as two path
segments; the server decodes either to ``/v1/runs/team/exp1/...``, which no ``{run}`` segment
matched: a 404 "Not Found" that told the user nothing. Every such request must now be the
typed 400 ``invalid_request`` naming the rule, while paths that no route serves stay 404
``not_found`` and wrong methods stay 405. A real service (uvicorn) over raw HTTP; the client
refuses the name itself, before it sends anything.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest
import torch

from ckptstore import CheckpointClient
from ckptstore_core.errors import InvalidRequest
from ckptstore_core.names import RUN_NAME_RULE
from ckptstore_core.wire import encode_header

if TYPE_CHECKING:  # the fixture ``service`` is the conftest's
    from support.serviceproc import Service

PREFIX, _ = encode_header([("w", "U8", [4])], {})
BODY = PREFIX + b"\x01\x02\x03\x04"


@pytest.fixture(scope="module")
def http(service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, timeout=30) as client:
        yield client


def closed_port() -> int:
    """A port nothing listens on (bound, then freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def send(http: httpx.Client, method: str, raw_path: str) -> httpx.Response:
    request = http.build_request(method, raw_path, content=BODY if method == "POST" else None)
    assert request.url.raw_path == raw_path.encode()  # sent as written
    return http.send(request)


def assert_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code, error
    message: str = error["message"]
    return message


SLASHED = {
    "save-quoted": ("POST", "/v1/runs/team%2Fexp1/checkpoints/3"),
    "save-raw": ("POST", "/v1/runs/team/exp1/checkpoints/3"),
    "load-quoted": ("GET", "/v1/runs/team%2Fexp1/checkpoints/3"),
    "load-raw": ("GET", "/v1/runs/team/exp1/checkpoints/3"),
    "load-latest": ("GET", "/v1/runs/team/exp1/checkpoints/latest"),
    "list-quoted": ("GET", "/v1/runs/team%2Fexp1/checkpoints"),
    "list-raw": ("GET", "/v1/runs/team/exp1/checkpoints"),
}


@pytest.mark.parametrize(("method", "path"), SLASHED.values(), ids=SLASHED.keys())
def test_a_slash_in_the_run_is_invalid_request(http: httpx.Client, method: str, path: str) -> None:
    message = assert_error(send(http, method, path), 400, "invalid_request")
    assert message == f"invalid run name 'team/exp1': {RUN_NAME_RULE}"


OTHER_BAD_RUNS = {
    "dotdot-slash": ("POST", "/v1/runs/%2E%2E%2Fx/checkpoints/1", "'../x'"),
    "deep": ("GET", "/v1/runs/a/b/c/checkpoints", "'a/b/c'"),
    "empty": ("POST", "/v1/runs//checkpoints/1", "''"),
    "empty-list": ("GET", "/v1/runs//checkpoints", "''"),
    # no route serves these paths, but their run is named, and named wrong
    "unrouted-space": ("GET", "/v1/runs/a%20b/elsewhere", "'a b'"),
    "unrouted-dot": ("POST", "/v1/runs/.hidden/x/y", "'.hidden'"),
}


@pytest.mark.parametrize(("method", "path", "named"), OTHER_BAD_RUNS.values(), ids=OTHER_BAD_RUNS)
def test_bad_runs_anywhere_under_runs(
    http: httpx.Client, method: str, path: str, named: str
) -> None:
    message = assert_error(send(http, method, path), 400, "invalid_request")
    assert message == f"invalid run name {named}: {RUN_NAME_RULE}"


UNKNOWN = ["/nowhere", "/v1/nowhere", "/v1/runs/team/exp1", "/v1/runs/ok/x/y"]


@pytest.mark.parametrize("path", UNKNOWN)
def test_unknown_routes_stay_not_found(http: httpx.Client, path: str) -> None:
    message = assert_error(send(http, "GET", path), 404, "not_found")
    assert message == f"no such resource: {path}"


@pytest.mark.parametrize(
    ("method", "path"),
    # a run's own path exists (GET describes it, DELETE deletes it): other methods are 405
    [
        ("PATCH", "/v1/runs/ok/checkpoints/3"),
        ("PUT", "/v1/runs/ok/checkpoints"),
        ("POST", "/v1/runs/ok"),
        ("GET", "/v1/runs/ok/retention"),
        ("POST", "/v1/runs/ok/checkpoints/3/pin"),
    ],
)
def test_wrong_methods_stay_405(http: httpx.Client, method: str, path: str) -> None:
    answer = send(http, method, path)
    assert_error(answer, 405, "invalid_request")
    # a method the path takes (RFC 9110: a 405 says them; Starlette names the first
    # route's that matched the path), not the one sent
    allowed = {m.strip() for m in answer.headers.get("allow", "").split(",")} - {""}
    assert allowed and method not in allowed, answer.headers


def test_nothing_was_stored_and_good_names_still_work(http: httpx.Client) -> None:
    for method, path in SLASHED.values():
        send(http, method, path)
    assert http.get("/v1/runs").json()["runs"] == []
    assert send(http, "POST", "/v1/runs/team-exp1/checkpoints/3").status_code == 201
    loaded = send(http, "GET", "/v1/runs/team-exp1/checkpoints/3")
    assert loaded.status_code == 200 and loaded.headers["x-ckptstore-step"] == "3"
    assert loaded.content.endswith(b"\x01\x02\x03\x04")
    listed = send(http, "GET", "/v1/runs/team-exp1/checkpoints").json()
    assert [c["step"] for c in listed["checkpoints"]] == [3]


def test_client_refuses_before_sending() -> None:
    """Nothing listens on this port: had the client sent anything, it would have raised
    ServiceUnavailable (after its retries), not InvalidRequest."""
    state = {"w": torch.zeros(2)}
    with CheckpointClient(f"http://127.0.0.1:{closed_port()}", retries=0) as client:
        for call in (
            lambda: client.save("team/exp1", 1, state),
            lambda: client.load("team/exp1"),
            lambda: client.load("team/exp1", 3),
            lambda: client.list("team/exp1"),
        ):
            with pytest.raises(InvalidRequest) as info:
                call()
            assert str(info.value) == f"invalid run name 'team/exp1': {RUN_NAME_RULE}"


def test_client_and_service_agree(service: Service) -> None:
    with CheckpointClient(service.url) as client:
        client.save("agree.run_1", 1, {"w": torch.arange(4)})
        assert torch.equal(client.load("agree.run_1")["w"], torch.arange(4))
        with pytest.raises(InvalidRequest):
            client.save("agree/run", 1, {"w": torch.arange(4)})
