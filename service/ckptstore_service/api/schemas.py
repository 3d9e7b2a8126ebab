"""JSON shapes of the API's responses."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from ckptstore_service.catalog import CheckpointInfo, RunInfo

__all__ = ["CheckpointOut", "CheckpointsOut", "RunOut", "RunsOut"]


class CheckpointOut(BaseModel):
    run: str
    step: int
    parent_step: int | None
    keyframe: bool
    chain_depth: int
    raw_bytes: int
    stored_bytes: int
    tensors: int
    created: datetime

    @classmethod
    def of(cls, info: CheckpointInfo) -> CheckpointOut:
        return cls(
            run=info.run,
            step=info.step,
            parent_step=info.parent_step,
            keyframe=info.keyframe,
            chain_depth=info.chain_depth,
            raw_bytes=info.raw_bytes,
            stored_bytes=info.stored_bytes,
            tensors=info.tensors,
            created=info.created_at,
        )


class CheckpointsOut(BaseModel):
    run: str
    checkpoints: list[CheckpointOut]


class RunOut(BaseModel):
    name: str
    checkpoints: int
    latest_step: int
    raw_bytes: int
    stored_bytes: int
    created: datetime

    @classmethod
    def of(cls, info: RunInfo) -> RunOut:
        return cls(
            name=info.name,
            checkpoints=info.checkpoints,
            latest_step=info.latest_step,
            raw_bytes=info.raw_bytes,
            stored_bytes=info.stored_bytes,
            created=info.created_at,
        )


class RunsOut(BaseModel):
    runs: list[RunOut]
