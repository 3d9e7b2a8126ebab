"""HTTP routes of checkpoints written in parts (a distributed save), and the reads a
resharding load makes: a checkpoint's table of tensors, and a chosen few of its tensors.

    PUT  /v1/runs/{run}/checkpoints/{step}/parts/{part}   one writer's part (safetensors)
    POST /v1/runs/{run}/checkpoints/{step}/parts/{part}/check  before its body: committed?
    POST /v1/runs/{run}/checkpoints/{step}/commit         {"parts": [...], "metadata": {...}}
    GET  /v1/runs/{run}/checkpoints/{step}/info           record, metadata, tensor table
    POST /v1/runs/{run}/checkpoints/{step}/select         {"names": [...]} -> safetensors

and those of writers that encode their own chunks (``direct=True``, docs/scale.md):

    POST /v1/runs/{run}/checkpoints/{step}/plan                 {"names": [...]} -> the plan
    PUT  /v1/runs/{run}/checkpoints/{step}/parts/{part}/encoded  the encoded part
    POST /v1/runs/{run}/checkpoints/{step}/parts/{part}/upload   presigned URLs (S3)
    POST /v1/runs/{run}/checkpoints/{step}/parts/{part}/uploaded its rows, the bytes in S3

and of clients that decode their own loads (``direct=True``, :mod:`ckptstore_service.ranges`):

    POST /v1/runs/{run}/checkpoints/{step}/ranges     {"prefix" | "names"} -> the layout
    GET  /v1/runs/{run}/checkpoints/{step}/blobs/{i}  ?start=&end=: stored bytes, unchanged
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ckptstore_core.codec import Buffer
from ckptstore_core.encoded import CONTENT_TYPE as ENCODED
from ckptstore_core.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CorruptData,
    InvalidRequest,
    InvalidStream,
    PayloadTooLarge,
    RunNotFound,
    StorageUnavailable,
)
from ckptstore_core.records import CheckpointInfo
from ckptstore_service.api.body import Uploads, consume_body
from ckptstore_service.api.deps import MaintenanceDep, RuntimeDep, UploadLimiterDep
from ckptstore_service.api.openapi import CHECKPOINT_STREAM, SAFETENSORS_BODY, error_responses
from ckptstore_service.api.routes import stream_response
from ckptstore_service.api.schemas import (
    CheckIn,
    CheckOut,
    CheckpointDetail,
    CommitIn,
    PartOut,
    PlanIn,
    RangesIn,
    SelectIn,
    UploadedIn,
    UploadIn,
)
from ckptstore_service.catalog import PartRecord
from ckptstore_service.names import check_run_name, parse_step
from ckptstore_service.restore import resolving_latest, tensors_of
from ckptstore_service.save.direct import Uploaded

__all__ = ["router"]

router = APIRouter()

_CHECKPOINT = "/v1/runs/{run:path}/checkpoints/{step}"
Run = Annotated[str, Path(description="The run's name")]
Step = Annotated[str, Path(description="The step: a non-negative integer")]
PartName = Annotated[str, Path(description="The part's name (one per writer: `rank-3`)")]
_READ = (InvalidRequest, RunNotFound, CheckpointNotFound, CorruptData, StorageUnavailable)


@router.put(
    _CHECKPOINT + "/parts/{part}",
    status_code=201,
    response_model=PartOut,
    responses={
        200: {"model": PartOut, "description": "Stored already, with the same content"},
        **error_responses(
            InvalidRequest, InvalidStream, CheckpointExists, PayloadTooLarge, StorageUnavailable
        ),
    },
    openapi_extra=SAFETENSORS_BODY,
)
async def save_part(
    run: Run,
    step: Step,
    part: PartName,
    request: Request,
    rt: RuntimeDep,
    uploads: UploadLimiterDep,
) -> JSONResponse:
    """Store one writer's part of checkpoint `step`: invisible until the commit names it.
    Parts of one checkpoint may be uploaded at the same time, through any replica."""
    return await _stored_part(run, step, part, request, uploads, rt.parts.ingest_part)


@router.post(
    _CHECKPOINT + "/parts/{part}/check",
    response_model=CheckOut,
    responses=error_responses(
        InvalidRequest, InvalidStream, CheckpointExists, PayloadTooLarge, StorageUnavailable
    ),
)
async def check_part(
    run: Run, step: Step, part: PartName, body: CheckIn, rt: RuntimeDep
) -> dict[str, Any]:
    """Before a part's body is sent: whether step `step` is committed already and, if so,
    whether the part (its header, and the checksums of its tensors) holds the committed
    content, compared from the checksums alone (a region of another rank layout is read
    back and hashed here). `committed: false`: upload the part as usual; `same: true`: the
    part's save is done, nothing is stored; other content: a 409 naming the tensor."""
    check_run_name(run)
    step_n = _step(step)
    committed, stored = await run_in_threadpool(
        rt.parts.check, run, step_n, part, body.header, body.checksums
    )
    same = committed and stored is not None
    out = _part_out(run, step_n, stored) if stored is not None else None
    return CheckOut(committed=committed, same=True if same else None, part=out).model_dump()


async def _stored_part(
    run: str,
    step: str,
    part: str,
    request: Request,
    uploads: Uploads,
    ingest: Callable[[str, int, str, Iterable[Buffer], int | None], tuple[PartRecord, bool]],
) -> JSONResponse:
    """A part's body handed to ``ingest`` in a worker thread; the stored part's JSON."""
    check_run_name(run)
    step_n = _step(step)
    stored, created = await consume_body(
        request, uploads, lambda body, length: ingest(run, step_n, part, body, length)
    )
    return _part_answer(run, step_n, stored, created)


def _part_answer(run: str, step_n: int, stored: PartRecord, created: bool) -> JSONResponse:
    out = _part_out(run, step_n, stored)
    return JSONResponse(out.model_dump(), status_code=201 if created else 200)


def _part_out(run: str, step_n: int, stored: PartRecord) -> PartOut:
    return PartOut(
        run=run,
        step=step_n,
        part=stored.name,
        tensors=stored.n_tensors,
        raw_bytes=stored.raw_bytes,
        stored_bytes=stored.stored_bytes,
        committed=stored.id == 0,  # the record of a part compared, not stored: no row
    )


@router.post(_CHECKPOINT + "/plan", responses=error_responses(InvalidRequest, StorageUnavailable))
async def plan(run: Run, step: Step, body: PlanIn, rt: RuntimeDep) -> dict[str, Any]:
    """What a writer that encodes its own chunks (`direct=True`, docs/scale.md) encodes a
    part of checkpoint `step` against: the step's parent, the keyframe and depth rules, the
    chunk size, and the parent's tensors and chunks of the names given
    (`ckptstore_core.encoded.Plan`)."""
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
            "content": {ENCODED: {"schema": {"type": "string", "format": "binary"}}},
            "description": "A part its writer encoded: its safetensors header, each chunk's "
            "stored bytes as a frame, and a tail of rows (docs/wire-format.md)",
        }
    },
)
async def save_encoded_part(
    run: Run,
    step: Step,
    part: PartName,
    request: Request,
    rt: RuntimeDep,
    uploads: UploadLimiterDep,
) -> JSONResponse:
    """Store one writer's part of checkpoint `step` as it encoded it (stored as sent,
    checked against the service's own plan, decoded later by the verifier): invisible until
    the commit names it."""
    return await _stored_part(run, step, part, request, uploads, rt.direct.ingest)


@router.post(
    _CHECKPOINT + "/parts/{part}/upload",
    responses=error_responses(InvalidRequest, PayloadTooLarge, StorageUnavailable),
)
async def open_upload(
    run: Run, step: Step, part: PartName, body: UploadIn, rt: RuntimeDep
) -> dict[str, Any]:
    """A presigned upload of one writer's encoded part straight to the store (S3; the
    plan's `presigned` says whether there is one): its key, id, part size and one URL per
    part, each valid for that key and upload only, for `CKPTSTORE_URL_TTL_S`."""
    check_run_name(run)
    step_n = _step(step)
    return await run_in_threadpool(rt.direct.open_upload, run, step_n, part, body.max_bytes)


@router.post(
    _CHECKPOINT + "/parts/{part}/uploaded",
    status_code=201,
    response_model=PartOut,
    responses={
        200: {"model": PartOut, "description": "Stored already, with the same content"},
        **error_responses(
            InvalidRequest, InvalidStream, CheckpointExists, PayloadTooLarge, StorageUnavailable
        ),
    },
)
async def register_uploaded_part(
    run: Run, step: Step, part: PartName, body: UploadedIn, rt: RuntimeDep
) -> JSONResponse:
    """Register one writer's part whose encoded bytes it uploaded through `.../upload`'s
    URLs: the upload is completed once its parts hold exactly the chunks' sizes (never
    read here), the rows are checked as an encoded part's; invisible until the commit."""
    check_run_name(run)
    step_n = _step(step)
    doc = Uploaded(body.key, body.upload_id, body.header, body.sizes, body.tail)
    stored, created = await run_in_threadpool(rt.direct.register, run, step_n, part, doc)
    return _part_answer(run, step_n, stored, created)


@router.post(
    _CHECKPOINT + "/commit",
    status_code=201,
    response_model=CheckpointInfo,
    responses={
        200: {"model": CheckpointInfo, "description": "Committed already, with the same content"},
        **error_responses(InvalidRequest, CheckpointExists, PayloadTooLarge, StorageUnavailable),
    },
)
async def commit_parts(
    run: Run, step: Step, body: CommitIn, rt: RuntimeDep, maintenance: MaintenanceDep
) -> JSONResponse:
    """Make checkpoint `step` visible, made of the named parts in that order (each must be
    stored); `latest` moves. Parts stored but not named are deleted."""
    check_run_name(run)
    step_n = _step(step)
    info, created = await run_in_threadpool(rt.parts.commit, run, step_n, body.parts, body.metadata)
    if created:
        maintenance.after_save(run)
    return JSONResponse(CheckpointInfo.of(info).to_json(), status_code=201 if created else 200)


@router.get(
    "/v1/runs/{run:path}/checkpoints/{step}/info",
    response_model=CheckpointDetail,
    responses=error_responses(*_READ),
)
async def checkpoint_info(
    run: Run,
    step: Annotated[str, Path(description="A step or `latest`")],
    rt: RuntimeDep,
) -> dict[str, Any]:
    """The checkpoint's record, its metadata and its tensors (name, dtype, shape)."""
    check_run_name(run)
    step_n = parse_step(step, allow_latest=True)

    def read() -> dict[str, Any]:
        info = rt.catalog.get(run, step_n)
        tensors = tensors_of(rt.catalog, info)
        return {
            "checkpoint": CheckpointInfo.of(info).to_json(),
            "metadata": info.stored_metadata,
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in tensors
            ],
        }

    return await run_in_threadpool(resolving_latest, run, step_n, read)


@router.post(
    "/v1/runs/{run:path}/checkpoints/{step}/select",
    response_model=None,
    response_class=Response,
    responses={200: CHECKPOINT_STREAM, **error_responses(*_READ)},
)
async def select_tensors(
    run: Run,
    step: Annotated[str, Path(description="A step or `latest`")],
    body: SelectIn,
    rt: RuntimeDep,
) -> StreamingResponse:
    """Only the named tensors of the checkpoint (in its order), as a safetensors stream:
    only their chunks are read from storage."""
    check_run_name(run)
    step_n = parse_step(step, allow_latest=True)
    restore = await run_in_threadpool(rt.loader.open, run, step_n, None, body.names)
    return stream_response(restore)


@router.post(_CHECKPOINT + "/ranges", responses=error_responses(*_READ))
async def ranges(
    run: Run,
    step: Annotated[str, Path(description="A step or `latest`")],
    body: RangesIn,
    rt: RuntimeDep,
) -> dict[str, Any]:
    """What a client that decodes its own load (`direct=True`, docs/scale.md) reads: the
    tensors under `prefix` (or `names`, or all), every chunk their chains reach (codec,
    base, blob, range, checksum) and the blobs, each with a presigned URL where the store
    hands them out (S3), else read through `GET .../blobs/{i}`."""
    check_run_name(run)
    step_n = parse_step(step, allow_latest=True)
    return await run_in_threadpool(rt.ranges.layout, run, step_n, body.prefix, body.names)


@router.get(
    _CHECKPOINT + "/blobs/{index}",
    response_model=None,
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The bytes"},
        **error_responses(*_READ),
    },
)
async def blob_range(
    run: Run,
    step: Step,
    index: Annotated[int, Path(description="The blob's place in the layout's `blobs`")],
    start: Annotated[int, Query(ge=0)],
    end: Annotated[int, Query(ge=0)],
    rt: RuntimeDep,
) -> StreamingResponse:
    """Bytes `[start, end)` of a blob that checkpoint `step`'s chains read, as stored (a
    direct load decodes them)."""
    check_run_name(run)
    body = await run_in_threadpool(rt.ranges.blob_range, run, _step(step), index, start, end)
    return StreamingResponse(
        body,
        media_type="application/octet-stream",
        headers={"Content-Length": str(end - start)},
    )


def _step(step: str) -> int:
    step_n = parse_step(step)
    assert step_n is not None
    return step_n
