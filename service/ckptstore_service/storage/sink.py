"""A blob written in order through any :class:`BlobStore`: :class:`BlobSink`."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Protocol

from ckptstore_core.errors import InvalidStream
from ckptstore_service.handoff import unbatched

from .base import Buffer

__all__ = ["BlobSink", "StreamTarget"]

_END = object()


class StreamTarget(Protocol):
    """Where a :class:`BlobSink` writes: a :class:`BlobStore`, or anything else that takes
    a stream of pieces under a key (a base-cache file filled by a load)."""

    def put_stream(self, key: str, chunks: Iterable[Buffer]) -> int: ...


class BlobSink:
    """A blob written in order: the :class:`ckptstore_core.pipeline.ChunkSink` of saves,
    parts and rewrites (and the writer of a load's base-cache fill). Runs
    ``store.put_stream`` in its own thread, fed through a bounded
    queue; :meth:`finish` makes the blob durable, :meth:`abort` drops it (a multipart
    upload aborted, a temp file removed).

    Payloads are handed over in batches of ~1 MiB: a checkpoint has hundreds of small chunks,
    and each hand-off wakes the writer thread.
    """

    _BATCH = 1 << 20

    def __init__(self, store: StreamTarget, key: str) -> None:
        self._q: queue.Queue[object] = queue.Queue(4)
        self._result: int | BaseException | None = None
        self._batch: list[Buffer] = []
        self._batched = 0
        self.written = 0  # bytes appended so far
        self._thread = threading.Thread(target=self._run, args=(store, key), daemon=True)
        self._thread.start()

    def _pieces(self) -> Iterator[bytes]:
        return unbatched(iter(self._q.get, None), _END)  # get() until _END (never None)

    def _run(self, store: StreamTarget, key: str) -> None:
        try:
            self._result = store.put_stream(key, self._pieces())
        except BaseException as exc:
            self._result = exc

    def _put(self, item: object) -> None:
        while self._thread.is_alive():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        self._raise()

    def _raise(self) -> None:
        if isinstance(self._result, BaseException):
            raise self._result

    def write(self, parts: Iterable[Buffer]) -> tuple[int, int]:
        """Append one chunk's stored bytes (``parts``, concatenated); returns their
        (offset, length) in the blob."""
        offset = self.written
        for data in parts:
            if len(data):
                self._batch.append(data)
                self._batched += len(data)
                self.written += len(data)
                if self._batched >= self._BATCH:
                    self._flush()
        return offset, self.written - offset

    def _flush(self) -> None:
        if self._batch:
            self._put(self._batch)
            self._batch, self._batched = [], 0

    def finish(self) -> int:
        self._flush()
        self._put(_END)
        self._thread.join()
        self._raise()
        assert isinstance(self._result, int)
        return self._result

    def abort(self) -> None:
        if self._thread.is_alive():
            self._put(InvalidStream("upload aborted"))
            self._thread.join()
