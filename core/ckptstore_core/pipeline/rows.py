"""The rows a save produces and a planner reads: what a chunk pipeline (:mod:`.chunks`)
makes of a body (:class:`TensorInfo`, :class:`NewChunk`), and the committed chunks of a
parent checkpoint it plans against (:class:`ChunkInfo`). Frozen dataclasses, the same on
both sides: the service's catalog stores and returns them; a client that encodes its own
chunks builds them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChunkInfo", "NewChunk", "TensorInfo"]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a checkpoint: where its bytes begin in the checkpoint's stream."""

    idx: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int
    checksum: bytes  # of the bytes it loads to
    #: of the bytes it was sent as, where they differ (a lossy tensor); None: ``checksum``
    sent_checksum: bytes | None = None

    @property
    def sent(self) -> bytes:
        """The checksum of the tensor as it was sent: what a retry of its save must match."""
        return self.checksum if self.sent_checksum is None else self.sent_checksum


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
