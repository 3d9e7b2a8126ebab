"""Every route of the app declares what it needs (api/auth.py's ROUTE_ACCESS): a new route
without an entry fails here, and is refused to everyone while tokens are required. Also the
auth default, decided by the address the service listens on. In-process apps: no server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from fastapi import FastAPI

from ckptstore_service.api.auth import PUBLIC, ROUTE_ACCESS, leaf_routes, route_keys
from ckptstore_service.app import create_app
from ckptstore_service.settings import Settings


def _keys(app: FastAPI) -> list[tuple[str, str]]:
    return [key for route in leaf_routes(app.routes) for key in route_keys(route)]


def test_every_route_declares_its_scope(tmp_path: Path) -> None:
    keys = _keys(create_app(Settings(data_dir=tmp_path)))
    assert len(keys) >= 20
    undeclared = [key for key in keys if key not in ROUTE_ACCESS]
    assert not undeclared, f"add these routes to ROUTE_ACCESS in api/auth.py: {undeclared}"


def test_only_liveness_docs_and_sign_in_are_open() -> None:
    open_routes = {key for key, access in ROUTE_ACCESS.items() if access == PUBLIC}
    assert open_routes == {
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/docs/oauth2-redirect"),
        ("GET", "/redoc"),
        ("MOUNT", "/docs/static"),
        ("GET", "/"),
        ("GET", "/ui/login"),
        ("POST", "/ui/login"),
        ("POST", "/ui/logout"),
    }
    # every route that names a run checks it against the token's pattern
    for (method, path), access in ROUTE_ACCESS.items():
        if "{run" in path:
            assert access.run, (method, path)
        if method in ("POST", "PUT", "DELETE") and path.startswith("/v1/runs"):
            reads = path.endswith(("/select", "/ranges"))  # POSTs that read: a body of names
            assert access.scope in ("write", "admin") or reads, path


def _get(app: FastAPI, path: str) -> httpx.Response:
    """GET ``path`` from ``app`` in-process (no lifespan: these routes need no runtime)."""

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ckptstore") as c:
            return await c.get(path)

    return asyncio.run(get())


def test_an_undeclared_route_is_refused_while_tokens_are_required(tmp_path: Path) -> None:
    for auth, status in (("on", 403), ("off", 200)):
        app = create_app(Settings(data_dir=tmp_path, auth=auth))

        @app.get("/v1/undeclared")
        async def undeclared() -> dict[str, str]:
            return {"secret": "data"}

        response = _get(app, "/v1/undeclared")
        assert response.status_code == status, auth
        if status == 403:
            assert response.json()["error"]["code"] == "forbidden"
            assert "declares no scope" in response.json()["error"]["message"]


def test_auto_is_open_on_loopback_and_required_elsewhere(tmp_path: Path) -> None:
    # /metrics needs a read token when tokens are required, and no runtime to answer
    for host, status in (("127.0.0.1", 200), ("::1", 200), ("0.0.0.0", 401), ("10.0.0.5", 401)):
        response = _get(create_app(Settings(data_dir=tmp_path, host=host)), "/metrics")
        assert response.status_code == status, host
    on_loopback = create_app(Settings(data_dir=tmp_path, host="127.0.0.1", auth="on"))
    assert _get(on_loopback, "/metrics").status_code == 401
    everywhere = create_app(Settings(data_dir=tmp_path, host="0.0.0.0", auth="off"))
    assert _get(everywhere, "/metrics").status_code == 200
