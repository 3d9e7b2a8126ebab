"""HTTP routes: thin wrappers over ingest, restore and the catalog."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from ckptstore.errors import CkptStoreError, InvalidRequest, InvalidStream
from ckptstore_service.api.deps import RuntimeDep
from ckptstore_service.api.schemas import CheckpointOut, CheckpointsOut, RunOut, RunsOut
from ckptstore_service.catalog import CheckpointInfo
from ckptstore_service.ingest import BodyPipe, ingest
from ckptstore_service.restore import open_restore
from ckptstore_service.runtime import check_run_name, parse_step

__all__ = ["router"]

router = APIRouter()

_BATCH = 1 << 20  # body bytes handed to the ingest thread at a time
_DRAIN_LIMIT = 16 << 20  # read at most this much of a rejected body before answering


@router.get("/healthz")
async def healthz(rt: RuntimeDep) -> dict[str, str]:
    await run_in_threadpool(rt.catalog.ping)
    return {"status": "ok"}


@router.get("/v1/runs")
async def list_runs(rt: RuntimeDep) -> RunsOut:
    runs = await run_in_threadpool(rt.catalog.list_runs)
    return RunsOut(runs=[RunOut.of(r) for r in runs])


@router.get("/v1/runs/{run}/checkpoints")
async def list_checkpoints(run: str, rt: RuntimeDep) -> CheckpointsOut:
    check_run_name(run)
    infos = await run_in_threadpool(rt.catalog.list_checkpoints, run)
    return CheckpointsOut(run=run, checkpoints=[CheckpointOut.of(i) for i in infos])


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


@router.post("/v1/runs/{run}/checkpoints/{step}", status_code=201, response_model=CheckpointOut)
async def save_checkpoint(run: str, step: str, request: Request, rt: RuntimeDep) -> JSONResponse:
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

    body = request.stream()
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, consume)
        complete = await _pump(body, pipe)
    if failure:
        if not complete:
            await _drain(body)
        raise failure[0]
    info, created = outcome[0]
    return JSONResponse(
        CheckpointOut.of(info).model_dump(mode="json"), status_code=201 if created else 200
    )


def _content_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    if value is None:
        return None
    if not value.isdigit():
        raise InvalidRequest(f"invalid Content-Length {value!r}")
    return int(value)


async def _put(pipe: BodyPipe, piece: object) -> bool:
    if not pipe.full() and pipe.offer(piece):
        return True
    return await anyio.to_thread.run_sync(pipe.put, piece)


async def _pump(body: AsyncIterator[bytes], pipe: BodyPipe) -> bool:
    """Move the body into ``pipe``; True if the whole body was read.

    Pieces are batched up to ~1 MiB while the ingest thread is busy (fewer hand-offs) and
    passed on at once while it waits (no latency for a slow sender).
    """
    batch = bytearray()
    try:
        async for piece in body:
            batch += piece
            if len(batch) >= _BATCH or pipe.empty():
                if not await _put(pipe, batch):
                    return False
                batch = bytearray()
        if batch and not await _put(pipe, batch):
            return False
        await anyio.to_thread.run_sync(pipe.finish)
        return True
    except ClientDisconnect:
        await anyio.to_thread.run_sync(
            pipe.fail, InvalidStream("client disconnected in the middle of the upload")
        )
        return True


async def _drain(body: AsyncIterator[bytes]) -> None:
    """Read a little more of a rejected body so the client sees our answer, not a reset."""
    seen = 0
    try:
        with anyio.move_on_after(5):
            async for piece in body:
                seen += len(piece)
                if seen > _DRAIN_LIMIT:
                    return
    except (ClientDisconnect, CkptStoreError, RuntimeError):
        return
