"""The record shapes both sides of the wire share: what the service's listings return and
what the client hands back. Defined once here; the catalog extends :class:`CheckpointInfo`
with the fields only the service needs (ids, blob keys), the API serves these very classes
(OpenAPI included) and the client parses them with :meth:`from_json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Self

from ckptstore_core.retention import RetentionPolicy

__all__ = [
    "LOSSY_KEY",
    "PARAM_NAMES_KEY",
    "MAX_USER_METADATA_BYTES",
    "USER_METADATA_KEY",
    "CheckpointInfo",
    "RunDetail",
    "RunInfo",
    "decode_user_metadata",
    "encode_user_metadata",
    "user_metadata",
]

#: The stored metadata key (a save's safetensors ``__metadata__``, a commit's metadata) that
#: holds a checkpoint's user metadata: a JSON object (``{"eval_loss": 0.31}``).
USER_METADATA_KEY = "ckptstore.metadata"
#: The most bytes of JSON a checkpoint's user metadata may take: it is listed with it.
MAX_USER_METADATA_BYTES = 64 << 10
#: The save header's metadata key that asks for a lossy save (docs/lossy.md): ``true`` (the
#: default parameters) or a JSON object of parameters (``ckptstore_core.lossy.Lossy``).
#: Not stored with the checkpoint's metadata: its listing's ``lossy`` says what was done.
LOSSY_KEY = "ckptstore.lossy"
#: The save header's metadata key where the client says which optimizer parameter id is
#: which model parameter (``ckptstore_core.lossy.ParamNames``, JSON; docs/lossy.md): kept
#: with the checkpoint, so that an archival pairs its weights as the save did.
PARAM_NAMES_KEY = "ckptstore.param_names"


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite(value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} is not JSON")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"key {k!r} is not a string")
            _finite(v)
    elif isinstance(value, list | tuple):
        for v in value:
            _finite(v)


def encode_user_metadata(metadata: Mapping[str, Any]) -> str:
    """User metadata as the compact JSON that travels and is stored; ``ValueError`` (or
    ``TypeError`` for a value JSON has no form for) unless it is a mapping of string keys to
    JSON values, NaN and infinities excluded, of at most :data:`MAX_USER_METADATA_BYTES`."""
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping, not {type(metadata).__name__}")
    _finite(dict(metadata))
    text = json.dumps(dict(metadata), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    if len(text.encode()) > MAX_USER_METADATA_BYTES:
        raise ValueError(
            f"metadata takes {len(text.encode())} bytes of JSON, more than the "
            f"{MAX_USER_METADATA_BYTES} allowed: keep it to small values (metrics, tags)"
        )
    return text


def decode_user_metadata(text: str) -> dict[str, Any]:
    """The user metadata stored as ``text``; ``ValueError`` unless it is what
    :func:`encode_user_metadata` accepts."""
    if len(text.encode()) > MAX_USER_METADATA_BYTES:
        raise ValueError(f"metadata over {MAX_USER_METADATA_BYTES} bytes of JSON")
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"metadata is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("metadata must be a JSON object")
    return value


def user_metadata(stored: Mapping[str, str]) -> dict[str, Any]:
    """The user metadata in a checkpoint's stored metadata (``{}`` if it has none; what a
    save or commit let in was checked then)."""
    text = stored.get(USER_METADATA_KEY)
    if text is None:
        return {}
    try:
        return decode_user_metadata(text)
    except ValueError:
        return {}


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
    metadata: dict[str, Any] = field(default_factory=dict)  # the user's, given to the save
    pinned: bool = False  # never deleted (by retention or by hand) until unpinned
    #: None: bit-exact. Else the lossy parameters (``ckptstore_core.lossy.Lossy.to_json()``)
    #: its paired fp32 weights and Adam moments were stored with (docs/lossy.md): it loads
    #: to the same bytes every time, not to the bytes saved
    lossy: dict[str, Any] | None = None
    #: who encoded its chunks and how far they are checked: ``service`` (encoded and checked
    #: by the service), else written by clients that encoded their own (``direct=True``):
    #: ``pending`` (committed, not decoded by the verifier yet; every load still checks each
    #: chunk's checksum), ``verified``, or ``corrupt`` (loads fail with corrupt_data)
    verification: str = "service"
    #: None: not asked to be lossy. Else what its lossy save (or archival) paired
    #: (``ckptstore_core.lossy.Pairing.summary()``, docs/lossy.md#which-weights-pair): how
    #: many fp32 weights, and their bytes, were paired with their Adam moments
    #: (``with_moments``, ``with_moments_bytes``), paired without (``without_moments...``),
    #: and left exact (``exact``, ``exact_bytes``), and ``layout``: how the state was read.
    pairing: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class RunInfo(_Record):
    """One run: its committed checkpoints, summed."""

    name: str
    checkpoints: int
    latest_step: int
    raw_bytes: int
    stored_bytes: int
    created: datetime


def _policy(obj: Any) -> RetentionPolicy | None:
    return None if obj is None else RetentionPolicy.from_json(obj)


@dataclass(frozen=True, slots=True)
class RunDetail:
    """One run as ``GET /v1/runs/{run}`` describes it: its record, the steps of its pinned
    checkpoints, its own retention policy and the one applied (its own, else the service's
    default; None: everything is kept)."""

    record: RunInfo
    pinned: list[int]
    retention: RetentionPolicy | None
    effective_retention: RetentionPolicy | None
    #: the bytes of the blobs the run's checkpoints own (a fork's first checkpoint: none)
    stored_bytes: int = 0
    #: the stored bytes of other runs' chunks its checkpoints rest on (a fork's source)
    shared_bytes: int = 0
    #: why retention deletes nothing now although its policy would (a checkpoint being
    #: written in parts); None: not held back
    retention_waiting: str | None = None

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RunDetail:
        record = RunInfo.from_json(obj["record"])
        return cls(
            record,
            [int(s) for s in obj["pinned"]],
            _policy(obj.get("retention")),
            _policy(obj.get("effective_retention")),
            int(obj.get("stored_bytes", record.stored_bytes)),
            int(obj.get("shared_bytes", 0)),
            obj.get("retention_waiting"),
        )
