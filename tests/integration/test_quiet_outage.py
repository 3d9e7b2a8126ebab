"""A PostgreSQL restart as the service's background work sees it (issue 32, item 4): each
background pass that fails on the unreachable database logs one line, not a traceback at
ERROR; the passes succeed again once it is back."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest
from sqlalchemy.engine import make_url

from support.faultproxy import FaultProxy
from support.serviceproc import Service
from support.waiting import wait_until

_FAILED = "background maintenance failed"


@pytest.mark.postgres
def test_a_postgres_restart_logs_one_line_per_failed_background_pass(
    make_service: Callable[..., Service], pg_url: str
) -> None:
    at = make_url(pg_url)
    with FaultProxy(at.host or "127.0.0.1", at.port or 5432) as pg:
        database = at.set(host="127.0.0.1", port=pg.port).render_as_string(hide_password=False)
        env = {
            "CKPTSTORE_DATABASE_URL": database,
            "CKPTSTORE_SWEEP_INTERVAL_S": "0.3",
            "CKPTSTORE_DATABASE_TIMEOUT_S": "2",
        }
        svc = make_service(env)
        try:
            pg.refuse()  # PostgreSQL restarts: every connection reset, new ones refused
            pg.reset()
            wait_until(lambda: svc.log.read_text().count(_FAILED) >= 3, timeout=60)
            time.sleep(0.5)  # a pass cut mid-way would log its lines now (the outage goes on)
            passes = _sweep_tasks(svc.url, "error")  # each failed sweep: its 3 tasks failed
            lines = svc.log.read_text().splitlines()
            pg.clear()
            ok = _sweep_tasks(svc.url, "ok")
            wait_until(lambda: _sweep_tasks(svc.url, "ok") > ok, timeout=30, what="a pass")
            after = svc.log.read_text().splitlines()[len(lines) :]
        finally:
            svc.stop()
    failed = [line for line in lines if _FAILED in line]
    assert all("WARNING" in line and "next pass" in line for line in failed), failed
    assert not [line for line in lines if "Traceback" in line or "ERROR" in line], lines[-40:]
    # one line per failed pass, though every task of the pass failed (a line logged as a
    # pass began may not have its tasks counted yet)
    assert passes <= len(failed) <= passes + 1, (passes, failed)
    assert not [line for line in after if "Traceback" in line or "ERROR" in line], after


def _sweep_tasks(url: str, outcome: str) -> int:
    """How many runs of the sweep's ``parts`` task ended with ``outcome`` (every sweep
    runs it once, after ``garbage`` and ``archive``)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    key = f'ckptstore_maintenance_runs_total{{outcome="{outcome}",task="parts"}} '
    values = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith(key)]
    return int(float(values[0])) if values else 0
