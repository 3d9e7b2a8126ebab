"""Bearer tokens against a real service with CKPTSTORE_AUTH=on (docs/security.md).

Every guarded route, with no token, a wrong one, a revoked one, one whose scope is too low
and one whose run pattern does not cover the run, is refused with its typed error, and
nothing is read (the answer is the error alone) or written (the catalog's listings and the
tokens are unchanged); the least token that should pass, passes. The tokens come from the
service's own command (a real subprocess) and the admin HTTP API; the client, the user
command, the DCP writer's options and the dashboard's sign-in carry them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pickle
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from ckptstore import CheckpointClient
from ckptstore.parts import commit, put_part
from ckptstore_core.errors import Forbidden, Unauthorized
from ckptstore_service.api.auth import PUBLIC, ROUTE_ACCESS, leaf_routes, route_keys
from ckptstore_service.app import create_app
from ckptstore_service.cli import main as service_main
from ckptstore_service.settings import Settings
from support.bodies import read_response, valid_body
from support.serviceproc import Service

_RUNS = "/v1/runs/{run:path}/checkpoints"
_STEP = _RUNS + "/{step}"
#: the routes of this app (the set of routes may grow: each must have a request below)
APP_KEYS = {
    key
    for route in leaf_routes(create_app(Settings(data_dir=Path("unused"))).routes)
    for key in route_keys(route)
}
WRONG = "ckpt_" + "A" * 43
STATE = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}


@dataclass(frozen=True)
class Call:
    """One request to a route, on the run ``{run}``."""

    method: str
    path: str
    json: object = None
    body: bytes | None = None

    def send(self, http: httpx.Client, run: str, token: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return http.request(
            self.method,
            self.path.format(run=run),
            json=self.json,
            content=self.body,
            headers=headers,
        )


_SAVE = b"".join(valid_body())
#: a request for every guarded route (refused ones never reach the route: any valid shape)
CALLS: dict[tuple[str, str], Call] = {
    ("GET", "/v1/runs"): Call("GET", "/v1/runs"),
    ("GET", _RUNS): Call("GET", "/v1/runs/{run}/checkpoints"),
    ("GET", _STEP): Call("GET", "/v1/runs/{run}/checkpoints/1"),
    ("GET", _STEP + "/info"): Call("GET", "/v1/runs/{run}/checkpoints/1/info"),
    ("POST", _STEP + "/select"): Call(
        "POST", "/v1/runs/{run}/checkpoints/1/select", json={"names": ["w"]}
    ),
    ("POST", _STEP): Call("POST", "/v1/runs/{run}/checkpoints/7", body=_SAVE),
    ("PUT", _STEP + "/parts/{part}"): Call(
        "PUT", "/v1/runs/{run}/checkpoints/8/parts/rank-0", body=_SAVE
    ),
    ("POST", _STEP + "/parts/{part}/check"): Call(
        "POST", "/v1/runs/{run}/checkpoints/8/parts/rank-0/check", json={"header": "{}"}
    ),
    ("POST", _STEP + "/commit"): Call(
        "POST", "/v1/runs/{run}/checkpoints/1/commit", json={"parts": ["rank-0"]}
    ),
    # a direct writer's plan (the parent's rows) and its encoded part
    ("POST", _STEP + "/plan"): Call(
        "POST", "/v1/runs/{run}/checkpoints/9/plan", json={"names": ["w"]}
    ),
    ("PUT", _STEP + "/parts/{part}/encoded"): Call(
        "PUT", "/v1/runs/{run}/checkpoints/9/parts/rank-0/encoded", body=_SAVE
    ),
    # a direct writer's presigned upload (a store without URLs answers 400) and its rows
    ("POST", _STEP + "/parts/{part}/upload"): Call(
        "POST", "/v1/runs/{run}/checkpoints/9/parts/rank-0/upload", json={"max_bytes": 10}
    ),
    ("POST", _STEP + "/parts/{part}/uploaded"): Call(
        "POST",
        "/v1/runs/{run}/checkpoints/9/parts/rank-0/uploaded",
        json={"key": "k", "upload_id": "u", "header": "{}", "sizes": [], "tail": {}},
    ),
    # a direct reader's layout and the ranges of its blobs
    ("POST", _STEP + "/ranges"): Call("POST", "/v1/runs/{run}/checkpoints/1/ranges", json={}),
    ("GET", _STEP + "/blobs/{index}"): Call(
        "GET", "/v1/runs/{run}/checkpoints/1/blobs/0?start=0&end=1"
    ),
    ("DELETE", _STEP): Call("DELETE", "/v1/runs/{run}/checkpoints/1"),
    ("DELETE", "/v1/runs/{run}"): Call("DELETE", "/v1/runs/{run}"),
    ("GET", "/v1/runs/{run}"): Call("GET", "/v1/runs/{run}"),
    ("PUT", _STEP + "/pin"): Call("PUT", "/v1/runs/{run}/checkpoints/1/pin"),
    ("DELETE", _STEP + "/pin"): Call("DELETE", "/v1/runs/{run}/checkpoints/1/pin"),
    ("PUT", "/v1/runs/{run:path}/retention"): Call(
        "PUT", "/v1/runs/{run}/retention", json={"keep_last": 1}
    ),
    ("DELETE", "/v1/runs/{run:path}/retention"): Call("DELETE", "/v1/runs/{run}/retention"),
    ("POST", "/v1/runs/{run:path}/fork"): Call(
        "POST", "/v1/runs/{run}/fork", json={"from_run": "team-b-1", "from_step": 1}
    ),
    ("GET", "/v1/tokens"): Call("GET", "/v1/tokens"),
    ("POST", "/v1/tokens"): Call("POST", "/v1/tokens", json={"name": "x", "scope": "admin"}),
    ("DELETE", "/v1/tokens/{token}"): Call("DELETE", "/v1/tokens/admin"),
    ("GET", "/metrics"): Call("GET", "/metrics"),
    ("GET", "/ui"): Call("GET", "/ui"),
    ("GET", "/ui/runs/{run:path}"): Call("GET", "/ui/runs/{run}"),
}
GUARDED = sorted(key for key in APP_KEYS if ROUTE_ACCESS.get(key, PUBLIC) != PUBLIC)
#: the token a bit short of each scope, with every run; and the one of that scope that
#: covers only team-a-*
BELOW = {"write": "reader", "admin": "writer"}
PATTERNED = {"read": "reader-a", "write": "writer-a", "admin": "admin-a"}


def service_cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``ckptstore-service ARGS`` on the service's data folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSTORE_")}
    return subprocess.run(
        [sys.executable, "-m", "ckptstore_service.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "CKPTSTORE_DATA_DIR": str(data_dir)},
    )


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with Service(tmp_path_factory.mktemp("auth"), {"CKPTSTORE_AUTH": "on"}) as service:
        yield service


@pytest.fixture(scope="module")
def tokens(svc: Service) -> dict[str, str]:
    """The admin token from the service's command (the bootstrap), the others from the
    HTTP API; "revoked" is revoked at once. Two runs saved: team-a-1 and team-b-1."""
    made = service_cli(svc.data_dir, "token", "create", "admin", "--scope", "admin", "--runs", "*")
    assert made.returncode == 0, made.stderr
    out = {"admin": made.stdout.strip()}
    with httpx.Client(base_url=svc.url, headers=_bearer(out["admin"])) as http:
        for name, scope, runs in [
            ("reader", "read", "*"),
            ("writer", "write", "*"),
            ("reader-a", "read", "team-a-*"),
            ("writer-a", "write", "team-a-*"),
            ("admin-a", "admin", "team-a-*"),
            ("revoked", "admin", "*"),
        ]:
            answer = http.post("/v1/tokens", json={"name": name, "scope": scope, "runs": runs})
            assert answer.status_code == 201, answer.text
            out[name] = answer.json()["token"]
        assert http.delete("/v1/tokens/revoked").status_code == 200
    with CheckpointClient(svc.url, token=out["admin"]) as client:
        for run in ("team-a-1", "team-b-1"):
            client.save(run, 1, STATE)
    return out


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _snapshot(svc: Service, admin: str) -> list[object]:
    """What a refused request must leave as it was: the runs, a run's checkpoints, the
    tokens (revoked ones too)."""
    with httpx.Client(base_url=svc.url, headers=_bearer(admin)) as http:
        paths = ("/v1/runs", "/v1/runs/team-b-1/checkpoints", "/v1/tokens?revoked=true")
        answers = [http.get(path) for path in paths]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return [a.json() for a in answers]


def _assert_refused(response: httpx.Response, status: int, html: bool, case: str) -> None:
    if html and case.endswith(": no token"):  # a first visit: to the sign-in page (200)
        assert response.status_code == 303, (case, response.text)
        assert response.headers["location"] == "/ui/login", case
        return
    assert response.status_code == status, (case, response.text)
    assert "WWW-Authenticate" in response.headers, case
    if html:  # a dashboard page: the sign-in form or an HTML 403, not JSON
        assert response.headers["content-type"].startswith("text/html"), case
        assert ("<form" in response.text) is (status == 401), case
    else:
        code = "unauthorized" if status == 401 else "forbidden"
        assert response.json()["error"]["code"] == code, (case, response.text)
        assert set(response.json()) == {"error"}, case  # the error, and nothing else


def test_every_guarded_route_is_tried_here() -> None:
    assert len(GUARDED) >= 14
    assert [key for key in GUARDED if key not in CALLS] == []


@pytest.mark.parametrize("key", GUARDED, ids=[f"{m} {p}" for m, p in GUARDED])
def test_refused_without_the_right_token_and_nothing_changes(
    svc: Service, tokens: dict[str, str], key: tuple[str, str]
) -> None:
    access = ROUTE_ACCESS[key]
    assert access.scope is not None
    call = CALLS[key]
    cases: list[tuple[str, str | None, int]] = [
        ("no token", None, 401),
        ("a wrong token", WRONG, 401),
        ("a revoked token", tokens["revoked"], 401),
    ]
    if access.scope in BELOW:
        cases.append(("a token of a lower scope", tokens[BELOW[access.scope]], 403))
    if access.run or access.all_runs:
        cases.append(("a token for other runs", tokens[PATTERNED[access.scope]], 403))
    before = _snapshot(svc, tokens["admin"])
    with httpx.Client(base_url=svc.url) as http:
        for case, token, status in cases:
            response = call.send(http, "team-b-1", token)
            _assert_refused(response, status, access.html, f"{key}: {case}")
            if call.body is not None or call.json is not None:  # its body is never read
                assert response.headers["connection"] == "close", (key, case)
    assert _snapshot(svc, tokens["admin"]) == before


def test_a_refused_save_is_answered_before_its_body_is_read(
    svc: Service, tokens: dict[str, str]
) -> None:
    # 64 MiB announced, 100 bytes sent: the 401 comes without the service waiting for more
    sock = socket.create_connection(("127.0.0.1", svc.port), timeout=10)
    try:
        sock.sendall(
            b"POST /v1/runs/team-b-1/checkpoints/9 HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + WRONG.encode() + b"\r\n"
            b"Content-Length: 67108864\r\n\r\n" + _SAVE[:100]
        )
        status, body = read_response(sock, timeout=10)
        # and the connection closes: the client stops sending at once (a refused 1 GiB save
        # returned in 2-30 ms, against 230-270 ms to send it all over loopback)
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
    finally:
        sock.close()
    assert status == 401 and body["error"]["code"] == "unauthorized"  # type: ignore[index]
    assert closed
    with CheckpointClient(svc.url, token=tokens["reader"]) as client:
        assert [c.step for c in client.list("team-b-1")] == [1]


def test_a_fork_needs_read_on_its_source(svc: Service, tokens: dict[str, str]) -> None:
    """Write on the new run (the middleware) and read on the source (the route): a writer of
    team-a-* forks team-a-1, not team-b-1, and a refused fork makes no run."""
    with httpx.Client(base_url=svc.url, headers=_bearer(tokens["writer-a"])) as http:
        body = {"from_run": "team-b-1", "from_step": 1}
        refused = http.post("/v1/runs/team-a-fork/fork", json=body)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "forbidden"
        assert "team-b-1" in refused.json()["error"]["message"]
        assert http.get("/v1/runs/team-a-fork").status_code == 404
        body = {"from_run": "team-a-1", "from_step": 1}
        assert http.post("/v1/runs/team-a-fork/fork", json=body).status_code == 201
    with CheckpointClient(svc.url, token=tokens["reader-a"]) as reader:
        loaded = reader.load("team-a-fork", 1)
        assert all(torch.equal(loaded[k], STATE[k]) for k in STATE)
    with CheckpointClient(svc.url, token=tokens["admin"]) as admin:
        admin.delete_run("team-a-fork")  # the module's other tests know two runs


def test_the_least_token_that_should_pass_passes(svc: Service, tokens: dict[str, str]) -> None:
    reader_a = CheckpointClient(svc.url, token=tokens["reader-a"])
    writer_a = CheckpointClient(svc.url, token=tokens["writer-a"])
    with reader_a, writer_a:
        # a pattern lists only the runs it covers
        assert {r.name for r in reader_a.runs()} == {"team-a-1"}
        assert [c.step for c in reader_a.list("team-a-1")] == [1]
        loaded = reader_a.load("team-a-1", 1)
        assert all(torch.equal(loaded[k], STATE[k]) for k in STATE)
        assert writer_a.save("team-a-2", 1, STATE).step == 1
        put_part(
            writer_a, "team-a-3", 1, "rank-0", [("w", "F32", (4,))], lambda: iter([b"\0" * 16])
        )
        assert commit(writer_a, "team-a-3", 1, ["rank-0"], {})["step"] == 1
        put_part(
            writer_a, "team-a-3", 2, "rank-0", [("w", "F32", (4,))], lambda: iter([b"\1" * 16]),
            direct=True,
        )  # fmt: skip
        assert commit(writer_a, "team-a-3", 2, ["rank-0"], {})["step"] == 2
    with httpx.Client(base_url=svc.url, headers=_bearer(tokens["reader-a"])) as http:
        assert http.get("/v1/runs/team-a-1/checkpoints/1/info").status_code == 200
        selected = http.post("/v1/runs/team-a-1/checkpoints/1/select", json={"names": ["w"]})
        assert selected.status_code == 200
        runs_page = http.get("/ui")
        assert runs_page.status_code == 200 and "team-a-1" in runs_page.text
        assert "team-b-1" not in runs_page.text
        assert http.get("/ui/runs/team-a-1").status_code == 200
    with httpx.Client(base_url=svc.url, headers=_bearer(tokens["reader"])) as http:
        assert http.get("/metrics").status_code == 200
    with httpx.Client(base_url=svc.url, headers=_bearer(tokens["admin-a"])) as http:
        if ("DELETE", _STEP) in APP_KEYS:
            assert http.delete("/v1/runs/team-a-2/checkpoints/1").status_code == 204
        if ("DELETE", "/v1/runs/{run}") in APP_KEYS:
            assert http.delete("/v1/runs/team-a-3").status_code == 204
    with httpx.Client(base_url=svc.url, headers=_bearer(tokens["admin"])) as http:
        made = http.post("/v1/tokens", json={"name": "short", "scope": "read", "runs": "x-*"})
        assert made.status_code == 201 and made.json()["info"]["runs"] == "x-*"
        listed = http.get("/v1/tokens").json()["tokens"]
        assert "short" in {t["name"] for t in listed}
        assert all("token" not in t for t in listed)  # never a secret
        assert http.delete("/v1/tokens/short").status_code == 200
        assert http.delete("/v1/tokens/short").status_code == 404


@pytest.mark.parametrize(
    "key",
    [
        "9" * 30,  # digits beyond any integer column (was a 500: OverflowError)
        "%C2%B3",  # "³": isdigit() says yes, int() says no (was a 500: ValueError)
        "%D9%A3",  # an Arabic-Indic 3, likewise
    ],
)
def test_revoking_a_token_that_no_key_names_is_a_404(
    svc: Service, tokens: dict[str, str], key: str
) -> None:
    with httpx.Client(base_url=svc.url, headers=_bearer(tokens["admin"])) as http:
        before = http.get("/v1/tokens").json()["tokens"]
        answer = http.delete(f"/v1/tokens/{key}")
        assert answer.status_code == 404, answer.text
        assert http.get("/v1/tokens").json()["tokens"] == before  # nothing revoked


@pytest.mark.timing
def test_the_client_raises_the_typed_errors_at_once(svc: Service, tokens: dict[str, str]) -> None:
    # retried, these would take >= 30 s (backoff 10 s)
    started = time.monotonic()
    for token, error, match, call in [
        (WRONG, Unauthorized, "unknown or revoked", lambda c: c.runs()),
        (tokens["reader"], Forbidden, "needs scope write", lambda c: c.save("team-b-1", 2, STATE)),
        (tokens["writer-a"], Forbidden, "not cover run 'team-b-1'", lambda c: c.load("team-b-1")),
    ]:
        client = CheckpointClient(svc.url, token=token, retries=3, backoff=10)
        with client, pytest.raises(error, match=match):
            call(client)
    assert time.monotonic() - started < 5


def test_the_client_and_the_command_send_ckptstore_token(
    svc: Service, tokens: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPTSTORE_TOKEN", raising=False)
    with CheckpointClient(svc.url) as client, pytest.raises(Unauthorized):
        client.runs()
    monkeypatch.setenv("CKPTSTORE_TOKEN", tokens["reader"])
    with CheckpointClient(svc.url) as client:
        assert {"team-a-1", "team-b-1"} <= {r.name for r in client.runs()}

    def user_cli(*args: str, token: str | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "CKPTSTORE_TOKEN"}
        env.update({"CKPTSTORE_URL": svc.url, **({"CKPTSTORE_TOKEN": token} if token else {})})
        command = [sys.executable, "-m", "ckptstore.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)

    refused = user_cli("runs", token=None)
    assert refused.returncode == 1
    assert refused.stderr.startswith("ckptstore: this service requires a token")
    listed = user_cli("ls", "team-a-1", token=tokens["reader"])
    assert listed.returncode == 0, listed.stderr
    made = user_cli(
        "token", "create", "by-cli", "--scope", "write", "--runs", "z-*", token=tokens["admin"]
    )
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip().startswith("ckpt_") and "only time" in made.stderr
    shown = user_cli("token", "list", token=tokens["admin"])
    assert "by-cli" in shown.stdout and made.stdout.strip() not in shown.stdout
    denied = user_cli("token", "list", token=tokens["admin-a"])  # an admin of some runs
    assert denied.returncode == 1 and "limited to some runs" in denied.stderr
    gone = user_cli("token", "revoke", "by-cli", token=tokens["admin"])
    assert gone.returncode == 0, gone.stderr
    with (
        CheckpointClient(svc.url, token=made.stdout.strip()) as client,
        pytest.raises(Unauthorized),
    ):
        client.list("z-1")


def test_token_commands_on_the_database_store_only_hashes(
    svc: Service, tokens: dict[str, str]
) -> None:
    made = service_cli(svc.data_dir, "token", "create", "ops", "--scope", "read", "--runs", "*")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    with CheckpointClient(svc.url, token=secret) as client:
        assert client.list("team-b-1")[0].step == 1  # usable at once

    db = sqlite3.connect(svc.data_dir / "catalog.sqlite3")
    try:
        every_value = repr(db.execute("SELECT * FROM tokens").fetchall())
        hashes = {r[0] for r in db.execute("SELECT secret_hash FROM tokens")}
    finally:
        db.close()
    for token in [secret, *tokens.values()]:
        assert token not in every_value and token[5:20] not in every_value
        assert hashlib.sha256(token.encode()).hexdigest() in hashes

    revoked = service_cli(svc.data_dir, "token", "revoke", "ops")
    assert revoked.returncode == 0 and "revoked token 'ops'" in revoked.stdout
    with CheckpointClient(svc.url, token=secret) as client, pytest.raises(Unauthorized):
        client.list("team-b-1")  # revoked at once, no restart
    listed = service_cli(svc.data_dir, "token", "list", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    assert secret not in listed.stdout
    by_name = {t["name"]: t for t in json.loads(listed.stdout)["tokens"]}
    assert by_name["ops"]["scope"] == "read" and by_name["ops"]["revoked"] is not None
    assert by_name["revoked"]["revoked"] is not None and by_name["admin"]["revoked"] is None
    assert by_name["reader-a"]["runs"] == "team-a-*"


def test_token_command_refusals_name_the_problem(
    svc: Service, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # in-process: the command's messages (the subprocess runs are above)
    monkeypatch.setenv("CKPTSTORE_DATA_DIR", str(svc.data_dir))
    for args, message in [
        (["create", "admin", "--scope", "read", "--runs", "*"], "named 'admin' exists already"),
        (["create", "x", "--scope", "read", "--runs", "a/b"], "invalid run pattern 'a/b'"),
        (["create", "two words", "--scope", "read", "--runs", "*"], "invalid token name"),
        (["revoke", "nobody"], "no token in use is named (or numbered) 'nobody'"),
    ]:
        assert service_main(["token", *args]) == 1, args
        assert message in capsys.readouterr().err, args


def test_the_dashboard_signs_in_with_an_httponly_cookie(
    svc: Service, tokens: dict[str, str]
) -> None:
    with httpx.Client(base_url=svc.url) as http:
        first = http.get("/ui/runs/team-a-1", follow_redirects=True)  # a first visit
        assert first.status_code == 200 and str(first.url).endswith("/ui/login")
        assert "<form" in first.text and 'id="sign-out"' not in first.text
        bad = http.post("/ui/login", data={"token": WRONG})
        assert bad.status_code == 401 and "unknown or revoked" in bad.text
        signed = http.post("/ui/login", data={"token": tokens["reader-a"]})
        assert signed.status_code == 303 and signed.headers["location"] == "/ui"
        cookie = signed.headers["set-cookie"]
        for attribute in ("HttpOnly", "SameSite=Strict", "Path=/ui"):
            assert attribute in cookie
    with httpx.Client(base_url=svc.url, cookies={"ckptstore_token": tokens["reader-a"]}) as http:
        page = http.get("/ui")
        assert page.status_code == 200 and "team-a-1" in page.text
        assert "team-b-1" not in page.text
        other = http.get("/ui/runs/team-b-1")
        assert other.status_code == 403 and "does not cover" in other.text
        # the JSON API never takes the cookie: no cross-site request can use it
        assert http.get("/v1/runs").status_code == 401
        assert 'id="sign-out"' in page.text and 'action="/ui/logout"' in page.text
        out = http.post("/ui/logout")
        assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]


@pytest.mark.parametrize(
    ("args", "env", "status"),
    [
        ([], {}, 200),  # the default: 127.0.0.1, open
        (["--host", "0.0.0.0"], {}, 401),
        ([], {"CKPTSTORE_HOST": "0.0.0.0"}, 401),
        (["--host", "::1"], {"CKPTSTORE_HOST": "0.0.0.0"}, 200),  # --host wins
        (["--host", "0.0.0.0"], {"CKPTSTORE_AUTH": "off"}, 200),
    ],
)
def test_serve_requires_tokens_unless_it_listens_on_loopback(
    args: list[str],
    env: dict[str, str],
    status: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `serve` as run, up to the socket: the app it builds and the address it binds
    import uvicorn

    served: dict[str, object] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    for name in ("CKPTSTORE_HOST", "CKPTSTORE_AUTH"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert service_main(["serve", "--data-dir", str(tmp_path), *args]) == 0
    host = args[1] if args else env.get("CKPTSTORE_HOST", "127.0.0.1")
    assert served["host"] == host

    async def get_metrics() -> httpx.Response:  # /metrics needs no runtime (no lifespan)
        transport = httpx.ASGITransport(app=served["app"])  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
            return await http.get("/metrics")

    assert asyncio.run(get_metrics()).status_code == status


def test_the_dcp_writer_passes_the_token_and_stays_picklable() -> None:
    from ckptstore.dcp import CkptStoreWriter

    writer = pickle.loads(pickle.dumps(CkptStoreWriter("http://h:1", "r", token="ckpt_w")))
    assert writer.client_options["token"] == "ckpt_w"
    with CheckpointClient("http://h:1", **writer.client_options) as client:
        assert client.transport._authorization == "Bearer ckpt_w"


def test_a_token_for_every_run_is_asked_for_explicitly(
    svc: Service, tokens: dict[str, str]
) -> None:
    """An empty, blank or missing run pattern is refused (400 over HTTP, exit 1 from the
    command) and makes no token: ``*`` is how a token for every run is asked for."""
    with httpx.Client(base_url=svc.url, headers=_bearer(tokens["admin"])) as http:
        for body in ({"runs": ""}, {"runs": "  "}, {"runs": None}, {}):
            answer = http.post("/v1/tokens", json={"name": "blank", "scope": "read", **body})
            assert answer.status_code == 400, (body, answer.text)
            assert answer.json()["error"]["code"] == "invalid_request"
        names = [t["name"] for t in http.get("/v1/tokens").json()["tokens"]]
        assert "blank" not in names
    for runs in ([], ["--runs", ""], ["--runs", " "]):
        made = service_cli(svc.data_dir, "token", "create", "blank", "--scope", "read", *runs)
        assert made.returncode != 0 and made.stdout == "", made.stdout
    every = service_cli(svc.data_dir, "token", "create", "every", "--scope", "read", "--runs", "*")
    assert every.returncode == 0, every.stderr
    assert "every run" in every.stderr
    with CheckpointClient(svc.url, token=every.stdout.strip()) as client:
        assert {"team-a-1", "team-b-1"} <= {r.name for r in client.runs()}
