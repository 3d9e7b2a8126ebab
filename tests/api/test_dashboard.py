"""The dashboard's HTML pages (issue 22, part 5), on a real service holding real checkpoints.

Three runs are saved through the client: ``resnet-cifar`` (five steps of a small state, each
changed a little, so the later ones are deltas), ``bert-tune`` (two steps written in two parts
each, committed with metadata: an eval loss and a hostile note) and ``gpt.small_v2`` (one
step). The pages are checked over raw HTTP (status, escaping, headers, no script and no outside
URL, not in the OpenAPI document) and in a real browser: Debian's chromium driven by
Playwright, where the figures shown must be the JSON API's, the chart must hold a marker per
checkpoint, and a click leads from the runs page to a run's page. Screenshots go to
``$CKPTSTORE_TEST_ARTIFACTS`` (default: the test's tmp_path); with
``CKPTSTORE_UPDATE_SCREENSHOTS=1`` they also replace docs/img/dashboard-*.png.
"""

from __future__ import annotations

import html
import os
import re
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from ckptstore import CheckpointClient
from ckptstore import parts as client_parts
from ckptstore_core.records import USER_METADATA_KEY, encode_user_metadata
from ckptstore_service.api.dashboard import (
    CHAIN_LEGEND,
    MAX_CHART_POINTS,
    bytes_chart,
    human_bytes,
    ratio,
)
from ckptstore_service.app import create_app
from ckptstore_service.catalog import CheckpointRecord
from ckptstore_service.settings import Settings
from support.bodies import valid_body

if TYPE_CHECKING:  # the fixture ``service`` is the conftest's
    from support.serviceproc import Service

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>&amp;'
DELTA_RUN, PARTS_RUN, ONE_RUN = "resnet-cifar", "bert-tune", "gpt.small_v2"


def small_state(step: int) -> dict[str, Any]:
    """A model's state at ``step``: the same weights nudged a little each step (deltas)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 128, generator=gen)
    b = torch.randn(128, generator=gen)
    for s in range(step):
        w += 1e-3 * torch.randn(256, 128, generator=torch.Generator().manual_seed(s + 1))
    return {"model": {"fc.weight": w, "fc.bias": b + step}, "step": step}


def save_in_parts(client: CheckpointClient, step: int, eval_loss: float) -> None:
    """Checkpoint ``step`` of PARTS_RUN as two ranks' parts, committed with metadata."""
    names = [f"rank-{rank}" for rank in range(2)]
    for rank, name in enumerate(names):
        data = np.full((64, 32), rank + step / 10, dtype=np.float32).tobytes()
        specs = [(f"layer{rank}.weight", "F32", (64, 32))]
        client_parts.put_part(client, PARTS_RUN, step, name, specs, [data].__iter__)
    user = encode_user_metadata({"eval_loss": eval_loss, "note": HOSTILE})
    client_parts.commit(client, PARTS_RUN, step, names, {USER_METADATA_KEY: user})


@pytest.fixture(scope="module")
def saved(service: Service) -> Service:
    """The service, holding the three runs."""
    with CheckpointClient(service.url) as client:
        for step in range(0, 50, 10):
            client.save(DELTA_RUN, step, small_state(step))
        save_in_parts(client, 100, 2.3125)
        save_in_parts(client, 200, 1.875)
        client.save(ONE_RUN, 7, small_state(0))
    return service


@pytest.fixture(scope="module")
def http(saved: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=saved.url, timeout=30) as client:
        yield client


def get_html(http: httpx.Client, path: str, status: int = 200) -> str:
    """The page at ``path``: HTML with ``status``, no script allowed, nothing from outside."""
    response = http.get(path)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in response.headers["content-security-policy"]
    text = response.text
    assert "<script" not in text.lower()
    assert "http://" not in text and "https://" not in text
    return text


def test_the_root_leads_to_the_runs_page(http: httpx.Client) -> None:
    response = http.get("/")
    assert response.status_code == 307 and response.headers["location"] == "/ui"


def test_the_runs_page_links_every_run(http: httpx.Client) -> None:
    page = get_html(http, "/ui")
    for run in http.get("/v1/runs").json()["runs"]:
        assert f'href="/ui/runs/{run["name"]}"' in page
        assert f'data-bytes="{run["stored_bytes"]}"' in page


def test_metadata_is_shown_escaped(http: httpx.Client) -> None:
    page = get_html(http, f"/ui/runs/{PARTS_RUN}")
    assert HOSTILE not in page
    assert html.escape(HOSTILE) in page  # shown as text: &amp; stays visible as &amp;
    assert '<span class="val">1.875</span>' in page


@pytest.mark.parametrize("name", ["<b>x</b>&y", "team/exp1", "a" * 129])
def test_a_name_against_the_rule_is_a_400_page(http: httpx.Client, name: str) -> None:
    page = get_html(http, "/ui/runs/" + quote(name, safe=""), status=400)
    assert "invalid run name" in page
    assert html.escape(repr(name)) in page
    assert "<b>x" not in page


def test_an_unknown_run_is_a_404_page(http: httpx.Client) -> None:
    page = get_html(http, "/ui/runs/no-such-run", status=404)
    assert "no-such-run" in page and 'href="/ui"' in page


def test_the_chain_columns_are_explained(http: httpx.Client) -> None:
    """Under the chain table and as the headers' tooltips, as ``ckptstore ls`` does."""
    page = get_html(http, f"/ui/runs/{DELTA_RUN}")
    assert 'class="chain-legend' in page
    for name, text in CHAIN_LEGEND.items():
        assert f"<b>{name}</b>: {html.escape(text)}" in page
        assert f'title="{html.escape(text, quote=True)}">{name}</th>' in page
    assert " MiB" in page or " KiB" in page  # binary units, as the CLI prints them
    assert " kB" not in page and " MB" not in page


def test_no_sign_out_button_without_the_cookie(http: httpx.Client) -> None:
    """An open service (no sign-in): nothing to sign out of; the pages' tables scroll in
    a box of their own on a narrow screen."""
    page = get_html(http, "/ui")
    assert 'id="sign-out"' not in page
    assert '<div class="scroll"><table id="runs">' in page and "@media (max-width:600px)" in page


def test_the_pages_are_not_in_the_openapi_document(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    assert "/v1/runs" in paths
    assert not [p for p in paths if p == "/" or p.startswith("/ui")]


def test_links_follow_the_prefix_the_app_is_mounted_under(tmp_path: Path) -> None:
    """Behind a proxy that serves the app under ``/ckpt`` (ASGI root_path), in-process."""
    app = create_app(Settings(data_dir=tmp_path))
    with TestClient(app, root_path="/ckpt") as client:
        assert "No checkpoints stored yet" in client.get("/ui").text
        prefix, data = valid_body()
        assert client.post("/v1/runs/r1/checkpoints/3", content=prefix + data).status_code == 201
        home = client.get("/", follow_redirects=False)
        assert home.headers["location"] == "/ckpt/ui"
        assert 'href="/ckpt/ui/runs/r1"' in client.get("/ui").text
        run_page = client.get("/ui/runs/r1").text
        assert 'href="/ckpt/ui"' in run_page
        assert 'href="/ckpt/v1/runs/r1/checkpoints"' in run_page


def chain_of(n: int, stored: int = 400) -> list[CheckpointRecord]:
    """A chain of ``n`` records, a keyframe then deltas, as the catalog lists them."""
    return [
        CheckpointRecord(
            run="r",
            step=i,
            parent_step=None if i == 0 else i - 1,
            keyframe=i == 0,
            chain_depth=i,
            raw_bytes=1000,
            stored_bytes=stored if i else 1000,
            tensors=1,
            created=datetime(2026, 1, 1, tzinfo=UTC),
            id=i + 1,
            since_keyframe=i,
            blob_key=f"k{i}",
            stored_metadata={},
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("n", [1, 3, MAX_CHART_POINTS, MAX_CHART_POINTS + 1])
def test_the_chart_marks_each_checkpoint_up_to_its_cap(n: int) -> None:
    svg = bytes_chart(chain_of(n))
    assert svg.count("<polyline") == 2
    marked = n <= MAX_CHART_POINTS
    assert len(re.findall(r"<circle class=\"stored", svg)) == (n if marked else 0)
    ys = {float(y) for y in re.findall(r'class="stored[^"]*" cx="[^"]+" cy="([^"]+)"', svg)}
    assert len(ys) == (min(n, 2) if marked else 0)  # the keyframe's 1000 bytes, the deltas' 400
    assert bytes_chart(chain_of(2, stored=0)).count("<polyline") == 2  # nothing stored: no error


@pytest.mark.parametrize(
    ("n", "shown"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "0.977 KiB"),
        (1024, "1 KiB"),
        (1234, "1.21 KiB"),
        (1023 * 1024 + 1000, "1 MiB"),
        (123_456_789, "118 MiB"),
        (5 * 2**50, "5120 TiB"),
    ],
)
def test_human_bytes(n: int, shown: str) -> None:
    assert human_bytes(n) == shown


# -- in a real browser -------------------------------------------------------------------------


@pytest.fixture
def browser_page(tmp_path: Path) -> Iterator[Any]:
    """A chromium page, 1000x700; a missing chromium fails under CI=true, else skips."""
    if not CHROMIUM.exists():
        reason = f"Debian's chromium is not installed at {CHROMIUM} (apt-get install chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            dialogs: list[str] = []

            def on_dialog(dialog: Any) -> None:
                dialogs.append(dialog.message)
                dialog.dismiss()

            page.on("dialog", on_dialog)
            yield page
            assert not dialogs  # no stored string ran as a script
        finally:
            browser.close()


def screenshot(page: Any, tmp_path: Path, name: str) -> None:
    """Save the viewport as an artifact (and as docs/img's copy when asked to)."""
    folder = Path(os.environ.get("CKPTSTORE_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    page.screenshot(path=str(path))
    assert path.stat().st_size > 10_000  # a rendered page, not a blank one
    if os.environ.get("CKPTSTORE_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(path, ROOT / "docs" / "img" / f"{name}.png")


def cells(row: Any) -> list[str]:
    texts: list[str] = row.locator("td").all_inner_texts()
    return [t.strip() for t in texts]


def test_the_browser_shows_the_api_figures(
    http: httpx.Client, browser_page: Any, tmp_path: Path
) -> None:
    page = browser_page
    page.goto(f"{http.base_url}/")
    assert page.url.endswith("/ui")
    runs = http.get("/v1/runs").json()["runs"]
    assert page.locator("#runs tbody tr").count() == len(runs) == 3
    for run in runs:
        row = page.locator(f'#runs tbody tr[data-run="{run["name"]}"]')
        shown = cells(row)
        assert shown[:3] == [run["name"], str(run["checkpoints"]), str(run["latest_step"])]
        assert shown[3:6] == [
            human_bytes(run["raw_bytes"]),
            human_bytes(run["stored_bytes"]),
            ratio(run["raw_bytes"], run["stored_bytes"]),
        ]
        stored = row.locator("td[data-bytes]").nth(1).get_attribute("data-bytes")
        assert stored == str(run["stored_bytes"])
    screenshot(page, tmp_path, "dashboard-runs")

    page.click(f"#runs a:text-is('{DELTA_RUN}')")
    page.wait_for_url(f"**/ui/runs/{DELTA_RUN}")
    chain = http.get(f"/v1/runs/{DELTA_RUN}/checkpoints").json()["checkpoints"]
    assert len(chain) == 5 and not all(c["keyframe"] for c in chain)  # deltas among them
    chart = page.locator("#bytes-chart")
    assert chart.locator("circle.stored").count() == len(chain)
    assert chart.locator("circle.keyframe").count() == sum(c["keyframe"] for c in chain)
    assert chart.locator("polyline.raw").count() == 1
    for c in chain:
        row = page.locator(f'#chain tbody tr[data-step="{c["step"]}"]')
        shown = cells(row)
        parent = "" if c["parent_step"] is None else str(c["parent_step"])
        kind = "keyframe" if c["keyframe"] else "delta"
        assert shown[:6] == [str(c["step"]), parent, kind, str(c["chain_depth"]), "1", "2"]
        figures = row.locator("td[data-bytes]")
        assert figures.nth(0).get_attribute("data-bytes") == str(c["raw_bytes"])
        assert figures.nth(1).get_attribute("data-bytes") == str(c["stored_bytes"])
    screenshot(page, tmp_path, "dashboard-run")

    page.goto(f"{http.base_url}/ui/runs/{PARTS_RUN}")
    row = page.locator('#chain tbody tr[data-step="200"]')
    assert cells(row)[4] == "2"  # parts
    assert row.locator('li[data-key="eval_loss"] .val').inner_text() == "1.875"
    assert row.locator('li[data-key="note"] .val').inner_text() == HOSTILE


def test_the_pages_fit_a_420_pixel_screen(http: httpx.Client, browser_page: Any) -> None:
    """A phone-sized window: the page itself never scrolls sideways (the tables do, in
    their box)."""
    page = browser_page
    page.set_viewport_size({"width": 420, "height": 800})
    for path in ("/ui", f"/ui/runs/{DELTA_RUN}", f"/ui/runs/{PARTS_RUN}"):
        page.goto(f"{http.base_url}{path}")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 420, (path, width)
