"""HTTP routes of pins, retention policies and a run's record (docs/lifecycle.md states the
rules and guarantees):

    PUT    /v1/runs/{run}/checkpoints/{step}/pin   pin a checkpoint (200: the checkpoint)
    DELETE /v1/runs/{run}/checkpoints/{step}/pin   unpin it (200: the checkpoint)
    PUT    /v1/runs/{run}/retention                set the run's policy (200), applied at once
    DELETE /v1/runs/{run}/retention                clear it: the service's default applies
    GET    /v1/runs/{run}                          the run, its pins and its policies

A policy is applied in the background (:mod:`ckptstore_service.maintenance.retention`): the
answer to a PUT comes before its deletes; ``/healthz``'s ``maintenance`` counts the pass.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ckptstore_core.errors import (
    CheckpointNotFound,
    InvalidRequest,
    RunNotFound,
    StorageUnavailable,
)
from ckptstore_core.records import CheckpointInfo, RunInfo
from ckptstore_core.retention import MAX_METRIC_CHARS, RetentionPolicy
from ckptstore_service.api.deps import MaintenanceDep, RuntimeDep
from ckptstore_service.api.openapi import error_responses
from ckptstore_service.maintenance.retention import retention_waiting
from ckptstore_service.names import RUN_NAME_RULE, check_run_name, parse_step
from ckptstore_service.runtime import Runtime

__all__ = ["KeepBestBody", "RetentionBody", "RetentionOut", "RunOut", "router"]

router = APIRouter()

Run = Annotated[str, Path(description=f"The run's name: {RUN_NAME_RULE}")]
Step = Annotated[str, Path(description="The step: a non-negative integer (not `latest`)")]
_PIN = "/v1/runs/{run:path}/checkpoints/{step}/pin"
_RETENTION = "/v1/runs/{run:path}/retention"
_PIN_ERRORS = error_responses(InvalidRequest, RunNotFound, CheckpointNotFound, StorageUnavailable)


class KeepBestBody(BaseModel):
    """Keep the ``n`` checkpoints with the lowest (``min``) or highest (``max``) number under
    ``metric`` in their metadata; those without it are never among the best."""

    model_config = ConfigDict(extra="forbid")
    metric: str = Field(min_length=1, max_length=MAX_METRIC_CHARS, examples=["eval_loss"])
    mode: Literal["min", "max"]
    n: int = Field(ge=1)


class RetentionBody(BaseModel):
    """A retention policy: a checkpoint is kept if any rule keeps it; the newest and the
    pinned ones always are. No rule: everything is kept."""

    model_config = ConfigDict(extra="forbid")
    keep_last: int | None = Field(default=None, ge=1, description="The newest N")
    keep_every: int | None = Field(
        default=None, ge=1, description="Every checkpoint whose step is a multiple of K"
    )
    keep_best: KeepBestBody | None = None
    lossy_after: int | None = Field(
        default=None,
        ge=1,
        description="Not a deletion rule: every checkpoint older than the newest K (not "
        "pinned) is re-encoded lossy in the background (docs/lossy.md#archival)",
    )
    lossy: dict[str, Any] | None = Field(
        default=None,
        description="The lossy parameters of those checkpoints (as a checkpoint's `lossy` "
        "shows them); null: the defaults. Only with lossy_after",
    )

    def policy(self) -> RetentionPolicy:
        try:
            return RetentionPolicy.from_json(self.model_dump())
        except ValueError as exc:  # the rules' combination (each field is checked above)
            raise InvalidRequest(str(exc)) from exc

    @classmethod
    def of(cls, policy: RetentionPolicy | None) -> RetentionBody | None:
        return None if policy is None else cls.model_validate(policy.to_json())


class RetentionOut(BaseModel):
    run: str
    retention: RetentionBody | None = Field(description="The run's own policy (null: none)")
    effective_retention: RetentionBody | None = Field(
        description="What is applied: the run's own policy, else the service's default "
        "(CKPTSTORE_RETENTION_*); null: everything is kept"
    )


class RunOut(RetentionOut):
    record: RunInfo = Field(description="The run, its committed checkpoints summed")
    pinned: list[int] = Field(description="The steps of its pinned checkpoints")
    stored_bytes: int = Field(
        description="The bytes of the blobs this run's checkpoints own (a fork's first "
        "checkpoint owns none); after collection, exactly what the run takes in the store"
    )
    shared_bytes: int = Field(
        description="The stored bytes of other runs' chunks this run's checkpoints rest on "
        "(a fork's source), each counted once; not in stored_bytes"
    )
    retention_waiting: str | None = Field(
        default=None,
        description="Why retention deletes nothing now although the effective policy would "
        "delete some checkpoints (a checkpoint being written in parts); null: not held back",
    )


def _retention_out(rt: Runtime, run: str) -> RetentionOut:
    own = rt.catalog.retention(run)
    default = rt.settings.default_retention()
    return RetentionOut(
        run=run,
        retention=RetentionBody.of(own),
        effective_retention=RetentionBody.of(own if own is not None else default),
    )


async def _pin(rt: Runtime, run: str, step: str, pinned: bool) -> CheckpointInfo:
    check_run_name(run)
    step_n = parse_step(step)
    assert step_n is not None
    info = await run_in_threadpool(rt.catalog.set_pinned, run, step_n, pinned)
    return CheckpointInfo.of(info)


@router.put(_PIN, response_model=CheckpointInfo, responses=_PIN_ERRORS)
async def pin(run: Run, step: Step, rt: RuntimeDep) -> CheckpointInfo:
    """Pin checkpoint `step`: no delete takes it (by hand: 409 `checkpoint_pinned`; retention
    keeps it) until it is unpinned. Pinning a pinned checkpoint changes nothing."""
    return await _pin(rt, run, step, True)


@router.delete(_PIN, response_model=CheckpointInfo, responses=_PIN_ERRORS)
async def unpin(
    run: Run, step: Step, rt: RuntimeDep, maintenance: MaintenanceDep
) -> CheckpointInfo:
    """Unpin checkpoint `step`; the run's retention policy may then delete it (in the
    background, at once)."""
    info = await _pin(rt, run, step, False)
    maintenance.run_now(run)
    return info


@router.put(
    _RETENTION,
    response_model=RetentionOut,
    responses=error_responses(InvalidRequest, StorageUnavailable),
)
async def set_retention(
    run: Run, body: RetentionBody, rt: RuntimeDep, maintenance: MaintenanceDep
) -> RetentionOut:
    """Set the run's retention policy (replacing any it had; the run needs no checkpoint
    yet). It is applied at once, in the background, and after each save: the checkpoints it
    does not keep are deleted as `DELETE .../checkpoints/{step}` would, and with
    `lossy_after` those older than the newest K are re-encoded lossy."""
    check_run_name(run)
    await run_in_threadpool(rt.catalog.set_retention, run, body.policy())
    maintenance.run_now(run)
    return await run_in_threadpool(_retention_out, rt, run)


@router.delete(
    _RETENTION,
    response_model=RetentionOut,
    responses=error_responses(InvalidRequest, StorageUnavailable),
)
async def clear_retention(run: Run, rt: RuntimeDep, maintenance: MaintenanceDep) -> RetentionOut:
    """Clear the run's own policy: the service's default applies (if it has one)."""
    check_run_name(run)
    await run_in_threadpool(rt.catalog.set_retention, run, None)
    maintenance.run_now(run)
    return await run_in_threadpool(_retention_out, rt, run)


def _run_out(rt: Runtime, run: str) -> RunOut:
    found = rt.catalog.list_runs(run)
    if not found:
        raise RunNotFound(f"run {run!r} has no checkpoints")
    pinned = [i.step for i in rt.catalog.list_checkpoints(run) if i.pinned]
    policies = _retention_out(rt, run)
    return RunOut(
        record=found[0],
        pinned=pinned,
        stored_bytes=found[0].stored_bytes,
        shared_bytes=rt.catalog.shared_bytes(run),
        retention_waiting=retention_waiting(rt.catalog, run, rt.settings.default_retention()),
        **dict(policies),
    )


# one segment, as DELETE /v1/runs/{run}: deeper paths stay unrouted
@router.get(
    "/v1/runs/{run}",
    response_model=RunOut,
    responses=error_responses(InvalidRequest, RunNotFound, StorageUnavailable),
)
async def get_run(run: Run, rt: RuntimeDep) -> RunOut:
    """The run (its committed checkpoints summed), the steps of its pinned checkpoints, its
    own retention policy and the one applied (its own, else the service's default), and
    its bytes: those of the blobs it owns, and those of other runs' chunks it rests on (a
    fork's source) apart."""
    check_run_name(run)
    return await run_in_threadpool(_run_out, rt, run)
