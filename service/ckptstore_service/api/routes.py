"""HTTP routes: thin wrappers over ingest, restore and the catalog."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Annotated

from anyio import to_thread
from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ckptstore_core.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CkptStoreError,
    CorruptData,
    InvalidRequest,
    InvalidStream,
    NotFound,
    PayloadTooLarge,
    RunNotFound,
    StorageUnavailable,
)
from ckptstore_core.records import CheckpointInfo
from ckptstore_service.api.auth import PrincipalDep
from ckptstore_service.api.body import consume_body
from ckptstore_service.api.deps import MaintenanceDep, RuntimeDep, UploadLimiterDep
from ckptstore_service.api.openapi import CHECKPOINT_STREAM, SAFETENSORS_BODY, error_responses
from ckptstore_service.api.schemas import CheckpointsOut, RunsOut
from ckptstore_service.names import RUN_NAME_RULE, check_run_name, parse_step
from ckptstore_service.restore import Restore
from ckptstore_service.storage.base import BlobNotFound

__all__ = ["router", "stream_response", "unrouted"]

router = APIRouter()
log = logging.getLogger("ckptstore")

# The run is a ``:path`` parameter: a name with a ``/`` (the client sends ``team%2Fexp1``,
# which the server decodes before routing) still reaches its route, which refuses it by the
# run-name rule (400 invalid_request) rather than as an unknown route (404). Valid names
# hold no ``/``, so this routes every valid request as before.
Run = Annotated[str, Path(description=f"The run's name: {RUN_NAME_RULE}")]
_RUN_CHECKPOINTS = "/v1/runs/{run:path}/checkpoints"
_READ_ERRORS = (CorruptData, BlobNotFound, StorageUnavailable)  # reading stored chunks
_LOAD_ERRORS = (InvalidRequest, RunNotFound, CheckpointNotFound, *_READ_ERRORS)
# a save reads its parent's chunks when the base cache misses
_SAVE_ERRORS = (InvalidRequest, InvalidStream, CheckpointExists, PayloadTooLarge, *_READ_ERRORS)


@router.get("/healthz", responses=error_responses(StorageUnavailable))
async def healthz(rt: RuntimeDep, maintenance: MaintenanceDep) -> dict[str, str | int]:
    """Liveness: up, with the database reachable (the blob store is not asked: that is
    ``/readyz``'s); ``maintenance``: runs whose re-root pass (which
    also collects their replaced blobs) waits out its quiet time or runs; the periodic sweep
    of every run's garbage is not counted."""
    await run_in_threadpool(rt.catalog.ping)
    return {"status": "ok", "maintenance": maintenance.pending}


@router.get(
    "/readyz",
    response_model=None,
    responses={
        200: {
            "description": "Ready: the database and the blob store answered",
            "content": {
                "application/json": {
                    "example": {"status": "ready", "database": "ok", "blob_store": "ok"}
                }
            },
        },
        503: {
            "description": "Not ready: `database` or `blob_store` says why (and `error`, "
            "the error body, names the first that failed)",
            "content": {
                "application/json": {
                    "example": {
                        "status": "not_ready",
                        "database": "ok",
                        "blob_store": "no answer within 3 s",
                        "error": {
                            "code": "storage_unavailable",
                            "message": "blob store: no answer within 3 s",
                        },
                    }
                }
            },
        },
    },
)
async def readyz(rt: RuntimeDep) -> JSONResponse:
    """Ready to serve: the database and the blob store each answer a cheap call (a
    ``SELECT 1``; a one-key listing or a probe file) within CKPTSTORE_READINESS_TIMEOUT_S,
    checked at once; the database is not ready either once a call found it damaged. For
    readiness probes and the compose healthcheck; ``/healthz`` is the cheap liveness check."""
    timeout = rt.settings.readiness_timeout_s
    database, blob_store = await asyncio.gather(
        _probe("database", rt.catalog.check_ready, timeout),
        _probe("blob store", rt.store.check_ready, timeout),
    )
    body: dict[str, object] = {"status": "ready", "database": database, "blob_store": blob_store}
    failed = [(name, why) for name, why in body.items() if name != "status" and why != "ok"]
    if not failed:
        return JSONResponse(body)
    name, why = failed[0]
    body["status"] = "not_ready"
    body["error"] = {
        "code": StorageUnavailable.code,
        "message": f"{name.replace('_', ' ')}: {why}",
    }
    return JSONResponse(body, status_code=503)


async def _probe(name: str, check: Callable[[], None], timeout: float) -> str:
    """``"ok"`` if ``check`` returns within ``timeout`` seconds, else why not, in a few words
    (the route is open to anyone: the details, endpoints and paths, go to the log). The check
    runs in a thread that is left behind if it overruns: the answer never waits for it."""
    try:
        await asyncio.wait_for(to_thread.run_sync(check, abandon_on_cancel=True), timeout)
    except TimeoutError:
        why = f"no answer within {timeout:g} s"
        log.warning("readiness: %s: %s", name, why)
        return why
    except Exception as exc:
        log.warning("readiness: %s: %s: %s", name, type(exc).__name__, exc)
        return "unavailable (the service's log says why)"
    return "ok"


@router.get("/v1/runs", responses=error_responses(StorageUnavailable))
async def list_runs(rt: RuntimeDep, principal: PrincipalDep) -> RunsOut:
    """Every run with at least one committed checkpoint (that the token's run pattern
    covers)."""
    runs = await run_in_threadpool(rt.catalog.list_runs)
    return RunsOut(runs=[r for r in runs if principal.covers(r.name)])


@router.get(
    _RUN_CHECKPOINTS, responses=error_responses(InvalidRequest, RunNotFound, StorageUnavailable)
)
async def list_checkpoints(run: Run, rt: RuntimeDep) -> CheckpointsOut:
    """The run's committed checkpoints, by step."""
    check_run_name(run)
    infos = await run_in_threadpool(rt.catalog.list_checkpoints, run)
    return CheckpointsOut(run=run, checkpoints=[CheckpointInfo.of(i) for i in infos])


@router.get(
    _RUN_CHECKPOINTS + "/{step}",
    response_model=None,
    response_class=Response,  # documents no JSON body; the 200 is CHECKPOINT_STREAM
    responses={200: CHECKPOINT_STREAM, **error_responses(*_LOAD_ERRORS)},
)
async def load_checkpoint(
    run: Run,
    step: Annotated[str, Path(description="A step (a non-negative integer) or `latest`")],
    rt: RuntimeDep,
    prefix: Annotated[
        str | None,
        Query(
            max_length=4096,
            description="Only the tensors whose flattened name starts with this (`model/`)",
        ),
    ] = None,
) -> StreamingResponse:
    """Checkpoint `step` of the run (`latest`: the newest), as a safetensors stream."""
    check_run_name(run)
    step_n = parse_step(step, allow_latest=True)
    return stream_response(await run_in_threadpool(rt.loader.open, run, step_n, prefix))


def stream_response(restore: Restore) -> StreamingResponse:
    """A load's safetensors stream, its length known before the first byte."""
    return StreamingResponse(
        restore.body,
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(restore.total_len),
            "X-Ckptstore-Step": str(restore.info.step),
        },
    )


@router.post(
    _RUN_CHECKPOINTS + "/{step}",
    status_code=201,
    response_model=CheckpointInfo,
    response_description="Stored: the new checkpoint",
    responses={
        200: {
            "model": CheckpointInfo,
            "description": "Stored already, with the same content: nothing changed",
        },
        **error_responses(*_SAVE_ERRORS),
    },
    openapi_extra=SAFETENSORS_BODY,
)
async def save_checkpoint(
    run: Run,
    step: Annotated[str, Path(description="The step: a non-negative integer")],
    request: Request,
    rt: RuntimeDep,
    uploads: UploadLimiterDep,
    maintenance: MaintenanceDep,
) -> JSONResponse:
    """Store the body, a safetensors stream, as checkpoint `step` of the run: visible once
    every byte is durable. A retry of the same step with the same content is a 200."""
    check_run_name(run)
    step_n = parse_step(step)
    assert step_n is not None
    info, created = await consume_body(
        request, uploads, lambda body, length: rt.saver.ingest(run, step_n, body, length)
    )
    if created:
        maintenance.after_save(run)
    return JSONResponse(
        CheckpointInfo.of(info).to_json(),
        status_code=201 if created else 200,
    )


def unrouted(path: str) -> CkptStoreError:
    """The error for a request that no route took: under ``/v1/runs/``, a first segment that
    is no run name breaks the run-name rule (InvalidRequest); anything else is NotFound."""
    if path.startswith("/v1/runs/"):
        try:
            check_run_name(path.removeprefix("/v1/runs/").partition("/")[0])
        except InvalidRequest as exc:
            return exc
    return NotFound(f"no such resource: {path}")
