"""``/docs`` and ``/redoc`` work without internet access (issue 18, step 7).

FastAPI's own pages load Swagger UI and ReDoc from cdn.jsdelivr.net (and a favicon from
fastapi.tiangolo.com): on a cluster without internet access they render nothing. The service
serves them from the ``fastapi-offline`` package instead. Each page must reference no URL
outside the service, and everything it references must be served.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from ckptstore_service.app import create_app
from ckptstore_service.settings import Settings

# src="...", href="...", url: '...' (Swagger UI's spec), spec-url="..." (ReDoc's)
_REFERENCE = re.compile(r"""(?:src|href|spec-url)\s*=\s*["']([^"']+)["']|url:\s*'([^']+)'""")


def fetch_page_and_references(tmp_path: Path, page: str) -> tuple[str, dict[str, httpx.Response]]:
    """The page's HTML and the response to each URL it references."""

    async def fetch() -> tuple[str, dict[str, httpx.Response]]:
        app = create_app(Settings(data_dir=tmp_path))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ckptstore") as client:
            response = await client.get(page)
            assert response.status_code == 200, response.text
            assert response.headers["content-type"].startswith("text/html")
            html = response.text
            urls = {a or b for a, b in _REFERENCE.findall(html)}
            return html, {url: await client.get(url) for url in sorted(urls)}

    return asyncio.run(fetch())


@pytest.mark.parametrize(
    ("page", "must_load"),
    [
        ("/docs", {"swagger-ui-bundle.js", "swagger-ui.css", "/openapi.json"}),
        ("/redoc", {"redoc.standalone.js", "/openapi.json"}),
    ],
)
def test_page_loads_nothing_from_outside(tmp_path: Path, page: str, must_load: set[str]) -> None:
    html, references = fetch_page_and_references(tmp_path, page)
    assert not re.search(r"https?://", html), html  # not even a favicon
    for url in references:
        assert url.startswith("/") and not url.startswith("//"), url
    for name in must_load:  # the scripts and styles that render the page, and the API
        assert any(url.endswith(name) for url in references), (name, sorted(references))
    for url, response in references.items():
        assert response.status_code == 200, (url, response.status_code)
        assert response.content, url
    scripts = [r for u, r in references.items() if u.endswith(".js")]
    assert all(len(r.content) > 100_000 for r in scripts)  # the real bundles, not stubs
    assert all("javascript" in r.headers["content-type"] for r in scripts)


def test_swagger_ui_asks_no_online_validator(tmp_path: Path) -> None:
    """Swagger UI's default validatorUrl would fetch a badge from swagger.io."""
    html, _ = fetch_page_and_references(tmp_path, "/docs")
    assert '"validatorUrl": null' in html


def test_redoc_may_load_no_image_from_outside(tmp_path: Path) -> None:
    """ReDoc's bundle shows Redocly's logo from cdn.redoc.ly in its side bar, whatever the
    page says: the page's Content-Security-Policy keeps images to the service, so the
    browser never asks the CDN (the logo's own error handler hides it)."""
    from fastapi_offline import core

    bundle = Path(core.__file__).parent / "static" / "redoc.standalone.js"
    assert "https://cdn.redoc.ly/redoc/logo-mini.svg" in bundle.read_text()  # why

    async def fetch() -> httpx.Response:
        app = create_app(Settings(data_dir=tmp_path))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ckptstore") as client:
            return await client.get("/redoc")

    response = asyncio.run(fetch())
    assert response.status_code == 200
    assert response.headers["content-security-policy"] == "img-src 'self' data:"
