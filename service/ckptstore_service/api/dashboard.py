"""The dashboard: server-rendered HTML pages over the catalog, for people.

    GET /                 redirects to /ui
    GET /ui               every run: checkpoints, raw and stored bytes, ratio, latest step
    GET /ui/runs/{run}    one run: a chart of raw vs stored bytes per checkpoint (inline SVG)
                          and the table of its chain (parent, keyframe, depth, parts, metadata),
                          with what the chain columns mean under it

Sizes are in binary units (KiB, MiB), as the ``ckptstore`` command prints them. A page seen
through the sign-in cookie has a "Sign out" button (a form posting to ``/ui/logout``). The
pages fit a 420 px wide screen: the tables scroll sideways in their own box.

The pages read what the JSON listings read (``Catalog.list_runs`` and
``Catalog.list_checkpoints``, behind the same run-name check), and are built here as strings:
no template engine, no script, no asset from outside (a cluster may have no internet access).
Every string that comes from a user (run names, metadata keys and values) goes through
:func:`_e`; the response's Content-Security-Policy allows no script at all, as a second line.
The pages are left out of the OpenAPI document: they are not part of the API.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.concurrency import run_in_threadpool

from ckptstore_core.errors import InvalidRequest, RunNotFound
from ckptstore_core.records import RunInfo
from ckptstore_service.api.auth import COOKIE, PrincipalDep
from ckptstore_service.api.deps import RuntimeDep
from ckptstore_service.auth import Principal
from ckptstore_service.catalog import Catalog, CheckpointRecord
from ckptstore_service.names import check_run_name

__all__ = ["CHAIN_LEGEND", "MAX_CHART_POINTS", "bytes_chart", "human_bytes", "ratio", "router"]

router = APIRouter(include_in_schema=False)

#: above this many checkpoints the chart draws its two lines without a marker per checkpoint
MAX_CHART_POINTS = 500
#: a metadata value up to this long is shown; a longer one (a skeleton, a DCP plan) by its size
_SHOWN_VALUE = 80
_HEADERS = {
    # no script may run on these pages, whatever a stored string holds
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",  # a reload shows the checkpoints saved since
}


# -- routes ------------------------------------------------------------------------------------


@router.get("/")
async def home(request: Request) -> RedirectResponse:
    """The service's root shows the dashboard."""
    return RedirectResponse(f"{_root(request)}/ui", status_code=307)


@router.get("/ui", response_class=HTMLResponse)
async def runs_page(request: Request, rt: RuntimeDep, principal: PrincipalDep) -> HTMLResponse:
    """Every run with a committed checkpoint (that the token covers), its checkpoints
    summed (``GET /v1/runs``)."""
    rows = await run_in_threadpool(_runs_with_latest, rt.catalog, principal)
    return _html(200, "Runs", _runs_body(_Page(request), rows))


@router.get("/ui/runs/{run:path}", response_class=HTMLResponse)
async def run_page(run: str, request: Request, rt: RuntimeDep) -> HTMLResponse:
    """One run's chain (``GET /v1/runs/{run}/checkpoints``); an HTML 400 for a name that
    breaks the run-name rule, 404 for a run without checkpoints."""
    page = _Page(request)
    try:
        check_run_name(run)
        records = await run_in_threadpool(rt.catalog.list_checkpoints, run)
    except (InvalidRequest, RunNotFound) as exc:
        title = "Not found" if isinstance(exc, RunNotFound) else "Bad request"
        return _html(exc.status, title, _error_body(page, title, exc.message))
    return _html(200, run, _run_body(page, run, records))


def _root(request: Request) -> str:
    """The prefix the app is mounted under (ASGI ``root_path``, set behind a proxy), or ''."""
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/")


class _Page:
    """What every page's frame needs of the request: the prefix its links start with, and
    whether the viewer signed in with the dashboard's cookie (then a "Sign out" button)."""

    def __init__(self, request: Request) -> None:
        self.root = _root(request)
        self.signed_in = COOKIE in request.cookies


def _runs_with_latest(
    catalog: Catalog, principal: Principal
) -> list[tuple[RunInfo, CheckpointRecord | None]]:
    """Each run of the listing that ``principal`` covers, with its latest checkpoint (for
    when it was saved)."""
    runs = [run for run in catalog.list_runs() if principal.covers(run.name)]
    return [(run, catalog.find(run.name, None)) for run in runs]


# -- formatting --------------------------------------------------------------------------------


def _e(text: object) -> str:
    """``text`` escaped for HTML text and quoted attribute values alike."""
    return html.escape(str(text), quote=True)


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units (as the ``ckptstore`` command prints them), three
    significant digits: ``512 B``, ``1.21 KiB``, ``118 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 999.5 or unit == "TiB":  # 1023 B is 1 KiB, not 1023 B wider than the rest
            break
        value /= 1024
    if unit == "B":
        return f"{n} B"
    return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"


def ratio(raw: int, stored: int) -> str:
    """How many times smaller the stored bytes are than the raw ones."""
    return f"{raw / stored:.2f}\u00d7" if stored else "\u2013"


def _bytes_cell(n: int) -> str:
    return f'<td class="num" data-bytes="{n}" title="{n:,} bytes">{human_bytes(n)}</td>'


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _time(at: datetime) -> str:
    shown = at.strftime("%Y-%m-%d %H:%M:%S")  # the columns say UTC
    return f'<time datetime="{_e(at.isoformat())}">{shown}</time>'


def _run_url(root: str, run: str) -> str:
    return f"{root}/ui/runs/{quote(run, safe='')}"


def _metadata(meta: dict[str, Any]) -> str:
    """The checkpoint's user metadata (``save(..., metadata=...)``): short values shown as
    JSON (strings as they are), long ones by size."""
    items = []
    for key in sorted(meta):
        value = meta[key]
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if len(text) <= _SHOWN_VALUE and "\n" not in text:
            shown = f'=<span class="val">{_e(text)}</span>'
        else:
            shown = f' <span class="dim">({len(text):,} chars)</span>'
        items.append(f'<li data-key="{_e(key)}"><code>{_e(key)}</code>{shown}</li>')
    return f'<ul class="meta">{"".join(items)}</ul>' if items else ""


# -- pages -------------------------------------------------------------------------------------

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;
color:#1f2328;background:#f6f8fa}
header{background:#24292f;color:#fff;padding:10px 24px}
header a{color:#fff;text-decoration:none;font-weight:600}
main{padding:16px 24px;max-width:1200px}
h1{font-size:20px;margin:4px 0 12px;word-break:break-all}
table{border-collapse:collapse;background:#fff;border:1px solid #d0d7de;width:100%}
th,td{padding:5px 8px;border-bottom:1px solid #d8dee4;text-align:left;vertical-align:top}
th{background:#f0f3f6;font-weight:600}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
time{white-space:nowrap}
tr:hover td{background:#f6f8fa}
a{color:#0969da}.dim{color:#656d76}.summary{margin:0 0 14px}.summary b{font-weight:600}
td.meta{min-width:160px}
header{display:flex;align-items:center;justify-content:space-between;gap:12px}
header form{margin:0}header button{font:inherit;font-size:13px;color:#fff;background:none;
border:1px solid #8c959f;border-radius:4px;padding:2px 10px;cursor:pointer}
.scroll{overflow-x:auto;max-width:100%}p.chain-legend{font-size:12px;margin:8px 0}
@media (max-width:600px){main{padding:12px}header{padding:10px 12px}}
ul.meta{list-style:none;margin:0;padding:0;font-size:12px}ul.meta code{color:#6639ba}
.val{word-break:break-all}.key{color:#1a7f37;font-weight:600}
.pairing{font-size:12px;color:#656d76;white-space:nowrap}.unpaired{color:#cf222e}
.chart{background:#fff;border:1px solid #d0d7de;margin:0 0 16px;padding:8px}
.legend span{display:inline-block;margin-right:16px}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-1px;
margin-right:4px}
svg text{font-size:11px;fill:#656d76}
"""


def _html(status: int, title: str, body: str) -> HTMLResponse:
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)} \u2013 ckptstore</title><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>"
    )
    return HTMLResponse(page, status_code=status, headers=_HEADERS)


def _frame(page: _Page, content: str) -> str:
    root = _e(page.root)
    out = (
        f'<form method="post" action="{root}/ui/logout"><button id="sign-out">Sign out'
        "</button></form>"
        if page.signed_in
        else ""
    )
    return f'<header><a href="{root}/ui">ckptstore</a>{out}</header><main>{content}</main>'


def _error_body(page: _Page, title: str, message: str) -> str:
    back = f'<p><a href="{_e(page.root)}/ui">All runs</a></p>'
    return _frame(page, f'<h1>{_e(title)}</h1><p class="error">{_e(message)}</p>{back}')


def _runs_body(page: _Page, rows: Sequence[tuple[RunInfo, CheckpointRecord | None]]) -> str:
    root = page.root
    if not rows:
        return _frame(page, "<h1>Runs</h1><p>No checkpoints stored yet.</p>")
    raw = sum(r.raw_bytes for r, _ in rows)
    stored = sum(r.stored_bytes for r, _ in rows)
    summary = (
        f'<p class="summary">{_count(len(rows), "run")}, '
        f"{_count(sum(r.checkpoints for r, _ in rows), 'checkpoint')}: "
        f"<b>{human_bytes(raw)}</b> raw stored in <b>{human_bytes(stored)}</b> "
        f"({ratio(raw, stored)})</p>"
    )
    head = (
        '<tr><th>Run</th><th class="num">Checkpoints</th><th class="num">Latest step</th>'
        '<th class="num">Raw</th><th class="num">Stored</th><th class="num">Ratio</th>'
        "<th>Latest saved (UTC)</th><th>Run created (UTC)</th></tr>"
    )
    body = "".join(_run_row(root, run, latest) for run, latest in rows)
    table = (
        f'<div class="scroll"><table id="runs"><thead>{head}</thead><tbody>{body}</tbody>'
        "</table></div>"
    )
    return _frame(page, f"<h1>Runs</h1>{summary}{table}")


def _run_row(root: str, run: RunInfo, latest: CheckpointRecord | None) -> str:
    saved = _time(latest.created) if latest is not None else ""  # deleted meanwhile
    return (
        f'<tr data-run="{_e(run.name)}">'
        f'<td><a href="{_e(_run_url(root, run.name))}">{_e(run.name)}</a></td>'
        f'<td class="num">{run.checkpoints}</td><td class="num">{run.latest_step}</td>'
        f"{_bytes_cell(run.raw_bytes)}{_bytes_cell(run.stored_bytes)}"
        f'<td class="num">{ratio(run.raw_bytes, run.stored_bytes)}</td>'
        f"<td>{saved}</td><td>{_time(run.created)}</td></tr>"
    )


def _run_body(page: _Page, run: str, records: Sequence[CheckpointRecord]) -> str:
    root = page.root
    raw = sum(c.raw_bytes for c in records)
    stored = sum(c.stored_bytes for c in records)
    api = f"{root}/v1/runs/{quote(run, safe='')}/checkpoints"
    summary = (
        f'<p class="summary">{_count(len(records), "checkpoint")} '
        f"({_count(sum(c.keyframe for c in records), 'keyframe')}, deepest chain "
        f"{max(c.chain_depth for c in records)}), latest step <b>{records[-1].step}</b>: "
        f"<b>{human_bytes(raw)}</b> raw stored in <b>{human_bytes(stored)}</b> "
        f'({ratio(raw, stored)}). <a href="{_e(api)}">JSON</a></p>'
    )
    content = f"<h1>{_e(run)}</h1>{summary}{bytes_chart(records)}{_chain_table(records)}"
    return _frame(page, f'<p><a href="{_e(root)}/ui">\u2190 All runs</a></p>{content}')


#: What the chain columns mean (as ``ckptstore ls`` explains them), under the table.
CHAIN_LEGEND = {
    "Parent": "the checkpoint its deltas were taken against; empty when there is none in the "
    "run (its first save, a fork's first checkpoint, a parent since deleted, its deltas "
    "re-based)",
    "Keyframe": "a keyframe holds no deltas and loads without any other checkpoint; a delta "
    "needs its chain",
    "Depth": "the longest delta chain a load decodes, whatever the parent column shows",
    "Parts": "how many writers (ranks) wrote it, committed at once",
}


def _chain_table(records: Sequence[CheckpointRecord]) -> str:
    def th(name: str, cls: str = "") -> str:
        tip = CHAIN_LEGEND.get(name)
        title = f' title="{_e(tip)}"' if tip else ""
        return f"<th{cls}{title}>{name}</th>"

    num = ' class="num"'
    head = (
        f"<tr>{th('Step', num)}{th('Parent', num)}{th('Keyframe')}{th('Depth', num)}"
        f"{th('Parts', num)}{th('Tensors', num)}"
        '<th class="num">Raw</th><th class="num">Stored</th><th class="num">Ratio</th>'
        "<th>Created (UTC)</th><th>Metadata</th></tr>"
    )
    rows = "".join(_checkpoint_row(c) for c in records)
    legend = "; ".join(f"<b>{name}</b>: {_e(text)}" for name, text in CHAIN_LEGEND.items())
    return (
        f'<div class="scroll"><table id="chain"><thead>{head}</thead><tbody>{rows}</tbody>'
        f'</table></div><p class="chain-legend dim">{legend}.</p>'
    )


def _checkpoint_row(c: CheckpointRecord) -> str:
    parent = "" if c.parent_step is None else f'<a href="#step-{c.parent_step}">{c.parent_step}</a>'
    keyframe = (
        '<span class="key">keyframe</span>' if c.keyframe else '<span class="dim">delta</span>'
    )
    if c.lossy is not None:  # never silent: docs/lossy.md
        keyframe += f' <span class="lossy" title="{_e(json.dumps(c.lossy))}">lossy</span>'
    keyframe += _pairing(c.pairing)
    return (
        f'<tr id="step-{c.step}" data-step="{c.step}">'
        f'<td class="num">{c.step}</td><td class="num">{parent}</td><td>{keyframe}</td>'
        f'<td class="num">{c.chain_depth}</td><td class="num">{c.parts}</td>'
        f'<td class="num">{c.tensors}</td>{_bytes_cell(c.raw_bytes)}{_bytes_cell(c.stored_bytes)}'
        f'<td class="num">{ratio(c.raw_bytes, c.stored_bytes)}</td>'
        f'<td>{_time(c.created)}</td><td class="meta">{_metadata(c.metadata)}</td></tr>'
    )


def _pairing(pairing: Mapping[str, Any] | None) -> str:
    """What a lossy save paired (docs/lossy.md#which-weights-pair): the fp32 weights paired
    with their Adam moments, paired without, and left exact, the layout in its title; a
    save that paired none with moments while the state had an optimizer is marked."""
    if pairing is None:
        return ""
    counts = " / ".join(
        f"{pairing.get(k, 0)} ({human_bytes(int(pairing.get(f'{k}_bytes', 0)))})"
        for k in ("with_moments", "without_moments", "exact")
    )
    unpaired = bool(pairing.get("optimizer")) and not pairing.get("with_moments")
    title = f"paired with moments / weights only / left exact. {pairing.get('layout', '')}"
    return (
        f' <span class="pairing{" unpaired" if unpaired else ""}" title="{_e(title)}">'
        f"paired {_e(counts)}</span>"
    )


# -- the chart ---------------------------------------------------------------------------------

_W, _H = 960, 250
_LEFT, _RIGHT, _TOP, _BOTTOM = 72, 16, 12, 36
_RAW_COLOUR, _STORED_COLOUR = "#8c959f", "#0969da"
_Scale = Callable[[int], float]  # bytes -> the y of the plot


def bytes_chart(records: Sequence[CheckpointRecord]) -> str:
    """Raw and stored bytes per checkpoint, in step order: two lines on one byte axis, a
    marker per checkpoint (its figures in a tooltip; keyframes ringed) up to
    :data:`MAX_CHART_POINTS`."""
    top = _nice_ceiling(max(max(c.raw_bytes, c.stored_bytes) for c in records))
    xs = _x_positions(len(records))

    def y(v: int) -> float:
        return _TOP + (_H - _TOP - _BOTTOM) * (1 - v / top)

    parts = [_y_axis(top, y), _x_labels(records, xs)]
    for kind, colour in (("raw", _RAW_COLOUR), ("stored", _STORED_COLOUR)):
        values = [c.raw_bytes if kind == "raw" else c.stored_bytes for c in records]
        points = " ".join(f"{x:.1f},{y(v):.1f}" for x, v in zip(xs, values, strict=True))
        parts.append(
            f'<polyline class="{kind}" points="{points}" fill="none" stroke="{colour}" '
            'stroke-width="2"/>'
        )
    if len(records) <= MAX_CHART_POINTS:
        parts += [_markers(c, x, y) for c, x in zip(records, xs, strict=True)]
    legend = (
        f'<div class="legend"><span><i class="sw" style="background:{_RAW_COLOUR}"></i>raw bytes'
        f'</span><span><i class="sw" style="background:{_STORED_COLOUR}"></i>stored bytes</span>'
        '<span class="dim">ringed: keyframe</span></div>'
    )
    svg = (
        f'<svg id="bytes-chart" viewBox="0 0 {_W} {_H}" width="100%" role="img" '
        f'aria-label="raw and stored bytes per checkpoint">{"".join(parts)}</svg>'
    )
    return f'<div class="chart">{svg}{legend}</div>'


def _markers(c: CheckpointRecord, x: float, y: _Scale) -> str:
    tip = (
        f"step {c.step}: raw {human_bytes(c.raw_bytes)}, stored {human_bytes(c.stored_bytes)} "
        f"({ratio(c.raw_bytes, c.stored_bytes)}), "
        + ("keyframe" if c.keyframe else f"delta of step {c.parent_step}, depth {c.chain_depth}")
    )
    ring = ' stroke="#1a7f37" stroke-width="2.5"' if c.keyframe else ""
    kind = "stored keyframe" if c.keyframe else "stored"
    return (
        f'<circle class="raw" cx="{x:.1f}" cy="{y(c.raw_bytes):.1f}" r="3" '
        f'fill="{_RAW_COLOUR}" data-step="{c.step}"><title>{_e(tip)}</title></circle>'
        f'<circle class="{kind}" cx="{x:.1f}" cy="{y(c.stored_bytes):.1f}" r="4.5" '
        f'fill="{_STORED_COLOUR}"{ring} data-step="{c.step}" data-bytes="{c.stored_bytes}">'
        f"<title>{_e(tip)}</title></circle>"
    )


def _x_positions(n: int) -> list[float]:
    """Checkpoints evenly spaced across the plot, in step order (one: in the middle)."""
    width = _W - _LEFT - _RIGHT
    if n == 1:
        return [_LEFT + width / 2]
    return [_LEFT + width * i / (n - 1) for i in range(n)]


def _x_labels(records: Sequence[CheckpointRecord], xs: Sequence[float]) -> str:
    """The steps under the plot: at most 12 of them, evenly picked."""
    every = max(1, -(-len(records) // 12))
    labels = [
        f'<text x="{xs[i]:.1f}" y="{_H - _BOTTOM + 16}" text-anchor="middle">'
        f"{records[i].step}</text>"
        for i in range(0, len(records), every)
    ]
    middle = _LEFT + (_W - _LEFT - _RIGHT) / 2
    labels.append(f'<text x="{middle:.1f}" y="{_H - 4}" text-anchor="middle">step</text>')
    return "".join(labels)


def _y_axis(top: int, y: _Scale) -> str:
    lines = []
    for i in range(5):
        v = top * i // 4
        lines.append(
            f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
            'stroke="#d8dee4"/>'
            f'<text x="{_LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{human_bytes(v)}</text>'
        )
    return "".join(lines)


def _nice_ceiling(n: int) -> int:
    """The smallest 1, 2, 2.5 or 5 times a power of ten of the binary unit that shows ``n``
    (B, KiB, MiB, ...) at or above ``n`` (at least 1): the axis reads 2.5 MiB, not 2.38 MiB."""
    unit = 1
    while n > 999 * unit:
        unit *= 1024
    scale = 1
    while True:
        for step in (1, 2, 2.5, 5):
            if step * scale * unit >= n:
                return max(1, int(step * scale * unit))
        scale *= 10
