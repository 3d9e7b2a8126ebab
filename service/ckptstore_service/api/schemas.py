"""The JSON envelopes of the API's listings; the records inside are the core's own
(:mod:`ckptstore_core.records`), the very classes the client parses them into."""

from __future__ import annotations

from pydantic import BaseModel

from ckptstore_core.records import CheckpointInfo, RunInfo

__all__ = ["CheckpointsOut", "RunsOut"]


class CheckpointsOut(BaseModel):
    run: str
    checkpoints: list[CheckpointInfo]


class RunsOut(BaseModel):
    runs: list[RunInfo]
