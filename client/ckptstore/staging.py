"""Non-blocking saves: what ``CheckpointClient.save_async`` does behind its one call.

A save that does not stall training must not read the trainer's tensors once control is back
in the training loop: the next ``optimizer.step()`` rewrites them in place. So a save is split
in two:

1. **Staging** (in the caller's thread; this is the whole stall): the state is flattened (the
   skeleton of non-tensor leaves is serialised right there, so later changes to counters,
   lists or config dicts cannot leak in either) and every tensor is copied into a host buffer
   with ``copy_`` (device to host for accelerator tensors; an exact copy of the bits).
2. **Upload** (in one background thread per client): the staged copy goes through the very
   code path of a synchronous :meth:`~ckptstore.CheckpointClient.save`, so the body on the
   wire, and therefore the stored checkpoint, is byte-identical to a synchronous save of the
   same state. Retries and their back-off happen there too.

The host buffers are plain (pageable) CPU tensors, one per tensor name, reused by the next
save whenever that name comes back with the same dtype and shape: steady-state saves allocate
nothing and touch no fresh pages. That reuse is why at most one save is in flight per client:
the next save waits for the previous upload before it overwrites the buffers. The cost is one
host copy of the state's tensors, held between saves until the client is closed -- unlike a
synchronous save, which streams straight from tensor memory and holds a few MiB.

Errors of a save (a state that cannot be flattened, a service that stays down, a conflicting
step) are set on its future, and logged as warnings on the ``ckptstore`` logger, never raised
into the training loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for

import torch

from ckptstore.state import FlatState, flatten
from ckptstore_core.records import CheckpointInfo

__all__ = ["AsyncSaver", "StagingBuffers"]

logger = logging.getLogger("ckptstore")

Upload = Callable[[str, int, FlatState, bool | None], CheckpointInfo]


class StagingBuffers:
    """Host copies of a state's tensors, reused from one save to the next.

    Not thread-safe: :class:`AsyncSaver` calls :meth:`stage` only while no upload reads the
    buffers and under its own lock.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, flat: FlatState) -> FlatState:
        """``flat`` with each tensor replaced by its copy in a contiguous CPU buffer.

        A buffer is reused when its name comes back with the same dtype and shape, else made
        anew; buffers of names that did not come back are dropped.
        """
        kept: dict[str, torch.Tensor] = {}
        staged: list[tuple[str, torch.Tensor]] = []
        for name, tensor in flat.tensors:
            source = tensor.detach()
            buf = self._buffers.get(name)
            if buf is None or buf.dtype != source.dtype or buf.shape != source.shape:
                buf = torch.empty(source.shape, dtype=source.dtype, device="cpu")
            # same dtype: a copy of the bits (NaN payloads, -0.0 and all); it also resolves
            # the lazy conj/neg views that tensor_bytes would otherwise resolve
            buf.copy_(source)
            kept[name] = buf
            staged.append((name, buf))
        self._buffers = kept
        return FlatState(tensors=staged, skeleton=flat.skeleton)

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers = {}


class AsyncSaver:
    """One client's background saves: stage in the caller's thread, upload in one worker.

    ``upload(run, step, flat, progress)`` is the client's synchronous save of an already
    flattened state. At most one save is in flight: :meth:`submit` first waits for the
    previous one (whatever its outcome) and only then overwrites the staging buffers.
    """

    def __init__(self, upload: Upload) -> None:
        self._upload = upload
        self._lock = threading.Lock()  # serialises submit/close (the buffers are shared)
        self._staging = StagingBuffers()
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future[CheckpointInfo] | None = None

    def submit(
        self, run: str, step: int, state: object, progress: bool | None
    ) -> Future[CheckpointInfo]:
        """Stage ``state`` and start its upload; returns once the state is copied."""
        with self._lock:
            if self._last is not None:
                wait_for([self._last])
            try:
                flat = self._staging.stage(flatten(state))
            except Exception as exc:
                # an unflattenable state, a failed device copy: the future says so, the
                # training loop goes on (as it would for a failed upload)
                logger.warning("ckptstore: save_async of %s/%s failed: %s", run, step, exc)
                failed: Future[CheckpointInfo] = Future()
                failed.set_exception(exc)
                self._last = failed
                return failed
            if self._executor is None:
                # a ThreadPoolExecutor's workers are joined at interpreter exit, so an upload
                # in flight then is finished, not cut off
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-save")
            future = self._executor.submit(self._run, run, step, flat, progress)
            self._last = future
            return future

    def _run(self, run: str, step: int, flat: FlatState, progress: bool | None) -> CheckpointInfo:
        try:
            return self._upload(run, step, flat, progress)
        except Exception as exc:
            logger.warning("ckptstore: save_async of %s/%s failed: %s", run, step, exc)
            raise

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """The last save's result once it has finished (``None`` if there was none).

        Raises that save's error, or ``TimeoutError`` when ``timeout`` seconds pass first.
        """
        last = self._last
        return None if last is None else last.result(timeout)

    def close(self) -> None:
        """Wait for the save in flight, stop the worker and free the staging buffers.

        Never raises a save's error (that stays on its future). A later :meth:`submit`
        starts afresh.
        """
        with self._lock:
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
            self._staging.clear()
