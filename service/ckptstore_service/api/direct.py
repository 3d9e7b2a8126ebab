"""HTTP routes of parts whose writers encoded their own chunks (``direct=True``,
docs/scale.md; the body's format: docs/wire-format.md#encoded-parts):

    POST /v1/runs/{run}/checkpoints/{step}/plan                {"names": [...]} -> the plan
    PUT  /v1/runs/{run}/checkpoints/{step}/parts/{part}/encoded  the encoded part

The part is committed like any other (``POST .../commit``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from ckptstore_core.encoded import CONTENT_TYPE
from ckptstore_core.errors import (
    CheckpointExists,
    InvalidRequest,
    InvalidStream,
    PayloadTooLarge,
    StorageUnavailable,
)
from ckptstore_service.api.body import consume_body
from ckptstore_service.api.deps import RuntimeDep, UploadLimiterDep
from ckptstore_service.api.openapi import error_responses
from ckptstore_service.api.schemas import PartOut
from ckptstore_service.names import check_run_name, parse_step

__all__ = ["router"]

router = APIRouter()

_CHECKPOINT = "/v1/runs/{run:path}/checkpoints/{step}"
Run = Annotated[str, Path(description="The run's name")]
Step = Annotated[str, Path(description="The step: a non-negative integer")]


class PlanIn(BaseModel):
    names: list[str] = Field(description="The tensors of the part to be encoded, by name")


def _step(step: str) -> int:
    n = parse_step(step)
    assert n is not None
    return n


@router.post(
    _CHECKPOINT + "/plan",
    responses=error_responses(InvalidRequest, StorageUnavailable),
)
async def plan(run: Run, step: Step, body: PlanIn, rt: RuntimeDep) -> dict[str, Any]:
    """What a writer encodes a part of checkpoint `step` against: the step's parent, the
    keyframe and depth rules, the chunk size, and the parent's tensors and chunks of the
    names given (`ckptstore_core.encoded.Plan`)."""
    check_run_name(run)
    step_n = _step(step)
    found = await run_in_threadpool(rt.direct.plan, run, step_n, body.names)
    return found.to_json()


@router.put(
    _CHECKPOINT + "/parts/{part}/encoded",
    status_code=201,
    response_model=PartOut,
    responses={
        200: {"model": PartOut, "description": "Stored already, with the same content"},
        **error_responses(
            InvalidRequest, InvalidStream, CheckpointExists, PayloadTooLarge, StorageUnavailable
        ),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}},
            "description": "A part its writer encoded: its safetensors header, each chunk's "
            "stored bytes as a frame, and a tail of rows (docs/wire-format.md)",
        }
    },
)
async def save_encoded_part(
    run: Run,
    step: Step,
    part: Annotated[str, Path(description="The part's name (one per writer: `rank-3`)")],
    request: Request,
    rt: RuntimeDep,
    uploads: UploadLimiterDep,
) -> JSONResponse:
    """Store one writer's part of checkpoint `step` as it encoded it (stored as sent,
    checked against the service's own plan, decoded later by the verifier): invisible until
    the commit names it."""
    check_run_name(run)
    step_n = _step(step)
    stored, created = await consume_body(
        request,
        uploads,
        lambda body, length: rt.direct.ingest(run, step_n, part, body, length),
    )
    out = PartOut(
        run=run,
        step=step_n,
        part=stored.name,
        tensors=stored.n_tensors,
        raw_bytes=stored.raw_bytes,
        stored_bytes=stored.stored_bytes,
    )
    return JSONResponse(out.model_dump(), status_code=201 if created else 200)
