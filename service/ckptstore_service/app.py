"""The FastAPI application factory.

``/docs`` (Swagger UI) and ``/redoc`` are served with their scripts and styles from the
``fastapi-offline`` package, under ``/docs/static``, so they work without internet access
(FastAPI's own pages load them from a CDN). ReDoc's bundle still shows Redocly's logo from
cdn.redoc.ly in its side bar: ``/redoc`` is served here with a Content-Security-Policy whose
``img-src`` is the service itself, so the browser never asks the CDN (the logo hides itself).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi_offline import FastAPIOffline
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckptstore_core.errors import CkptStoreError, InternalError, InvalidRequest
from ckptstore_service.api import auth, dashboard, lifecycle, parts, retention
from ckptstore_service.api.body import BodyLimits, Uploads
from ckptstore_service.api.instrument import instrument
from ckptstore_service.api.routes import router, unrouted
from ckptstore_service.auth import OPEN, auth_required
from ckptstore_service.maintenance import Maintenance, RerootPolicy
from ckptstore_service.maintenance.verify import Verifier
from ckptstore_service.memory import MemoryTrimmer
from ckptstore_service.metrics import Metrics
from ckptstore_service.runtime import Runtime
from ckptstore_service.settings import Settings

__all__ = ["create_app"]

#: /redoc's images come from the service only: ReDoc's bundle would load Redocly's logo
#: from cdn.redoc.ly (a request out of the cluster, and an error where there is no internet)
REDOC_CSP = "img-src 'self' data:"


async def _redoc_page(request: Request) -> HTMLResponse:
    """fastapi-offline's ReDoc page, with :data:`REDOC_CSP`."""
    root = str(request.scope.get("root_path", "")).rstrip("/")
    page = get_redoc_html(
        openapi_url=f"{root}/openapi.json",
        title="ckptstore - ReDoc",
        redoc_js_url=f"{root}/docs/static/redoc.standalone.js",
        redoc_favicon_url=f"{root}/docs/static/favicon.png",
        with_google_fonts=False,
    )
    page.headers["Content-Security-Policy"] = REDOC_CSP
    return page


log = logging.getLogger("ckptstore")


# A 503 is what a retry can fix: say when (clients back off on their own as well)
_RETRY_AFTER_S = "1"


def _error(exc: CkptStoreError) -> JSONResponse:
    headers = {"Retry-After": _RETRY_AFTER_S} if exc.status == 503 else None
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)


def _log_auth(settings: Settings, required: bool, runtime: Runtime) -> None:
    """Say at start-up whether tokens are required, and how to make the first one."""
    why = f"CKPTSTORE_AUTH={settings.auth}, listening on {settings.host}"
    if not required:
        log.info("tokens: not required (%s)", why)
    elif not runtime.catalog.tokens.list():
        log.warning(
            "tokens: required (%s), and there are none yet: make one with "
            "`ckptstore-service token create NAME --scope admin --runs '*'`",
            why,
        )
    else:
        log.info("tokens: required (%s)", why)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the runtime (catalog, store, cache, pools) opens in the lifespan."""
    settings = settings or Settings()
    tokens_required = auth_required(settings.auth, settings.host)
    metrics = Metrics()  # this app's own registry: several apps may share a process

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = await run_in_threadpool(Runtime.open, settings, metrics)
        app.state.runtime = runtime
        trimmer = MemoryTrimmer(settings.memory_trim_interval_s).start()
        await run_in_threadpool(_log_auth, settings, tokens_required, runtime)
        app.state.uploads = Uploads(
            anyio.CapacityLimiter(settings.max_concurrent_uploads),
            BodyLimits(
                idle_s=settings.upload_idle_timeout_s,
                min_rate=settings.upload_min_rate_bytes_s,
                window_s=settings.upload_rate_window_s,
            ),
            per_client=settings.uploads_per_client(),
            header_bytes_per_client=settings.max_header_bytes,
        )
        app.state.maintenance = Maintenance(
            runtime.catalog,
            runtime.store,
            RerootPolicy.of(settings, runtime.budget),
            scratch=runtime.cache.scratch,
            workers=runtime.workers,
            quiet_s=settings.reroot_quiet_s,
            parts_ttl_s=settings.parts_ttl_s,
            period_s=settings.sweep_interval_s,
            metrics=metrics,
            retention=settings.default_retention(),
        )
        verifier = Verifier(
            runtime.catalog,
            runtime.source,
            metrics,
            settings.verify_interval_s,
            settings.verify_cpu_share,
        )
        try:
            yield
        finally:
            await run_in_threadpool(verifier.close)
            await run_in_threadpool(app.state.maintenance.close)
            await run_in_threadpool(runtime.close)
            await run_in_threadpool(trimmer.close)

    app = FastAPIOffline(
        title="ckptstore",
        version="0.1.0",
        summary="Stores training checkpoints as residual delta chains; loads them bit-exact.",
        lifespan=lifespan,
        static_url="/docs/static",
        redoc_url=None,  # _redoc_page's, below
        # Swagger UI would fetch a validity badge from swagger.io
        swagger_ui_parameters={"validatorUrl": None},
    )
    app.include_router(router)
    app.include_router(parts.router)
    app.include_router(lifecycle.router)
    app.include_router(retention.router)
    auth.install(app, tokens_required, OPEN)  # before the metrics: they count refusals too
    if settings.metrics:
        instrument(app, metrics)
    app.include_router(dashboard.router)  # HTML pages for people, not in the OpenAPI document
    app.add_api_route("/redoc", _redoc_page, include_in_schema=False)

    @app.exception_handler(CkptStoreError)
    async def on_domain_error(_: Request, exc: CkptStoreError) -> JSONResponse:
        if exc.status >= 500:
            log.error("%s: %s", exc.code, exc.message)
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:  # no route took it
            path: str = request.scope["path"]
            return _error(unrouted(path.removeprefix(request.scope.get("root_path", ""))))
        err = InvalidRequest(str(exc.detail))
        err.status = exc.status_code
        response = _error(err)
        response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110 15.5.6)
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(InvalidRequest(f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def on_bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(InternalError(f"internal error: {type(exc).__name__}: {exc}"))

    return app
