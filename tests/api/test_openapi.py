"""``/openapi.json`` describes the API the service really serves (issue 18, step 7).

FastAPI alone documented no body for the save (the route reads it as a stream), a JSON 200
for the load, a 422 validation error on every route (the service answers 400 instead) and no
error body at all. The app here is the real one, built by the factory and served in-process
through httpx's ASGI transport; the document is checked against the records and the error
tree it must describe, not against a copy of itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckptstore_core.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CorruptData,
    InternalError,
    InvalidRequest,
    InvalidStream,
    PayloadTooLarge,
    RunNotFound,
    StorageUnavailable,
    UnsupportedDtype,
)
from ckptstore_core.names import RUN_NAME_RULE
from ckptstore_core.records import CheckpointInfo, RunInfo
from ckptstore_service.app import create_app
from ckptstore_service.settings import Settings

CHECKPOINT = "/v1/runs/{run}/checkpoints/{step}"
CHECKPOINTS = "/v1/runs/{run}/checkpoints"
ERROR_BODY = {"$ref": "#/components/schemas/ErrorBody"}


def asgi_get(tmp_path: Path, path: str) -> httpx.Response:
    """GET ``path`` from a fresh app (no lifespan: these routes need no runtime)."""

    async def get() -> httpx.Response:
        app = create_app(Settings(data_dir=tmp_path))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ckptstore") as client:
            return await client.get(path)

    return asyncio.run(get())


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    response = asgi_get(tmp_path_factory.mktemp("openapi"), "/openapi.json")
    assert response.status_code == 200, response.text
    document: dict[str, Any] = response.json()
    return document


def responses(spec: dict[str, Any], path: str, method: str) -> dict[str, Any]:
    found: dict[str, Any] = spec["paths"][path][method]["responses"]
    return found


def test_no_validation_error_anywhere(spec: dict[str, Any]) -> None:
    text = json.dumps(spec)
    assert "422" not in text
    assert "ValidationError" not in text
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_the_paths_are_the_routes(spec: dict[str, Any]) -> None:
    assert {"/healthz", "/v1/runs", CHECKPOINTS, CHECKPOINT} <= set(spec["paths"])
    assert not [p for p in spec["paths"] if ":" in p]  # FastAPI drops the ``:path`` converter
    assert set(spec["paths"][CHECKPOINT]) == {"get", "post", "delete"}
    assert set(spec["paths"]["/v1/runs/{run}"]) == {"get", "delete"}
    run = next(p for p in spec["paths"][CHECKPOINT]["post"]["parameters"] if p["name"] == "run")
    assert run["in"] == "path" and RUN_NAME_RULE in run["description"]


def test_save_takes_an_octet_stream(spec: dict[str, Any]) -> None:
    post = spec["paths"][CHECKPOINT]["post"]
    body = post["requestBody"]
    assert body["required"] is True
    assert set(body["content"]) == {"application/octet-stream"}
    assert body["content"]["application/octet-stream"]["schema"] == {
        "type": "string",
        "format": "binary",
    }
    assert "safetensors" in body["description"]
    assert "CheckpointClient.save" in body["description"]
    headers = {p["name"]: p for p in post["parameters"] if p["in"] == "header"}
    assert headers["Content-Length"]["schema"]["type"] == "integer"
    assert headers["Content-Length"]["required"] is False


def test_save_answers_the_record(spec: dict[str, Any]) -> None:
    answers = responses(spec, CHECKPOINT, "post")
    for status in ("201", "200"):  # stored, and stored already (an idempotent retry)
        schema = answers[status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/CheckpointInfo"}, status


def test_load_answers_an_octet_stream(spec: dict[str, Any]) -> None:
    get = spec["paths"][CHECKPOINT]["get"]
    ok = get["responses"]["200"]
    assert set(ok["content"]) == {"application/octet-stream"}  # and no JSON
    assert ok["content"]["application/octet-stream"]["schema"]["format"] == "binary"
    assert ok["headers"]["X-Ckptstore-Step"]["schema"]["type"] == "integer"
    assert "Content-Length" in ok["headers"]
    prefix = next(p for p in get["parameters"] if p["name"] == "prefix")
    assert prefix["in"] == "query" and prefix["required"] is False
    assert "model/" in prefix["description"]


def test_listings_are_the_core_records(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    runs = responses(spec, "/v1/runs", "get")["200"]["content"]["application/json"]["schema"]
    assert runs == {"$ref": "#/components/schemas/RunsOut"}
    listed = responses(spec, CHECKPOINTS, "get")["200"]["content"]["application/json"]["schema"]
    assert listed == {"$ref": "#/components/schemas/CheckpointsOut"}
    assert schemas["RunsOut"]["properties"]["runs"]["items"] == {
        "$ref": "#/components/schemas/RunInfo"
    }
    assert schemas["CheckpointsOut"]["properties"]["checkpoints"]["items"] == {
        "$ref": "#/components/schemas/CheckpointInfo"
    }
    for record in (CheckpointInfo, RunInfo):
        fields = [f.name for f in dataclasses.fields(record)]
        assert list(schemas[record.__name__]["properties"]) == fields, record
        assert schemas[record.__name__]["properties"]["created"]["format"] == "date-time"


def test_error_body_is_one_schema(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    assert schemas["ErrorBody"]["required"] == ["error"]
    assert schemas["ErrorBody"]["properties"]["error"] == {
        "$ref": "#/components/schemas/ErrorDetail"
    }
    assert schemas["ErrorDetail"]["required"] == ["code", "message"]
    assert set(schemas["ErrorDetail"]["properties"]) == {"code", "message"}


# what each operation must document: status -> codes listed under it
EXPECTED = {
    (CHECKPOINT, "post"): {
        "400": [InvalidRequest, InvalidStream, UnsupportedDtype],
        "409": [CheckpointExists],
        "413": [PayloadTooLarge],
        "500": [CorruptData, InternalError],
        "503": [StorageUnavailable],
    },
    (CHECKPOINT, "get"): {
        "400": [InvalidRequest],
        "404": [RunNotFound, CheckpointNotFound],
        "500": [CorruptData, InternalError],
        "503": [StorageUnavailable],
    },
    (CHECKPOINTS, "get"): {
        "400": [InvalidRequest],
        "404": [RunNotFound],
        "500": [InternalError],
        "503": [StorageUnavailable],
    },
    ("/v1/runs", "get"): {"500": [InternalError], "503": [StorageUnavailable]},
    ("/healthz", "get"): {"500": [InternalError], "503": [StorageUnavailable]},
}


@pytest.mark.parametrize(("path", "method"), EXPECTED, ids=[f"{m} {p}" for p, m in EXPECTED])
def test_error_responses_list_their_codes(spec: dict[str, Any], path: str, method: str) -> None:
    answers = responses(spec, path, method)
    errors = {s: r for s, r in answers.items() if s not in ("200", "201")}
    assert set(errors) == {*EXPECTED[path, method], "default"}
    for status, response in errors.items():
        assert response["content"] == {"application/json": {"schema": ERROR_BODY}}, status
        for cls in EXPECTED[path, method].get(status, []):
            assert f"`{cls.code}`" in response["description"], (status, cls)
    if method == "get" and "400" in answers:
        assert "`invalid_stream`" not in answers["400"]["description"]  # a GET has no body
    assert "`service_unavailable`" not in json.dumps(answers)  # the client's own


def test_an_error_is_the_documented_body(tmp_path: Path) -> None:
    response = asgi_get(tmp_path, "/v1/nowhere")
    assert response.status_code == 404
    assert response.json() == {
        "error": {"code": "not_found", "message": "no such resource: /v1/nowhere"}
    }


def test_security_is_what_auth_enforces(spec: dict[str, Any]) -> None:
    from ckptstore_service.api.auth import ROUTE_ACCESS, SECURITY_SCHEME

    scheme = spec["components"]["securitySchemes"][SECURITY_SCHEME]
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer"
    documented = 0
    for (method, path), access in ROUTE_ACCESS.items():
        op = spec["paths"].get(path.replace(":path", ""), {}).get(method.lower())
        if op is None:  # the dashboard's pages and the docs are not in the document
            continue
        if access.scope is None:
            assert "security" not in op, (method, path)
            continue
        documented += 1
        assert op["security"] == [{SECURITY_SCHEME: []}], (method, path)
        assert op["x-ckptstore-scope"] == access.scope, (method, path)
        assert op["x-ckptstore-run-pattern"] == access.run, (method, path)
    assert documented >= 15
    save = spec["paths"][CHECKPOINT]["post"]
    assert save["x-ckptstore-scope"] == "write" and save["x-ckptstore-run-pattern"] is True
    assert spec["paths"]["/v1/tokens"]["get"]["x-ckptstore-scope"] == "admin"
