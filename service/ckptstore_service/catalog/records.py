"""The catalog's records: frozen dataclasses, never ORM objects, so that a caller holds no
session (and no connection) across a long upload or load.

What the catalog returns (:class:`CheckpointRecord`, :class:`TensorInfo`, :class:`ChunkInfo`)
and what callers hand it: a save's rows (:class:`TensorInfo`, :class:`NewChunk`), a re-root's
changes to committed rows (:class:`ChunkUpdate`, :class:`CheckpointUpdate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptstore_core.pipeline.rows import ChunkInfo, NewChunk, TensorInfo
from ckptstore_core.records import CheckpointInfo

__all__ = [
    "CheckpointRecord",
    "CheckpointUpdate",
    "ChunkInfo",
    "ChunkUpdate",
    "NewChunk",
    "TensorInfo",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRecord(CheckpointInfo):
    """A committed checkpoint as listed, with what only the service needs of it (keyword
    fields: they follow the listing's, some of which have defaults)."""

    id: int
    since_keyframe: int
    blob_key: str
    # what the save's safetensors header or the commit carried (the skeleton, DCP's
    # metadata, the user's under USER_METADATA_KEY: the listing's ``metadata``), served
    # back with its tensors
    stored_metadata: dict[str, str]


@dataclass(frozen=True, slots=True)
class ChunkUpdate:
    """A re-root's change to a committed chunk: how it is stored from its commit on.

    Only these fields change. The row keeps its id, its slice of its tensor and its raw
    length: the base ids of later chunks that point at it stay valid. Its checksum changes
    only where its bytes do: ``checksum`` is set only by an archival to the lossy tier
    (:mod:`ckptstore_service.maintenance.archive`: the reconstruction's); None keeps it.
    """

    id: int
    codec: str
    base_id: int | None
    depth: int
    blob_offset: int  # in its checkpoint's (new) blob
    stored_len: int
    checksum: bytes | None = None

    @classmethod
    def of(cls, chunk: ChunkInfo) -> ChunkUpdate:
        """``chunk`` stored as it is now: change fields with :func:`dataclasses.replace`."""
        return cls(
            chunk.id, chunk.codec, chunk.base_id, chunk.depth, chunk.blob_offset, chunk.stored_len
        )


@dataclass(frozen=True, slots=True)
class CheckpointUpdate:
    """A re-root's change to a committed checkpoint: its blob and the figures that follow
    from its chunks' new encodings."""

    id: int
    old_blob_key: str  # the blob the re-root read: the commit fails if it is not this any more
    blob_key: str  # its blob from the commit on (``old_blob_key`` if it was not rewritten)
    stored_bytes: int
    chain_depth: int
    keyframe: bool
