"""The JSON bodies of the API: the listings' envelopes and the one error body.

The records inside the listings are the core's own (:mod:`ckptstore_core.records`), the very
classes the client parses them into. :class:`ErrorBody` is what
:meth:`ckptstore_core.errors.CkptStoreError.to_json` writes, for every error of any route.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

from ckptstore_core.names import RUN_NAME_RULE
from ckptstore_core.records import CheckpointInfo, RunInfo

__all__ = [
    "CheckIn",
    "CheckOut",
    "CheckpointDetail",
    "CheckpointsOut",
    "CommitIn",
    "ErrorBody",
    "ErrorDetail",
    "PartOut",
    "PlanIn",
    "RunsOut",
    "SelectIn",
    "TensorOut",
]


class CheckpointsOut(BaseModel):
    run: str
    checkpoints: list[CheckpointInfo] = Field(description="The committed checkpoints, by step")


class RunsOut(BaseModel):
    runs: list[RunInfo] = Field(description="Every run with at least one committed checkpoint")


class ErrorDetail(BaseModel):
    code: str = Field(
        description="Stable and machine-readable; each response lists the codes of its status",
        examples=["invalid_request"],
    )
    message: str = Field(
        description="For people: what was wrong",
        examples=[f"invalid run name 'team/exp1': {RUN_NAME_RULE}"],
    )


class ErrorBody(BaseModel):
    """Every error the service answers, whatever the route and status."""

    error: ErrorDetail


class PartOut(BaseModel):
    """One writer's part of a checkpoint, stored (invisible until the commit)."""

    run: str
    step: int
    part: str
    tensors: int
    raw_bytes: int
    stored_bytes: int
    committed: bool = Field(
        default=False,
        description="The step was committed already and holds this part's content: nothing "
        "was stored (a save run again)",
    )


class CheckIn(BaseModel):
    header: str = Field(
        description="The part's safetensors header (its JSON), as its upload would send it"
    )
    checksums: dict[str, str] | None = Field(
        None,
        description="The xxh3-128 (hex) of each tensor's bytes, by name: every tensor of the "
        "header. Without them only the header is compared (the bytes are hashed only "
        "once the step is known to be committed)",
    )


class CheckOut(BaseModel):
    """What a writer learns before it sends a part's body."""

    committed: bool = Field(
        description="The step is committed already. False: send the part as usual"
    )
    same: bool | None = Field(
        None,
        description="True: the part holds the committed content, its save is done (`part`) "
        "and its body is not to be sent. None: committed, but no checksums were given: ask "
        "again with them. Other content is a 409",
    )
    part: PartOut | None = Field(None, description="The part compared, not stored (`same`)")


class CommitIn(BaseModel):
    parts: list[str] = Field(
        min_length=1, description="Every part of the checkpoint, in the order of its tensors"
    )
    metadata: dict[str, str] = Field(
        default_factory=dict, description="The checkpoint's metadata (a DCP plan, say)"
    )


class PlanIn(BaseModel):
    names: list[str] = Field(description="The tensors of the part to be encoded, by name")


class SelectIn(BaseModel):
    names: list[str] = Field(description="The tensors to read, by name")


class UploadIn(BaseModel):
    max_bytes: int = Field(ge=0, description="The most encoded bytes the part may hold")


class UploadedIn(BaseModel):
    key: str = Field(description="The upload's key, as `.../upload` answered")
    upload_id: str = Field(description="The upload's id, as `.../upload` answered")
    header: str = Field(description="The part's safetensors header (its JSON)")
    sizes: list[Annotated[int, Field(ge=0)]] = Field(
        description="Each chunk's stored bytes, in blob order"
    )
    tail: dict[str, Any] = Field(description="The tail of rows, as in an encoded body")


class RangesIn(BaseModel):
    prefix: str | None = Field(None, description="Only the tensors whose names start with it")
    names: list[str] | None = Field(None, description="Only these stored tensors, by name")


class TensorOut(BaseModel):
    name: str
    dtype: str
    shape: list[int]


class CheckpointDetail(BaseModel):
    checkpoint: CheckpointInfo
    metadata: dict[str, str]
    tensors: list[TensorOut]
