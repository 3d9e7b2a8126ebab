"""HTTP routes that delete, and forks (docs/lifecycle.md states the guarantees):

    DELETE /v1/runs/{run}/checkpoints/{step}   one checkpoint (204)
    DELETE /v1/runs/{run}                      every checkpoint of the run (204)
    POST   /v1/runs/{new_run}/fork             {"from_run": ..., "from_step": N} (201)

``latest`` is refused as a step: a delete names what it deletes (two clients deleting
"the newest" at once would delete two checkpoints).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ckptstore_core.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CheckpointPinned,
    CorruptData,
    Forbidden,
    InvalidRequest,
    RunBusy,
    RunNotFound,
    StorageUnavailable,
)
from ckptstore_core.records import CheckpointInfo
from ckptstore_service.api.auth import PrincipalDep
from ckptstore_service.api.deps import MaintenanceDep, RuntimeDep
from ckptstore_service.api.openapi import error_responses
from ckptstore_service.maintenance import RerootPolicy
from ckptstore_service.maintenance.delete import (
    delete_checkpoint,
    delete_run,
    make_way_for_admin_delete,
)
from ckptstore_service.maintenance.fork import fork_checkpoint
from ckptstore_service.names import MAX_STEP, RUN_NAME_RULE, check_run_name, parse_step
from ckptstore_service.runtime import Runtime

__all__ = ["router"]

router = APIRouter()

Run = Annotated[str, Path(description=f"The run's name: {RUN_NAME_RULE}")]
_ERRORS = (
    InvalidRequest,
    RunNotFound,
    CheckpointNotFound,
    RunBusy,
    CheckpointPinned,
    StorageUnavailable,
)


@router.delete(
    "/v1/runs/{run:path}/checkpoints/{step}",
    status_code=204,
    response_class=Response,
    responses=error_responses(*_ERRORS, CorruptData),
)
async def delete_one(
    run: Run,
    step: Annotated[str, Path(description="The step: a non-negative integer (not `latest`)")],
    rt: RuntimeDep,
    maintenance: MaintenanceDep,
) -> Response:
    """Delete checkpoint `step` of the run (409 `checkpoint_pinned` if it is pinned). Every
    other checkpoint loads to the same bytes as before; the ones that rested on it are
    re-based first (saves to the run wait for that). Its blobs are collected once the grace
    time for loads in progress has passed."""
    check_run_name(run)
    step_n = parse_step(step)
    assert step_n is not None
    await _make_way(rt, run)
    done = await run_in_threadpool(
        delete_checkpoint,
        rt.catalog,
        rt.store,
        run,
        step_n,
        RerootPolicy.of(rt.settings, rt.budget),
        scratch=rt.cache.scratch,
        pool=rt.pool,
    )
    rt.cache.forget(run, done.checkpoint.id)
    maintenance.after_save(run)  # its pass collects the run's garbage once it is due
    return Response(status_code=204)


# no ``:path`` here: one segment only, so that paths deeper under a run (no route's) stay
# unrouted (404, or 400 for a bad run name) rather than 405 for every other method
@router.delete(
    "/v1/runs/{run}",
    status_code=204,
    response_class=Response,
    responses=error_responses(*_ERRORS),
)
async def delete_whole_run(run: Run, rt: RuntimeDep, maintenance: MaintenanceDep) -> Response:
    """Delete every checkpoint of the run (none if one is pinned: 409
    `checkpoint_pinned`). A later save under the same name starts a fresh
    chain. The blobs are collected once the grace time for loads in progress has passed."""
    check_run_name(run)
    await _make_way(rt, run)
    await run_in_threadpool(
        delete_run,
        rt.catalog,
        rt.store,
        run,
        RerootPolicy.of(rt.settings, rt.budget),
        scratch=rt.cache.scratch,
        pool=rt.pool,
    )
    rt.cache.forget(run, None)
    maintenance.after_save(run)
    return Response(status_code=204)


async def _make_way(rt: Runtime, run: str) -> None:
    """An admin delete's bounded wait for the run's uncommitted parts, then their end
    (:func:`make_way_for_admin_delete`; CKPTSTORE_DELETE_PARTS_WAIT_S)."""
    await run_in_threadpool(
        make_way_for_admin_delete, rt.catalog, rt.store, run, rt.settings.delete_parts_wait_s
    )


class ForkIn(BaseModel):
    """What a fork copies: checkpoint ``from_step`` of run ``from_run``."""

    model_config = ConfigDict(extra="forbid")
    from_run: str = Field(min_length=1, description=f"The source run: {RUN_NAME_RULE}")
    from_step: int = Field(ge=0, le=MAX_STEP, description="The source checkpoint's step")


@router.post(
    "/v1/runs/{run:path}/fork",
    status_code=201,
    response_model=CheckpointInfo,
    responses={
        200: {"model": CheckpointInfo, "description": "The run is this fork already (a retry)"},
        **error_responses(
            InvalidRequest,
            Forbidden,
            RunNotFound,
            CheckpointNotFound,
            CheckpointExists,
            RunBusy,
            StorageUnavailable,
        ),
    },
)
async def fork(
    run: Annotated[str, Path(description=f"The new run's name: {RUN_NAME_RULE}")],
    body: ForkIn,
    rt: RuntimeDep,
    principal: PrincipalDep,
) -> JSONResponse:
    """Make run `run` (which must have no checkpoints: 409 `checkpoint_exists`) whose first
    checkpoint, at `from_step`, loads to exactly the bytes of `from_run`'s: its chunks refer
    to the source's, nothing is copied. The run's next saves are deltas of it. Needs write on
    `run` and read on `from_run` (403). A retry that finds this very fork answers 200."""
    check_run_name(run)
    check_run_name(body.from_run)
    if not (principal.allows("read") and principal.covers(body.from_run)):
        raise Forbidden(f"{principal.describe()} may not read run {body.from_run!r}")
    info, made = await run_in_threadpool(
        fork_checkpoint, rt.catalog, rt.store, body.from_run, body.from_step, run
    )
    out = CheckpointInfo.of(info)
    return JSONResponse(out.to_json(), status_code=201 if made else 200)
