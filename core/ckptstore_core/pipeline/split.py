"""The splitter stage of a save: tensor pieces, as they arrive, into chunks.

A tensor is cut into chunks of ``codec.chunk_step(itemsize, chunk_bytes)`` bytes at fixed
offsets (the last one shorter), so the same chunk of the next checkpoint lines up with this
one. Each chunk is copied into a recycled buffer as its bytes arrive (a fresh buffer costs a
page fault per 4 KiB): the buffer's first half holds the chunk, its second half is scratch
for the chunk's base, read in the codec thread. :class:`TensorDigests` gives every tensor
its checksum: a tensor of several chunks is hashed here as it streams by; a tensor of one
chunk takes its chunk's, which the codec computes anyway.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from ckptstore_core import codec
from ckptstore_core.errors import InternalError
from ckptstore_core.wire import Header, TensorPiece

__all__ = ["RawChunk", "Splitter", "TensorDigests"]


@dataclass(frozen=True, slots=True)
class RawChunk:
    tensor_idx: int
    offset: int  # in its tensor
    raw_len: int
    itemsize: int
    file_offset: int  # in the checkpoint's data section (the base cache layout)
    block: np.ndarray  # the recycled buffer: room for the chunk, then as much for its base

    @property
    def data(self) -> np.ndarray:
        return self.block[: self.raw_len]

    @property
    def scratch(self) -> np.ndarray:
        """Room for the chunk's base, read in the codec thread."""
        return self.block[len(self.block) // 2 :]


class Splitter:
    """Cuts the pieces of ``header``'s tensors into :class:`RawChunk`\\ s; hand each block
    back with :meth:`recycle` once its chunk is encoded."""

    def __init__(self, header: Header, chunk_bytes: int, hashed: Collection[int] = ()) -> None:
        self._header = header
        self._chunk_bytes = chunk_bytes
        self._largest = codec.chunk_step(8, chunk_bytes)
        self._free: list[np.ndarray] = []
        self.digests = TensorDigests(header, chunk_bytes, hashed)

    def recycle(self, block: np.ndarray) -> None:
        self._free.append(block)

    def _block(self) -> np.ndarray:
        return self._free.pop() if self._free else np.empty(2 * self._largest, np.uint8)

    def chunks(self, pieces: Iterable[TensorPiece]) -> Iterator[RawChunk]:
        """The chunks of the tensors, in stream order; each one as soon as its last byte is
        in (pieces of one tensor must arrive in order, as the wire parser yields them)."""
        block = buf = np.empty(0, np.uint8)
        for piece in pieces:
            spec = self._header.tensors[piece.index]
            self.digests.update(piece)
            step = codec.chunk_step(spec.itemsize, self._chunk_bytes)
            data, pos = np.frombuffer(piece.data, np.uint8), piece.offset
            while len(data):
                begin = pos - pos % step  # the chunk that byte ``pos`` falls in
                end = min(begin + step, spec.nbytes)
                take = min(len(data), end - pos)
                if pos == begin:
                    block = self._block()
                    buf = block[: end - begin]
                # a numpy copy releases the GIL, which the codec threads are waiting for
                buf[pos - begin : pos - begin + take] = data[:take]
                data, pos = data[take:], pos + take
                if pos == end:
                    yield RawChunk(
                        piece.index, begin, end - begin, spec.itemsize, spec.begin + begin, block
                    )


class TensorDigests:
    """Each tensor's xxh3-128 as it is sent: hashed as it streams by when it spans several
    chunks or is one of ``hashed`` (tensors whose chunks may be stored lossy: their chunk
    checksums are the reconstruction's), its one chunk's checksum
    (:meth:`chunk_checksum`) otherwise."""

    def __init__(self, header: Header, chunk_bytes: int, hashed: Collection[int] = ()) -> None:
        self._header = header
        self._digests: list[bytes | None] = [None] * len(header.tensors)
        self._hashers = {
            i: xxhash.xxh3_128()
            for i, t in enumerate(header.tensors)
            if i in hashed or not 0 < t.nbytes <= codec.chunk_step(t.itemsize, chunk_bytes)
        }

    def update(self, piece: TensorPiece) -> None:
        hasher = self._hashers.get(piece.index)
        if hasher is not None:
            hasher.update(piece.data)

    def chunk_checksum(self, tensor_idx: int, checksum: bytes) -> None:
        if tensor_idx not in self._hashers:
            self._digests[tensor_idx] = checksum

    def finish(self) -> list[bytes]:
        """Every tensor's digest, in header order, once all its bytes went by."""
        for i, hasher in self._hashers.items():
            self._digests[i] = hasher.digest()
        out = []
        for t, digest in zip(self._header.tensors, self._digests, strict=True):
            if digest is None:
                raise InternalError(f"tensor {t.name!r} of one chunk got no chunk checksum")
            out.append(digest)
        return out
