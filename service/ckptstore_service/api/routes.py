"""HTTP routes: thin wrappers over ingest, restore and the catalog."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ckptstore_core.errors import InvalidRequest
from ckptstore_core.records import CheckpointInfo
from ckptstore_service.api.body import BodyPipe, drain, pump, receive_body
from ckptstore_service.api.deps import MaintenanceDep, RuntimeDep, UploadLimiterDep
from ckptstore_service.api.schemas import CheckpointsOut, RunsOut
from ckptstore_service.ingest import ingest
from ckptstore_service.names import check_run_name, parse_step
from ckptstore_service.restore import open_restore

__all__ = ["router"]

router = APIRouter()


@router.get("/healthz")
async def healthz(rt: RuntimeDep, maintenance: MaintenanceDep) -> dict[str, str | int]:
    """Up, with the database reachable; ``maintenance``: runs whose re-root pass (which
    also collects their replaced blobs) waits out its quiet time or runs; the periodic sweep
    of every run's garbage is not counted."""
    await run_in_threadpool(rt.catalog.ping)
    return {"status": "ok", "maintenance": maintenance.pending}


@router.get("/v1/runs")
async def list_runs(rt: RuntimeDep) -> RunsOut:
    runs = await run_in_threadpool(rt.catalog.list_runs)
    return RunsOut(runs=runs)


@router.get("/v1/runs/{run}/checkpoints")
async def list_checkpoints(run: str, rt: RuntimeDep) -> CheckpointsOut:
    check_run_name(run)
    infos = await run_in_threadpool(rt.catalog.list_checkpoints, run)
    return CheckpointsOut(run=run, checkpoints=[CheckpointInfo.of(i) for i in infos])


@router.get("/v1/runs/{run}/checkpoints/{step}", response_model=None)
async def load_checkpoint(
    run: str,
    step: str,
    rt: RuntimeDep,
    prefix: Annotated[str | None, Query(max_length=4096)] = None,
) -> StreamingResponse:
    check_run_name(run)
    step_n = parse_step(step, allow_latest=True)
    restore = await run_in_threadpool(open_restore, rt, run, step_n, prefix)
    return StreamingResponse(
        restore.body,
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(restore.total_len),
            "X-Ckptstore-Step": str(restore.info.step),
        },
    )


@router.post("/v1/runs/{run}/checkpoints/{step}", status_code=201, response_model=CheckpointInfo)
async def save_checkpoint(
    run: str,
    step: str,
    request: Request,
    rt: RuntimeDep,
    uploads: UploadLimiterDep,
    maintenance: MaintenanceDep,
) -> JSONResponse:
    check_run_name(run)
    step_n = parse_step(step)
    assert step_n is not None
    content_length = _content_length(request)
    pipe = BodyPipe()
    outcome: list[tuple[CheckpointInfo, bool]] = []
    failure: list[BaseException] = []

    def consume() -> None:
        try:
            outcome.append(ingest(rt, run, step_n, pipe, content_length))
        except BaseException as exc:
            failure.append(exc)
        finally:
            pipe.close()

    ended: list[bool] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(pump, receive_body(request, ended), pipe)
        await anyio.to_thread.run_sync(consume, limiter=uploads)
        if failure:
            tg.cancel_scope.cancel()  # rejected: stop waiting for the rest of the body
    if failure:
        if not ended:
            await drain(request)
        raise failure[0]
    info, created = outcome[0]
    if created:
        maintenance.after_save(run)
    return JSONResponse(
        CheckpointInfo.of(info).to_json(),
        status_code=201 if created else 200,
    )


def _content_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    if value is None:
        return None
    if not value.isascii() or not value.isdigit() or len(value) > 19:
        raise InvalidRequest(f"invalid Content-Length {value!r}")
    return int(value)
