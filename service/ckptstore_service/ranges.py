"""Direct loads (``direct=True``, docs/scale.md): the service answers which blob ranges make
up a checkpoint's tensors, and the client fetches and decodes them itself
(:mod:`ckptstore_core.chain`, the same decoder as a load here).

    client: POST .../ranges {"prefix" | "names"} -> the layout: the tensors, every chunk
            their chains reach (codec, base, blob, offset, length, checksum) and the blobs
            -> ranged reads of the blobs -> decode -> check each chunk and tensor
    here:   the catalog's rows, one query; the blobs: a presigned ranged GET URL per blob
            where the store hands them out (S3), else ``GET .../blobs/{i}``, which streams
            the stored bytes of a range unchanged (never decodes them)

A blob is read only through the checkpoint that needs it: ``blobs/{i}`` is the ``i``-th
blob of that checkpoint's chains (another run's, for a fork), so a token that may read the
run reads no other blob. A presigned URL names one key and expires.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from ckptstore_core.assemble import full_view
from ckptstore_core.errors import CorruptData, InvalidRequest
from ckptstore_core.records import CheckpointInfo
from ckptstore_service.catalog import Catalog, ChunkInfo
from ckptstore_service.restore import corrupt_verdict, resolving_latest, selected, tensors_of
from ckptstore_service.storage import BlobStore

__all__ = ["DirectLoads", "layout_rows"]

_SEND_BYTES = 1 << 20
_KEPT = 256  # checkpoints whose blob lists are kept for their range reads


class DirectLoads:
    """The layouts of direct loads and the range reads behind them (see the module's
    docstring); ``url_ttl_s``: how long a presigned URL lives."""

    def __init__(self, catalog: Catalog, store: BlobStore, url_ttl_s: int, presign: bool) -> None:
        self._catalog = catalog
        self._store = store
        self._ttl = url_ttl_s
        self._presign = presign
        self._blobs: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def layout(
        self, run: str, step: int | None, prefix: str | None, names: Collection[str] | None
    ) -> dict[str, Any]:
        """What a client needs to load the tensors under ``prefix`` (or ``names``, or all)
        of ``run/step`` itself (``step`` None: latest). Without ``names``, a checkpoint
        written through DCP answers the stored tensors its full view reads
        (:func:`ckptstore_core.assemble.full_view`, which the client runs too)."""
        return resolving_latest(run, step, lambda: self._layout(run, step, prefix, names))

    def _layout(
        self, run: str, step: int | None, prefix: str | None, names: Collection[str] | None
    ) -> dict[str, Any]:
        info = self._catalog.get(run, step)
        corrupt_verdict(info)
        tensors = tensors_of(self._catalog, info)
        view = full_view(info.stored_metadata, tensors, prefix) if names is None else None
        tensors = view.stored if view is not None else selected(info, tensors, prefix, names)
        own, closure = self._catalog.chunk_tree(info.id)
        keys = self._remember(info.id, closure.values())
        wanted = {t.idx for t in tensors}
        reached = _reached([c for c in own if c.tensor_idx in wanted], closure)
        urls = [self._store.presigned_get(k, self._ttl) if self._presign else None for k in keys]
        return {
            "checkpoint": CheckpointInfo.of(info).to_json(),
            "checkpoint_id": info.id,  # its own chunks' (the others are links of chains)
            "metadata": info.stored_metadata,
            "tensors": [
                [t.idx, t.name, t.dtype, list(t.shape), t.begin, t.nbytes, t.checksum.hex()]
                for t in tensors
            ],
            "chunks": layout_rows(reached, {k: i for i, k in enumerate(keys)}),
            "blobs": [{"key": k, "url": u} for k, u in zip(keys, urls, strict=True)],
            "url_ttl_s": self._ttl,
        }

    def blob_range(self, run: str, step: int, index: int, start: int, end: int) -> Iterator[bytes]:
        """``[start, end)`` of the ``index``-th blob of checkpoint ``run/step``'s chains,
        as stored (InvalidRequest for a blob or range it does not have)."""
        info = self._catalog.get(run, step)
        with self._lock:
            keys = self._blobs.get(info.id)
        if keys is None:
            _, closure = self._catalog.chunk_tree(info.id)
            keys = self._remember(info.id, closure.values())
        if not 0 <= index < len(keys) or not 0 <= start <= end:
            raise InvalidRequest(f"{run}/{step} has no blob range {index}:{start}-{end}")
        try:
            data = self._store.view(keys[index], start, end)
        except ValueError as exc:  # the store's word for a range outside the blob
            raise InvalidRequest(f"{run}/{step}: blob {index} has no range: {exc}") from None
        view = memoryview(data).cast("B")
        return (bytes(view[i : i + _SEND_BYTES]) for i in range(0, len(view), _SEND_BYTES))

    def _remember(self, checkpoint_id: int, chunks: Collection[ChunkInfo]) -> tuple[str, ...]:
        keys = tuple(sorted({c.blob_key for c in chunks}))
        with self._lock:
            self._blobs[checkpoint_id] = keys
            self._blobs.move_to_end(checkpoint_id)
            while len(self._blobs) > _KEPT:
                self._blobs.popitem(last=False)
        return keys


def _reached(chunks: Sequence[ChunkInfo], closure: dict[int, ChunkInfo]) -> list[ChunkInfo]:
    """``chunks`` and every chunk their chains reach (bases, masters), each once."""
    seen: dict[int, ChunkInfo] = {}
    todo = list(chunks)
    while todo:
        c = todo.pop()
        if c.id in seen:
            continue
        seen[c.id] = c
        if c.base_id is not None:
            base = closure.get(c.base_id)
            if base is None:
                raise CorruptData(f"the catalog's chunk {c.id} ({c.codec}) has no base chunk")
            todo.append(base)
    return sorted(seen.values(), key=lambda c: c.id)


def layout_rows(chunks: Sequence[ChunkInfo], blob_index: dict[str, int]) -> list[list[Any]]:
    """Chunk rows as arrays (a large checkpoint has many): ``[id, checkpoint, tensor,
    offset, raw_len, itemsize, codec, base, depth, blob, blob_offset, stored_len,
    checksum]`` (``ckptstore.direct_load`` reads them)."""
    return [
        [
            c.id,
            c.checkpoint_id,
            c.tensor_idx,
            c.offset,
            c.raw_len,
            c.itemsize,
            c.codec,
            c.base_id,
            c.depth,
            blob_index[c.blob_key],
            c.blob_offset,
            c.stored_len,
            c.checksum.hex(),
        ]
        for c in chunks
    ]
