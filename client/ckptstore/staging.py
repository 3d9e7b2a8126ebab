"""Non-blocking saves: what ``CheckpointClient.save_async`` does behind its one call.

A save that does not stall training must not read the trainer's tensors once control is back
in the training loop: the next ``optimizer.step()`` rewrites them in place. So a save is split
in two:

1. **Staging** (before ``save_async`` returns; this is the whole stall): the state is
   flattened (the skeleton of non-tensor leaves is serialised right there, so later changes
   to counters, lists or config dicts cannot leak in either) and every tensor is copied,
   bit for bit, into a host buffer: contiguous CPU tensors by memcpy, split over up to four
   threads for large states; CUDA tensors by non-blocking copies into pinned buffers; other
   accelerator tensors and strided views by ``copy_``.
2. **Upload** (in one background thread per client): the staged copy goes through the very
   code path of a synchronous :meth:`~ckptstore.CheckpointClient.save`, so the body on the
   wire, and therefore the stored checkpoint, is byte-identical to a synchronous save of the
   same state. Retries and their back-off happen there too.

The host buffers are CPU tensors, one per tensor name (page-locked for CUDA tensors, whose
copies then run as asynchronous DMAs, all awaited before staging returns), reused by the next
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
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any

import numpy as np
import torch

from ckptstore.state import FlatState, flatten, param_names
from ckptstore_core.records import CheckpointInfo, encode_user_metadata

__all__ = ["AsyncSaver", "StagingBuffers"]

logger = logging.getLogger("ckptstore")

Upload = Callable[
    [str, int, FlatState, bool | None, str | None, str | None, str | None], CheckpointInfo
]


# CPU copies are split over up to this many threads (the caller's included) once a state
# holds this many bytes: one thread's memcpy of a 70 MB state took 10 ms on a quiet 16-core
# host, four threads 3 ms. numpy's copy releases the GIL; the threads block, never spin.
_COPY_THREADS = min(4, os.cpu_count() or 1)
_SPLIT_MIN = 16 << 20

_Bytes = np.ndarray[Any, np.dtype[np.uint8]]


class StagingBuffers:
    """Host copies of a state's tensors, reused from one save to the next.

    Not thread-safe: :class:`AsyncSaver` calls :meth:`stage` only while no upload reads the
    buffers and under its own lock.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pool: ThreadPoolExecutor | None = None

    def stage(self, flat: FlatState) -> FlatState:
        """``flat`` with each tensor replaced by its copy in a contiguous CPU buffer.

        A buffer is reused when its name comes back with the same dtype and shape, else made
        anew; buffers of names that did not come back are dropped. Every copy is of the
        bits (same dtype: NaN payloads, -0.0 and all) and done when this returns.
        """
        kept: dict[str, torch.Tensor] = {}
        staged: list[tuple[str, torch.Tensor]] = []
        plain: list[tuple[_Bytes, _Bytes]] = []
        devices: set[torch.device] = set()
        for name, tensor in flat.tensors:
            source = tensor.detach()
            buf = self._buffers.get(name)
            if buf is None or buf.dtype != source.dtype or buf.shape != source.shape:
                buf = _host_buffer(source)
            if _is_plain(source):
                plain.append((_raw(buf), _raw(source)))
            elif source.device.type == "cuda" and buf.is_pinned():
                # device to pinned host memory: a DMA that overlaps the other tensors' copies
                buf.copy_(source, non_blocking=True)
                devices.add(source.device)
            else:
                # device to host, strided views, lazy neg/conj views (copy_ resolves them)
                buf.copy_(source)
            kept[name] = buf
            staged.append((name, buf))
        self._memcpy(plain)
        for device in devices:
            torch.cuda.synchronize(device)  # every copy has landed before this returns
        self._buffers = kept
        return FlatState(tensors=staged, skeleton=flat.skeleton)

    def _memcpy(self, pairs: list[tuple[_Bytes, _Bytes]]) -> None:
        """Copy each ``(dst, src)`` byte array, over a few threads when there is enough.

        Not torch's ``copy_``: it runs an OpenMP parallel region per tensor, and on a host
        whose cores are all busy (training, data loaders, a service beside it) its threads
        spin-wait for each other: 0.7 s of CPU for a 70 MB state on a loaded 2-core host,
        where these copies took 20 ms.
        """
        total = sum(dst.nbytes for dst, _ in pairs)
        if _COPY_THREADS < 2 or total < _SPLIT_MIN:
            _copy_all(pairs)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_COPY_THREADS - 1, thread_name_prefix="ckptstore-stage")
        parts = _split(pairs, _COPY_THREADS)
        futures = [self._pool.submit(_copy_all, part) for part in parts[1:]]
        try:
            _copy_all(parts[0])
        finally:
            wait_for(futures)  # none may still write once this returns, even on an error
        for future in futures:
            future.result()

    def held_elsewhere(self) -> bool:
        """Whether a buffer's memory is still held by another tensor: a view (``detach()``)
        of it that the caller handed out with the staged state and that is still alive."""
        return any(_storage_refs(b) > _base_refs() for b in self._buffers.values())

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Drop the buffers and stop the copy threads (a later :meth:`stage` restarts them)."""
        self._buffers = {}
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()


def _storage_refs(t: torch.Tensor) -> int:
    """References to ``t``'s storage (its own tensor's and other tensors' sharing it)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


_BASE_REFS: list[int] = []


def _base_refs() -> int:
    """:func:`_storage_refs` of a tensor nothing else shares (the probe counts itself)."""
    if not _BASE_REFS:
        _BASE_REFS.append(_storage_refs(torch.empty(1)))
    return _BASE_REFS[0]


def _host_buffer(source: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``source``'s dtype and shape: page-locked (pinned) when ``source`` is
    on a CUDA device, so its copy is an asynchronous DMA rather than a staged memcpy."""
    pin = source.device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)


def _is_plain(t: torch.Tensor) -> bool:
    """Bytes in host memory, in order, meaning what they say: a memcpy copies it."""
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and not t.is_neg()
        and not t.is_conj()
        and t.numel() > 0
    )


def _raw(t: torch.Tensor) -> _Bytes:
    """The bytes of a contiguous CPU tensor as a flat uint8 array sharing its memory."""
    # as_strided: a contiguous tensor may carry odd strides on size-1 dims (see tensor_bytes)
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy()


def _copy_all(pairs: list[tuple[_Bytes, _Bytes]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


def _split(pairs: list[tuple[_Bytes, _Bytes]], n: int) -> list[list[tuple[_Bytes, _Bytes]]]:
    """``pairs`` cut into ``n`` (or fewer) runs of about equal bytes, splitting arrays."""
    size = -(-sum(dst.nbytes for dst, _ in pairs) // n)
    parts: list[list[tuple[_Bytes, _Bytes]]] = [[]]
    room = size
    for dst, src in pairs:
        off = 0
        while off < dst.nbytes:
            if room == 0:
                parts.append([])
                room = size
            take = min(dst.nbytes - off, room)
            parts[-1].append((dst[off : off + take], src[off : off + take]))
            off += take
            room -= take
    return parts


class AsyncSaver:
    """One client's background saves: stage in the caller's thread, upload in one worker.

    ``upload(run, step, flat, progress, metadata, lossy)`` is the client's synchronous save
    of an already flattened state. At most one save is in flight: :meth:`submit` first waits for the
    previous one (whatever its outcome) and only then overwrites the staging buffers.
    """

    def __init__(self, upload: Upload) -> None:
        self._upload = upload
        self._lock = threading.Lock()  # serialises submit/close (the buffers are shared)
        self._staging = StagingBuffers()
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future[CheckpointInfo] | None = None
        self._worker: int | None = None  # the upload thread's ident

    def _refuse_on_worker(self, what: str) -> None:
        # A future's done-callbacks run on the upload thread: waiting there for an upload
        # (the next one is queued behind the callback) would never end.
        if threading.get_ident() == self._worker:
            raise RuntimeError(
                f"{what} cannot be called from a save_async future's done-callback (it runs "
                "on the upload thread, which the call would wait for)"
            )

    def submit(
        self,
        run: str,
        step: int,
        state: object,
        progress: bool | None,
        metadata: Mapping[str, Any] | None = None,
        lossy: str | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ) -> Future[CheckpointInfo]:
        """Stage ``state`` and start its upload; returns once the state is copied.
        ``lossy``: the lossy parameters asked for, as the save sends them (JSON); ``model``
        and ``optimizer``: the live objects, named as :meth:`CheckpointClient.save` names
        them (before the copy: the state's own tensors say which one is a parameter)."""
        self._refuse_on_worker("save_async")
        with self._lock:
            if self._last is not None:
                wait_for([self._last])
            try:
                text = None if metadata is None else encode_user_metadata(metadata)
                flat = flatten(state)
                names = param_names(model, optimizer, flat)
                flat = self._staging.stage(flat)
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
            future = self._executor.submit(self._run, run, step, flat, progress, text, lossy, names)
            self._last = future
            return future

    def _run(
        self,
        run: str,
        step: int,
        flat: FlatState,
        progress: bool | None,
        metadata: str | None,
        lossy: str | None,
        names: str | None = None,
    ) -> CheckpointInfo:
        self._worker = threading.get_ident()
        try:
            return self._upload(run, step, flat, progress, metadata, lossy, names)
        except Exception as exc:
            logger.warning("ckptstore: save_async of %s/%s failed: %s", run, step, exc)
            raise

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """The last save's result once it has finished (``None`` if there was none).

        Raises that save's error, or ``TimeoutError`` when ``timeout`` seconds pass first.
        """
        self._refuse_on_worker("wait")
        last = self._last
        return None if last is None else last.result(timeout)

    def close(self) -> None:
        """Wait for the save in flight, stop the worker and free the staging buffers.

        Never raises a save's error (that stays on its future). A later :meth:`submit`
        starts afresh.
        """
        self._refuse_on_worker("close")
        with self._lock:
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
            self._staging.clear()
