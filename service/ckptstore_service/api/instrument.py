"""The requests' metrics, counted around the routes: ``GET /metrics`` and an ASGI middleware.

The middleware knows the save and load routes by their endpoint (:data:`OPERATIONS`), and
for each such request counts its outcome, its time until the response's last byte and the
requests in flight (:class:`~ckptstore_service.metrics.Metrics`); the routes themselves
hold no metric code. A load's stream that fails after its first byte still counts as a
server error, and one the client hangs up on as a client error, which a route could not
see: its response has left it by then.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptstore_service.api import parts, routes
from ckptstore_service.metrics import Metrics, Op, Outcome

__all__ = ["OPERATIONS", "MetricsMiddleware", "instrument", "outcome_of"]

# endpoint -> (operation, kind): the requests the middleware counts
OPERATIONS: dict[Callable[..., Any], tuple[Op, str]] = {
    routes.save_checkpoint: ("save", "single"),
    parts.save_part: ("save", "part"),
    parts.commit_parts: ("save", "commit"),
    routes.load_checkpoint: ("load", "checkpoint"),
    parts.select_tensors: ("load", "select"),
}


def instrument(app: FastAPI, metrics: Metrics) -> None:
    """Count ``app``'s saves and loads into ``metrics`` and serve them at ``GET /metrics``
    (Prometheus' text format; not part of the OpenAPI document, which describes the JSON
    API)."""
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    @app.get("/metrics", include_in_schema=False)
    async def scrape() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def outcome_of(status: int | None, complete: bool, failed: bool) -> Outcome:
    """A request's outcome from its response status, whether its response's last byte was
    sent, and whether an exception escaped the app: a 5xx or an exception is the server's
    error; a 4xx, or a response that the client did not wait for, the client's."""
    if failed or (status is not None and status >= 500):
        return "server_error"
    if status is None or status >= 400 or not complete:
        return "client_error"
    return "ok"


class MetricsMiddleware:
    """Counts the requests of :data:`OPERATIONS` (see the module's docstring)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        # the routers' own routes: the app holds them behind FastAPI's include wrappers,
        # which a match cannot see through (the paths are the same: no prefix)
        self._watched = [
            (route, OPERATIONS[route.endpoint])
            for route in (*routes.router.routes, *parts.router.routes)
            if isinstance(route, Route) and route.endpoint in OPERATIONS
        ]

    def _operation(self, scope: Scope) -> tuple[Op, str] | None:
        if scope["type"] != "http":
            return None
        for route, operation in self._watched:
            if route.matches(scope)[0] is Match.FULL:
                return operation
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        operation = self._operation(scope)
        if operation is None:
            await self.app(scope, receive, send)
            return
        op, kind = operation
        status: int | None = None
        complete = failed = False
        sent = 0

        async def counted(message: Message) -> None:
            nonlocal status, complete, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
                complete = not message.get("more_body", False)
            await send(message)

        self.metrics.request_started(op)
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, counted)
        except ClientDisconnect:
            raise
        except Exception:
            failed = True
            raise
        finally:
            outcome = outcome_of(status, complete, failed)
            self.metrics.request_ended(op, kind, outcome, time.perf_counter() - t0, sent)
