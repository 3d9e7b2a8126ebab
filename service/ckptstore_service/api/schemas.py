"""JSON shapes of the API's responses, read straight off the catalog's dataclasses."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CheckpointOut", "CheckpointsOut", "RunOut", "RunsOut"]


class _FromCatalog(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class CheckpointOut(_FromCatalog):
    run: str
    step: int
    parent_step: int | None
    keyframe: bool
    chain_depth: int
    raw_bytes: int
    stored_bytes: int
    tensors: int
    created: datetime = Field(validation_alias="created_at")


class CheckpointsOut(BaseModel):
    run: str
    checkpoints: list[CheckpointOut]


class RunOut(_FromCatalog):
    name: str
    checkpoints: int
    latest_step: int
    raw_bytes: int
    stored_bytes: int
    created: datetime = Field(validation_alias="created_at")


class RunsOut(BaseModel):
    runs: list[RunOut]
