"""The record shapes both sides of the wire share: what the service's listings return and
what the client hands back. Defined once here; the catalog extends :class:`CheckpointInfo`
with the fields only the service needs (ids, blob keys), the API serves these very classes
(OpenAPI included) and the client parses them with :meth:`from_json`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Self

__all__ = ["CheckpointInfo", "RunInfo"]


class _Record:
    """JSON both ways: ``created`` travels as an ISO 8601 string, UTC written ``Z`` (as
    the API's pydantic listings write it)."""

    @classmethod
    def of(cls, record: object) -> Self:
        """This shape's fields of ``record`` (an instance of a subclass, say)."""
        return cls(**{f.name: getattr(record, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        out["created"] = out["created"].isoformat().replace("+00:00", "Z")
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        # fields a newer service adds are ignored: an older client still reads its listings
        kwargs = {k: v for k, v in obj.items() if k in names}
        kwargs["created"] = datetime.fromisoformat(obj["created"])
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class CheckpointInfo(_Record):
    """One committed checkpoint, as listed."""

    run: str
    step: int
    parent_step: int | None  # the checkpoint its deltas were taken against, if any
    keyframe: bool  # holds no deltas: loads without any other checkpoint
    chain_depth: int  # the longest delta chain a load of it decodes
    raw_bytes: int  # tensor bytes as saved
    stored_bytes: int  # bytes in blob storage
    tensors: int
    created: datetime
    parts: int = 1  # how many writers (ranks) it was written by, committed once


@dataclass(frozen=True, slots=True)
class RunInfo(_Record):
    """One run: its committed checkpoints, summed."""

    name: str
    checkpoints: int
    latest_step: int
    raw_bytes: int
    stored_bytes: int
    created: datetime
