"""Where a chunk pipeline's encoded chunks go: a :class:`ChunkSink`.

The pipeline (:class:`ckptstore_core.pipeline.ChunkPipeline`) hands each encoded chunk to
its sink once, in stream order, and builds the chunk's row from the place the sink gives
back; it never sees how the bytes are stored. Implementations:

* the service's upload transactions (its save path's upload module): a blob in the
  blob store, written by a thread of its own, named by a ``writing`` row until its commit;
* a client that encodes its own chunks: the blob it uploads.

Contract:

* :meth:`ChunkSink.write` is called from one thread, in order; it appends the chunk's
  stored bytes (``parts``, concatenated) to the blob and returns ``(offset, length)`` of
  them in the blob. The parts are the sink's to keep (fresh buffers of the codec, never
  a view of a block the pipeline reuses): a sink may queue them and write them later, as
  the service's blob writer does.
* Durability and visibility are the sink's owner's business (finish, commit, abort): a
  pipeline that raises leaves the sink to be aborted by whoever opened it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

__all__ = ["Buffer", "ChunkSink"]

Buffer = bytes | bytearray | memoryview


class ChunkSink(Protocol):
    """Receives encoded chunks in order (see the module's docstring)."""

    def write(self, parts: Iterable[Buffer]) -> tuple[int, int]:
        """Append one encoded chunk (``parts`` concatenated); its (offset, length) in the
        blob."""
        ...
