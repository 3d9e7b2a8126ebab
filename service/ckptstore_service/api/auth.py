"""The one place where requests are authenticated and authorized.

:data:`ROUTE_ACCESS` names, for every route of the app, the scope it needs and whether its
``{run}`` must be covered by the token's run pattern; ``tests/api/test_auth_routes.py``
enumerates the app's routes and fails for one without an entry (so does a request to it:
a route nobody declared is refused, never open). :class:`AuthMiddleware` checks each request
against it before any route runs: nothing is read, written or even parsed for a refused
request, and a refused upload's body is never read.

The token comes as ``Authorization: Bearer <token>``. A browser cannot add that header to a
link it follows, so the dashboard's pages (and only they: ``html`` in :class:`Access`) also
take it from the ``ckptstore_token`` cookie that ``POST /ui/login`` sets (``HttpOnly``,
``SameSite=Strict``, path ``/ui``): scripts cannot read it, other sites cannot make the
browser send it, and the JSON API never accepts it, so no cross-site request can save or
load through it. A refused page is the login form (401) or an HTML 403, not JSON.

Routes that list runs (``GET /v1/runs``, the dashboard's runs page) show only the runs the
token's pattern covers: they read :func:`principal_of`.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.routing import BaseRoute, Match, Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from ckptstore_core.access import PATTERN_RULE, SCOPES, TokenInfo
from ckptstore_core.access import Scope as TokenScope
from ckptstore_core.errors import (
    CkptStoreError,
    Forbidden,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    StorageUnavailable,
    Unauthorized,
)
from ckptstore_service.api.deps import RuntimeDep
from ckptstore_service.api.openapi import error_responses
from ckptstore_service.auth import Principal, hash_token, issue_token
from ckptstore_service.catalog import Catalog

__all__ = [
    "COOKIE",
    "ROUTE_ACCESS",
    "Access",
    "AuthMiddleware",
    "PrincipalDep",
    "leaf_routes",
    "principal_of",
    "route_keys",
    "router",
]

COOKIE = "ckptstore_token"
_STATE_KEY = "principal"
_MAX_FORM = 8 << 10  # the login form's body: a token and little else


@dataclass(frozen=True)
class Access:
    """What a route needs: ``scope`` (None: open to anyone), whether the token's run pattern
    must cover the route's ``{run}``, whether only a token without a run pattern may use it
    (token management), and whether it is a dashboard page (``html``: the token may come
    from the login cookie, and a refusal is HTML)."""

    scope: TokenScope | None
    run: bool = False
    all_runs: bool = False
    html: bool = False


PUBLIC = Access(None)
#: what a route missing from ROUTE_ACCESS gets while tokens are required: refused to all
_UNDECLARED = Access("admin", all_runs=True)
_READ_RUN = Access("read", run=True)
_WRITE_RUN = Access("write", run=True)
_ADMIN = Access("admin", all_runs=True)
_RUNS = "/v1/runs/{run:path}/checkpoints"
_STEP = _RUNS + "/{step}"

#: (method, path) of every route -> what it needs; a mount (the docs' static files) is
#: listed under the method "MOUNT"
ROUTE_ACCESS: dict[tuple[str, str], Access] = {
    # liveness, the API's description and its offline docs pages: no data in them
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,  # readiness: "ok" or why the database or blob store is not
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/docs"): PUBLIC,
    ("GET", "/docs/oauth2-redirect"): PUBLIC,
    ("GET", "/redoc"): PUBLIC,
    ("MOUNT", "/docs/static"): PUBLIC,
    # counts and durations, no run names; Prometheus sends a bearer token (docs/security.md)
    ("GET", "/metrics"): Access("read"),
    # the JSON API
    ("GET", "/v1/runs"): Access("read"),  # lists the runs the token covers
    ("GET", _RUNS): _READ_RUN,
    ("GET", _STEP): _READ_RUN,
    ("GET", _STEP + "/info"): _READ_RUN,
    ("POST", _STEP + "/select"): _READ_RUN,
    ("POST", _STEP + "/ranges"): _READ_RUN,  # a direct load's layout
    ("GET", _STEP + "/blobs/{index}"): _READ_RUN,  # a range of a blob its chains read
    ("POST", _STEP): _WRITE_RUN,
    ("PUT", _STEP + "/parts/{part}"): _WRITE_RUN,
    ("POST", _STEP + "/parts/{part}/check"): _WRITE_RUN,  # before the part's body: its upload's
    ("POST", _STEP + "/commit"): _WRITE_RUN,
    ("POST", _STEP + "/plan"): _WRITE_RUN,  # a writer's plan (direct=True): part of a save
    ("PUT", _STEP + "/parts/{part}/encoded"): _WRITE_RUN,
    ("POST", _STEP + "/parts/{part}/upload"): _WRITE_RUN,  # presigned URLs of that run only
    ("POST", _STEP + "/parts/{part}/uploaded"): _WRITE_RUN,
    # deleting destroys what no save can: an admin's (of the run's pattern, if it has one)
    ("DELETE", _STEP): Access("admin", run=True),
    ("DELETE", "/v1/runs/{run}"): Access("admin", run=True),
    # retention: a pin keeps a checkpoint (a writer's call); what lets checkpoints go is an
    # admin's (unpinning, a run's retention policy)
    ("GET", "/v1/runs/{run}"): _READ_RUN,
    ("PUT", _STEP + "/pin"): _WRITE_RUN,
    ("DELETE", _STEP + "/pin"): Access("admin", run=True),
    ("PUT", "/v1/runs/{run:path}/retention"): Access("admin", run=True),
    ("DELETE", "/v1/runs/{run:path}/retention"): Access("admin", run=True),
    # a fork writes the new run; the route checks read on the source (its body names it)
    ("POST", "/v1/runs/{run:path}/fork"): _WRITE_RUN,
    ("GET", "/v1/tokens"): _ADMIN,
    ("POST", "/v1/tokens"): _ADMIN,
    ("DELETE", "/v1/tokens/{token}"): _ADMIN,
    # the dashboard
    ("GET", "/"): PUBLIC,  # a redirect to /ui
    ("GET", "/ui"): Access("read", html=True),  # lists the runs the token covers
    ("GET", "/ui/runs/{run:path}"): Access("read", run=True, html=True),
    ("GET", "/ui/login"): PUBLIC,
    ("POST", "/ui/login"): PUBLIC,  # checks the token itself
    ("POST", "/ui/logout"): PUBLIC,
}


def leaf_routes(routes: Iterable[BaseRoute]) -> Iterator[BaseRoute]:
    """The app's routes in matching order, those of included routers in their place (FastAPI
    wraps an included router in one route); included routers have no prefix here."""
    for route in routes:
        original = getattr(route, "original_router", None)
        if original is None:
            yield route
            continue
        prefix = getattr(getattr(route, "include_context", None), "prefix", "")
        if prefix:
            raise RuntimeError(f"auth cannot see the routes of a router included at {prefix}")
        yield from leaf_routes(original.routes)


def route_keys(route: BaseRoute) -> list[tuple[str, str]]:
    """The :data:`ROUTE_ACCESS` keys of ``route``: one per method (HEAD is GET's), or one
    ``MOUNT`` key."""
    path: str = getattr(route, "path", "")
    if isinstance(route, Mount):
        return [("MOUNT", path)]
    methods: set[str] = getattr(route, "methods", None) or set()
    return sorted((m, path) for m in methods if m != "HEAD")


def principal_of(request: Request) -> Principal:
    """Who the request acts as (set by :class:`AuthMiddleware`); Unauthorized on a route
    open to all while tokens are required (no such route reads it)."""
    principal: Principal | None = getattr(request.state, _STATE_KEY, None)
    if principal is None:
        raise Unauthorized("this route knows no token")
    return principal


PrincipalDep = Annotated[Principal, Depends(principal_of)]


class AuthMiddleware:
    """Checks each request against :data:`ROUTE_ACCESS` (see the module's docstring) and
    hands the routes who it acts as; with tokens not required, everyone acts as ``open``."""

    def __init__(
        self,
        app: ASGIApp,
        routes: Callable[[], Sequence[BaseRoute]],
        required: bool,
        open_principal: Principal,
    ) -> None:
        self.app = app
        self._routes = routes
        self._required = required
        self._open = open_principal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        principal: Principal | None = self._open
        if self._required:
            access, run = self._access(scope)
            if access is None:  # no route takes it: the app answers 404 (or 400, 405)
                await self.app(scope, receive, send)
                return
            try:
                principal = await self._authorize(scope, access, run)
            except CkptStoreError as exc:
                await _refusal(scope, exc, access).__call__(scope, receive, send)
                return
        if principal is not None:
            scope.setdefault("state", {})[_STATE_KEY] = principal
        await self.app(scope, receive, send)

    def _access(self, scope: Scope) -> tuple[Access | None, str | None]:
        """What the route that takes the request needs, and its ``{run}``; (None, None) if
        no route takes it, a refusal for everyone if the route declares nothing."""
        for route in self._routes():
            match, child = route.matches(scope)
            if match is not Match.FULL:
                continue
            keys = route_keys(route)
            key = keys[0] if isinstance(route, Mount) else (scope["method"], keys[0][1])
            if key[0] == "HEAD":
                key = ("GET", key[1])
            access = ROUTE_ACCESS.get(key, _UNDECLARED)
            return access, child.get("path_params", {}).get("run")
        return None, None

    async def _authorize(self, scope: Scope, access: Access, run: str | None) -> Principal | None:
        """The request's principal (None on an open route); Unauthorized or Forbidden if
        it may not go on."""
        if access is _UNDECLARED:
            raise Forbidden(f"{scope['method']} {scope['path']} declares no scope: refused")
        if access.scope is None:
            return None
        token = _bearer(scope) or (_cookie(scope) if access.html else None)
        if token is None:
            raise Unauthorized(
                "this service requires a token: send 'Authorization: Bearer <token>' "
                "(ckptstore's client and command read CKPTSTORE_TOKEN)"
            )
        catalog: Catalog = scope["app"].state.runtime.catalog
        info = await run_in_threadpool(catalog.tokens.find, hash_token(token))
        if info is None:
            raise Unauthorized("the token is unknown or revoked")
        principal = Principal.of(info)
        if not principal.allows(access.scope):
            raise Forbidden(
                f"{principal.describe()} may not do this: it needs scope {access.scope}"
            )
        if access.all_runs and principal.runs is not None:
            raise Forbidden(f"{principal.describe()} may not do this: it is limited to some runs")
        if access.run and run is not None and not principal.covers(run):
            raise Forbidden(f"{principal.describe()} does not cover run {run!r}")
        return principal


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def _bearer(scope: Scope) -> str | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    kind, _, token = value.strip().partition(" ")
    return token.strip() or None if kind.lower() == "bearer" else None


def _cookie(scope: Scope) -> str | None:
    value = _header(scope, b"cookie")
    if value is None:
        return None
    for item in value.split(";"):
        name, _, token = item.strip().partition("=")
        if name == COOKIE and token:
            return token
    return None


def _has_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    return _header(scope, b"transfer-encoding") is not None or (length or "0").strip() != "0"


def _refusal(scope: Scope, exc: CkptStoreError, access: Access) -> Response:
    """The answer to a refused request: the typed JSON error (a dashboard page: a 303 to
    the sign-in page when no token came, the login form for a token refused (401), an HTML
    page for a 403), with RFC 6750's ``WWW-Authenticate``."""
    headers = {}
    if _has_body(scope):
        # the body is not read: closing the connection tells the client at once, instead
        # of letting it send a whole checkpoint that the server throws away
        headers["Connection"] = "close"
    sent = _bearer(scope) is not None or (access.html and _cookie(scope) is not None)
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="ckptstore"' + (
            ', error="invalid_token"' if sent else ""
        )
    elif isinstance(exc, Forbidden):
        headers["WWW-Authenticate"] = 'Bearer realm="ckptstore", error="insufficient_scope"'
    if not access.html or not isinstance(exc, Unauthorized | Forbidden):
        return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)
    root = str(scope.get("root_path", "")).rstrip("/")
    if isinstance(exc, Unauthorized) and not sent:
        # a first visit: the sign-in page, as a page (200) rather than as this page's 401,
        # which a browser reports as a failed load
        return RedirectResponse(f"{root}/ui/login", status_code=303, headers=headers)
    if isinstance(exc, Unauthorized):
        told = "That token is unknown or revoked." if sent else "Sign in to see the dashboard."
        body = _login_form(root, told)
    else:
        body = f"<h1>Forbidden</h1><p>{html.escape(exc.message)}</p>"
        body += f'<p><a href="{html.escape(root)}/ui">All runs</a></p>'
    return _page(exc.status, body, headers)


# -- the dashboard's sign-in -------------------------------------------------------------------

router = APIRouter(include_in_schema=False)

_PAGE_HEADERS = {
    # the form posts to this service; no script may run
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
_STYLE = (
    "body{font:15px system-ui,sans-serif;margin:2em auto;max-width:32em;color:#222}"
    "input{width:100%;font:inherit;padding:.3em;margin:.3em 0 .8em}"
)


def _page(status: int, body: str, headers: dict[str, str] | None = None) -> HTMLResponse:
    text = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>Sign in \u2013 ckptstore</title><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>"
    )
    return HTMLResponse(text, status_code=status, headers={**_PAGE_HEADERS, **(headers or {})})


def _login_form(root: str, message: str = "") -> str:
    note = f'<p role="alert">{html.escape(message)}</p>' if message else ""
    action = html.escape(f"{root}/ui/login", quote=True)
    return (
        f"<h1>ckptstore</h1>{note}"
        f'<form method="post" action="{action}"><label>Token (any scope)'
        '<input type="password" name="token" autocomplete="current-password" required>'
        "</label><button>Sign in</button></form>"
        "<p>Tokens are made with <code>ckptstore-service token create</code> or "
        "<code>ckptstore token create</code>.</p>"
    )


def _root(request: Request) -> str:
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/")


def _cookie_header(request: Request, value: str, max_age: int) -> str:
    secure = "; Secure" if request.url.scheme == "https" else ""
    return (
        f"{COOKIE}={value}; Path={_root(request)}/ui; Max-Age={max_age}; HttpOnly; "
        f"SameSite=Strict{secure}"
    )


@router.get("/ui/login", response_class=HTMLResponse)
async def login_page(request: Request) -> HTMLResponse:
    """The sign-in form of the dashboard."""
    return _page(200, _login_form(_root(request)))


@router.post("/ui/login", response_model=None)
async def login(request: Request, rt: RuntimeDep) -> Response:
    """Check the form's token; if it is valid, set the cookie and go to the runs page."""
    body = b""
    async for piece in request.stream():
        body += piece
        if len(body) > _MAX_FORM:
            raise PayloadTooLarge(f"the sign-in form takes at most {_MAX_FORM} bytes")
    token = parse_qs(body.decode("latin-1")).get("token", [""])[0].strip()
    info = await run_in_threadpool(rt.catalog.tokens.find, hash_token(token)) if token else None
    if info is None:
        return _page(401, _login_form(_root(request), "That token is unknown or revoked."))
    response = RedirectResponse(f"{_root(request)}/ui", status_code=303)
    response.headers["Set-Cookie"] = _cookie_header(request, token, 7 * 24 * 3600)
    return response


@router.post("/ui/logout", response_model=None)
async def logout(request: Request) -> Response:
    """Forget the dashboard's cookie."""
    response = RedirectResponse(f"{_root(request)}/ui/login", status_code=303)
    response.headers["Set-Cookie"] = _cookie_header(request, "", 0)
    return response


# -- token management over HTTP (admin) ---------------------------------------------------------


class TokenIn(BaseModel):
    name: str = Field(description="A label, unique among tokens in use: `ci-team-a`")
    scope: TokenScope = Field(description=f"One of {', '.join(SCOPES)}")
    runs: str | None = Field(
        default=None, description=f"Run pattern, required (`*` for every run): {PATTERN_RULE}"
    )


tokens_router = APIRouter(tags=["tokens"])


@tokens_router.get(
    "/v1/tokens", responses=error_responses(Unauthorized, Forbidden, StorageUnavailable)
)
async def list_tokens(
    rt: RuntimeDep,
    revoked: Annotated[bool, Query(description="List the revoked tokens too")] = False,
) -> dict[str, Any]:
    """The tokens (never their secrets), by id. Needs an admin token without a run pattern."""
    infos = await run_in_threadpool(lambda: rt.catalog.tokens.list(revoked=revoked))
    return {"tokens": [i.to_json() for i in infos]}


@tokens_router.post(
    "/v1/tokens",
    status_code=201,
    responses=error_responses(InvalidRequest, Unauthorized, Forbidden, StorageUnavailable),
)
async def create_token(body: TokenIn, rt: RuntimeDep) -> JSONResponse:
    """A new token: the answer holds its secret, shown this once (only its hash is kept)."""
    secret, info = await run_in_threadpool(
        issue_token, rt.catalog.tokens, body.name, body.scope, body.runs
    )
    return JSONResponse({"token": secret, "info": info.to_json()}, status_code=201)


@tokens_router.delete(
    "/v1/tokens/{token}",
    responses=error_responses(Unauthorized, Forbidden, NotFound, StorageUnavailable),
)
async def revoke_token(token: str, rt: RuntimeDep) -> dict[str, Any]:
    """Revoke the token of that name (or id): at once, on every replica."""
    info: TokenInfo | None = await run_in_threadpool(rt.catalog.tokens.revoke, token)
    if info is None:
        raise NotFound(f"no token in use is named (or numbered) {token!r}")
    return {"revoked": info.to_json()}


def install(app: FastAPI, required: bool, open_principal: Principal) -> None:
    """Add the sign-in pages, the token routes and :class:`AuthMiddleware` to ``app``."""
    app.include_router(router)
    app.include_router(tokens_router)
    _document_security(app)
    app.add_middleware(
        AuthMiddleware,
        routes=_lazy_routes(app),
        required=required,
        open_principal=open_principal,
    )


#: the OpenAPI security scheme every route that needs a scope names
SECURITY_SCHEME = "bearerToken"
_CONVERTER = re.compile(r"\{(\w+):\w+\}")


def _document_security(app: FastAPI) -> None:
    """Make ``/openapi.json`` say what :data:`ROUTE_ACCESS` enforces: a bearer token scheme,
    and on each operation that needs a scope, ``security`` with it and the scope needed
    (``x-ckptstore-scope``; ``x-ckptstore-run-pattern``: the token's run pattern must cover
    the ``{run}``)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes[SECURITY_SCHEME] = {
            "type": "http",
            "scheme": "bearer",
            "description": (
                "A token made with `ckptstore-service token create` or `POST /v1/tokens`, "
                "sent as `Authorization: Bearer <token>`. Required unless the service runs "
                "open (CKPTSTORE_AUTH=off, or auto on a loopback address: docs/security.md)."
            ),
        }
        for (method, path), access in ROUTE_ACCESS.items():
            op = schema.get("paths", {}).get(_CONVERTER.sub(r"{\1}", path), {})
            op = op.get(method.lower())
            if op is None or access.scope is None:
                continue
            op["security"] = [{SECURITY_SCHEME: []}]
            op["x-ckptstore-scope"] = access.scope
            op["x-ckptstore-run-pattern"] = access.run
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _lazy_routes(app: FastAPI) -> Callable[[], Sequence[BaseRoute]]:
    """The app's leaf routes, listed at the first request (every route is in by then)."""
    cache: list[BaseRoute] = []

    def routes() -> Sequence[BaseRoute]:
        if not cache:
            cache.extend(leaf_routes(app.routes))
        return cache

    return routes
