"""The catalog's records: frozen dataclasses, never ORM objects, so that a caller holds no
session (and no connection) across a long upload or load."""

from __future__ import annotations

from dataclasses import dataclass

from ckptstore_core.records import CheckpointInfo

__all__ = ["CheckpointRecord", "ChunkInfo", "NewChunk", "TensorInfo"]


@dataclass(frozen=True, slots=True)
class CheckpointRecord(CheckpointInfo):
    """A committed checkpoint as listed, with what only the service needs of it."""

    id: int
    since_keyframe: int
    blob_key: str
    metadata: dict[str, str]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a checkpoint: where its bytes begin in the checkpoint's stream."""

    idx: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int
    checksum: bytes


@dataclass(frozen=True, slots=True)
class NewChunk:
    """A chunk as a save records it: its slice of a tensor and how it is stored."""

    tensor_idx: int
    offset: int
    raw_len: int
    itemsize: int
    codec: str
    base_id: int | None
    depth: int
    blob_offset: int
    stored_len: int
    checksum: bytes


@dataclass(frozen=True, slots=True)
class ChunkInfo(NewChunk):
    """A committed chunk: its row id and where its bytes live."""

    id: int
    blob_key: str  # of its checkpoint
    checkpoint_id: int
