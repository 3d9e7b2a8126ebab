"""``GET /metrics`` (issue 22): the counters move by exactly what a real service did.

A real service (uvicorn, SQLite + folder) re-roots a run as soon as its newest checkpoint is
2 deep and collects the blobs it replaced at once; the test saves, loads, sends bad
requests and a checkpoint in two parts, waiting for the background pass after each save,
and compares two scrapes parsed by prometheus_client's own parser.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptstore_core.errors import CorruptData
from ckptstore_core.wire import FORMAT, encode_header
from ckptstore_service.api.instrument import OPERATIONS, MetricsMiddleware, outcome_of
from ckptstore_service.app import create_app
from ckptstore_service.metrics import KINDS, Metrics
from ckptstore_service.settings import Settings
from support.bodies import framed, meta_for
from support.serviceproc import Service, wait_idle
from support.waiting import wait_until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a scrape, by name and labels (prometheus_client's own parser)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(client: httpx.Client) -> Samples:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def moved(before: Samples, after: Samples) -> Callable[..., float]:
    """``delta(name, **labels)``: how much that sample moved between the scrapes."""

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in after, f"no sample {name}{labels}"
        return after[key] - before.get(key, 0.0)

    return delta


def body(step: int, names: tuple[str, ...] = ("w", "b"), meta: bool = True) -> bytes:
    """Two fp32 tensors that change a little from step to step (deltas pay)."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((64, 256)).astype(np.float32) for _ in names]
    for a in arrays:
        a[:, :step] += np.float32(1e-3)
    specs = [(n, "F32", a.shape) for n, a in zip(names, arrays, strict=True)]
    prefix, _ = encode_header(specs, meta_for(*names) if meta else {"format": FORMAT})
    return prefix + b"".join(a.tobytes() for a in arrays)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    env = {
        "CKPTSTORE_REROOT_DEPTH": "2",
        "CKPTSTORE_REROOT_QUIET_S": "0",
        "CKPTSTORE_GARBAGE_GRACE_S": "0",
    }
    with Service(tmp_path_factory.mktemp("metrics"), env) as svc:
        yield svc


def test_counters_move_by_what_the_service_did(service: Service) -> None:
    with httpx.Client(base_url=service.url, timeout=30) as http:
        # the start-up sweep of every run's garbage and parts has run
        wait_until(
            lambda: scrape(http).get(
                (
                    "ckptstore_maintenance_runs_total",
                    frozenset({("task", "parts"), ("outcome", "ok")}),
                )
            ),
            what="the start-up sweep",
        )
        before = scrape(http)

        saved = []
        for step in (1, 2, 3):
            r = http.post(f"/v1/runs/m/checkpoints/{step}", content=body(step))
            assert r.status_code == 201, r.text
            saved.append(r.json())
            wait_idle(service.url)  # its re-root pass (due at once) and collection are done
        assert http.post("/v1/runs/m/checkpoints/3", content=body(3)).status_code == 200  # retry
        loads = [http.get("/v1/runs/m/checkpoints/latest"), http.get("/v1/runs/m/checkpoints/1")]
        assert [r.status_code for r in loads] == [200, 200]
        bad_save = http.post("/v1/runs/m/checkpoints/4", content=framed({"w": "nonsense"}))
        assert bad_save.status_code == 400
        assert http.get("/v1/runs/m/checkpoints/99").status_code == 404

        parts_url = "/v1/runs/p/checkpoints/0"
        for rank in (0, 1):
            part = body(0, (f"w{rank}@0",), meta=False)
            assert http.put(f"{parts_url}/parts/rank-{rank}", content=part).status_code == 201
        commit = http.post(f"{parts_url}/commit", json={"parts": ["rank-0", "rank-1"]})
        assert commit.status_code == 201, commit.text
        wait_idle(service.url)
        after = scrape(http)

    delta = moved(before, after)
    assert delta("ckptstore_saves_total", kind="single", outcome="ok") == 4  # the retry too
    assert delta("ckptstore_saves_total", kind="single", outcome="client_error") == 1
    assert delta("ckptstore_saves_total", kind="part", outcome="ok") == 2
    assert delta("ckptstore_saves_total", kind="commit", outcome="ok") == 1
    assert delta("ckptstore_loads_total", kind="checkpoint", outcome="ok") == 2
    assert delta("ckptstore_loads_total", kind="checkpoint", outcome="client_error") == 1
    assert delta("ckptstore_save_duration_seconds_count", kind="single") == 4
    assert delta("ckptstore_load_duration_seconds_count", kind="checkpoint") == 2
    assert delta("ckptstore_loaded_bytes_total") == sum(len(r.content) for r in loads)
    assert after[("ckptstore_uploads_in_flight", frozenset())] == 0
    assert after[("ckptstore_loads_in_flight", frozenset())] == 0

    # bytes and depths of what was stored: new checkpoints and parts, never retries
    raw = sum(s["raw_bytes"] for s in saved)
    assert delta("ckptstore_saved_raw_bytes_total", kind="single") == raw
    assert delta("ckptstore_saved_stored_bytes_total", kind="single") == sum(
        s["stored_bytes"] for s in saved
    )
    assert delta("ckptstore_saved_raw_bytes_total", kind="part") == commit.json()["raw_bytes"]
    assert delta("ckptstore_parts_uploaded_total") == 2
    assert delta("ckptstore_saved_chain_depth_count") == 4
    assert delta("ckptstore_saved_chain_depth_sum") == sum(s["chain_depth"] for s in saved) + 0
    assert [s["chain_depth"] for s in saved] == [0, 1, 2]

    # saves 2 and 3 read their parent from the cache; the latest loads from it, step 1 not
    assert delta("ckptstore_base_cache_hits_total", path="save") == 2
    assert delta("ckptstore_base_cache_hits_total", path="load") == 1
    assert delta("ckptstore_base_cache_misses_total", path="load") == 1

    # one pass per new checkpoint (a re-root if due, then the run's garbage); step 3 was 2
    # deep: re-rooted, and the blobs it replaced collected in the same pass (no grace)
    assert delta("ckptstore_maintenance_runs_total", task="reroot", outcome="ok") == 4
    assert delta("ckptstore_maintenance_runs_total", task="garbage", outcome="ok") == 4
    assert delta("ckptstore_reroots_total") == 1
    rewritten = delta("ckptstore_reroot_checkpoints_rewritten_total")
    assert rewritten >= 1
    assert delta("ckptstore_blobs_collected_total", task="garbage") == rewritten
    assert delta("ckptstore_reroot_chunks_rewritten_total") >= 1
    assert delta("ckptstore_reroot_blob_bytes_total", blobs="replaced") > 0
    assert delta("ckptstore_reroot_blob_bytes_total", blobs="written") > 0
    errors = [
        (name, dict(labels))
        for name, labels in after
        if name.endswith("_total") and {("outcome", "server_error"), ("outcome", "error")} & labels
    ]
    assert errors  # the series exist from the start, at 0
    assert not [e for e in errors if delta(e[0], **e[1])]


def asgi_get(settings: Settings, path: str) -> httpx.Response:
    """GET ``path`` from a fresh app served in-process (no lifespan: no runtime needed)."""

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(settings))
        async with httpx.AsyncClient(transport=transport, base_url="http://ckptstore") as client:
            return await client.get(path)

    return asyncio.run(get())


def test_each_app_has_its_own_registry_and_metrics_can_be_off(tmp_path: Path) -> None:
    # two apps in one process: a shared registry would refuse the second's metrics
    for _ in range(2):
        response = asgi_get(Settings(data_dir=tmp_path), "/metrics")
        assert response.status_code == 200
        assert 'ckptstore_saves_total{kind="single",outcome="ok"} 0.0' in response.text
    off = asgi_get(Settings(data_dir=tmp_path, metrics=False), "/metrics")
    assert off.status_code == 404
    assert off.json()["error"]["code"] == "not_found"
    spec = asgi_get(Settings(data_dir=tmp_path), "/openapi.json").json()
    assert "/metrics" not in spec["paths"]  # Prometheus' text, not the JSON API


async def _cut_short(scope: Scope, receive: Receive, send: Send) -> None:
    """A load whose stream fails after its first piece."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"x" * 10, "more_body": True})
    raise CorruptData("chunk 3 does not match its checksum")


async def _hung_up(scope: Scope, receive: Receive, send: Send) -> None:
    """A load whose client went away in the middle of its stream."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    raise ClientDisconnect()


@pytest.mark.parametrize(
    ("inner", "outcome"), [(_cut_short, "server_error"), (_hung_up, "client_error")]
)
def test_a_stream_cut_short_counts_as_an_error(inner: ASGIApp, outcome: str) -> None:
    metrics = Metrics()
    middleware = MetricsMiddleware(inner, metrics=metrics)
    scope = {"type": "http", "method": "GET", "path": "/v1/runs/r/checkpoints/1", "root_path": ""}

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        pass

    with pytest.raises((CorruptData, ClientDisconnect)):
        asyncio.run(middleware(scope, receive, send))
    samples = parse(metrics.exposition().decode())
    outcomes = {
        o: samples["ckptstore_loads_total", frozenset({("kind", "checkpoint"), ("outcome", o)})]
        for o in ("ok", "client_error", "server_error")
    }
    assert outcomes == {"ok": 0, "client_error": 0, "server_error": 0, outcome: 1}
    assert samples["ckptstore_loads_in_flight", frozenset()] == 0
    assert samples["ckptstore_loaded_bytes_total", frozenset()] == 0  # counted for ok loads


def test_every_counted_route_has_its_series() -> None:
    counted = set(OPERATIONS.values())
    assert counted == {(op, kind) for op, kinds in KINDS.items() for kind in kinds}


@pytest.mark.parametrize(
    ("status", "complete", "failed", "outcome"),
    [
        (200, True, False, "ok"),
        (201, True, False, "ok"),
        (404, True, False, "client_error"),
        (200, False, False, "client_error"),  # the client hung up on the stream
        (None, False, False, "client_error"),  # ... before any answer
        (503, True, False, "server_error"),
        (200, False, True, "server_error"),  # the stream failed after its first byte
        (None, False, True, "server_error"),
    ],
)
def test_outcome_of(status: int | None, complete: bool, failed: bool, outcome: str) -> None:
    assert outcome_of(status, complete, failed) == outcome
