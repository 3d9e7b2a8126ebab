"""Loads decoded here (``direct=True``): the service answers which blob ranges make up the
tensors, this process fetches and decodes them (docs/scale.md), so no replica decodes.

    layout POST .../ranges {"prefix" | "names"}: the tensors, every chunk their chains
           reach (codec, base, blob, range, checksum), the blobs (a presigned URL each on
           S3; else read through GET .../blobs/{i}, which streams stored bytes unchanged)
    fetch  ranged reads, coalesced into a few large ones per blob
           (:class:`ckptstore_core.chain.WindowReader`)
    decode :class:`ckptstore_core.chain.ChainDecoder`, the service's own decoder, in a
           pool of codec threads: each chunk against its checksum, each tensor whole
           against its own (a mismatch raises CorruptData)

A checkpoint written through DCP comes as its full tensors, assembled here as the service
would (:func:`ckptstore_core.assemble.full_view`). Mixed chains (links encoded by the
service and by writers) decode alike: the rows say how each link is stored.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ckptstore.transport import Transport, checkpoint_path, store_error
from ckptstore_core.assemble import FullView, full_view
from ckptstore_core.chain import (
    ChainDecoder,
    Piece,
    check_tiling,
    decoded_ahead,
)
from ckptstore_core.errors import CorruptData, StorageUnavailable
from ckptstore_core.pipeline.rows import ChunkInfo, TensorInfo
from ckptstore_core.pipeline.sink import Buffer

__all__ = ["Loaded", "load_direct"]

_AHEAD = 64 << 20  # decoded bytes queued ahead of the copy into the tensors' buffers
_KEEP = 64 << 20  # decoded fp32 masters kept for their bf16/f16 copies


@dataclass(frozen=True)
class Loaded:
    """A direct load's tensors: ``specs`` (name, dtype, shape) and each one's bytes, the
    metadata a plain load's response carries, and the step served."""

    specs: list[tuple[str, str, tuple[int, ...]]]
    buffers: list[memoryview]
    metadata: dict[str, str]
    step: int


def load_direct(
    transport: Transport,
    run: str,
    step: int | str,
    prefix: str | None = None,
    names: Collection[str] | None = None,
    workers: int | None = None,
) -> Loaded:
    """The tensors of ``run/step`` under ``prefix`` (or the stored tensors ``names``, or
    all), fetched and decoded here; one attempt (the caller retries)."""
    path = checkpoint_path(run, step)
    body = {"prefix": prefix or None, "names": None if names is None else list(names)}
    doc = transport.call("POST", path + "/ranges", body, retried=False)
    served = int(doc["checkpoint"]["step"])
    metadata: dict[str, str] = dict(doc["metadata"])
    tensors = [
        TensorInfo(i, n, d, tuple(sh), b, nb, bytes.fromhex(ck))
        for i, n, d, sh, b, nb, ck in doc["tensors"]
    ]
    keys = [b["key"] for b in doc["blobs"]]
    closure = {c.id: c for c in _chunks(doc["chunks"], keys)}
    reader = _Ranges(
        transport, checkpoint_path(run, served), keys, [b["url"] for b in doc["blobs"]]
    )
    buffers = _decoded(doc["checkpoint_id"], tensors, closure, reader, workers)
    view = full_view(metadata, tensors, prefix) if names is None else None
    if view is None:
        return Loaded([(t.name, t.dtype, t.shape) for t in tensors], buffers, metadata, served)
    # as a load's stream: no piece for an empty tensor (it has no chunks)
    full = _per_output(view, view.stream(b for b in buffers if len(b)))
    return Loaded(view.specs, full, view.metadata(metadata), served)


def _chunks(rows: list[list[Any]], keys: list[str]) -> list[ChunkInfo]:
    return [
        ChunkInfo(ti, off, rl, its, cd, base, dp, bo, sl, bytes.fromhex(ck), cid, keys[b], ckpt)
        for cid, ckpt, ti, off, rl, its, cd, base, dp, b, bo, sl, ck in rows
    ]


def _decoded(
    checkpoint_id: int,
    tensors: list[TensorInfo],
    closure: dict[int, ChunkInfo],
    reader: _Ranges,
    workers: int | None,
) -> list[memoryview]:
    """Each tensor's bytes, decoded chunk by chunk and checked whole."""
    order = {t.idx: i for i, t in enumerate(tensors)}
    own = sorted(
        (c for c in closure.values() if c.checkpoint_id == checkpoint_id and c.tensor_idx in order),
        key=lambda c: (order[c.tensor_idx], c.offset),
    )
    check_tiling(tensors, own)
    decoder = ChainDecoder(reader, closure, _KEEP)
    decoder.keep_masters(own)
    # uninitialised: every byte is written by a decoded chunk (the tiling was checked)
    buffers = [np.empty(t.nbytes, np.uint8) for t in tensors]
    with ThreadPoolExecutor(workers or min(4, os.cpu_count() or 2)) as pool:
        for c, data in zip(own, decoded_ahead(pool, decoder, own, _AHEAD), strict=True):
            buffers[order[c.tensor_idx]][c.offset : c.offset + c.raw_len] = np.frombuffer(
                data, np.uint8
            )
    for t, buf in zip(tensors, buffers, strict=True):
        if xxhash.xxh3_128_digest(buf.data) != t.checksum:
            raise CorruptData(f"tensor {t.name!r} does not match its checksum")
    return [buf.data for buf in buffers]


def _per_output(view: FullView, pieces: Iterator[Piece]) -> list[memoryview]:
    """A full view's stream (:meth:`FullView.stream`) as one buffer per full tensor: a
    tensor cut along rows comes as its pieces, joined here; any other as one piece."""
    out = []
    for o in view.outputs:
        if not o.entry.whole_rows:
            out.append(memoryview(next(pieces)).cast("B"))
            continue
        got = [memoryview(next(pieces)).cast("B") for t in o.stored if t.nbytes]
        out.append(got[0] if len(got) == 1 else memoryview(b"".join(got)).cast("B"))
    return out


class _Ranges:
    """The blobs' ranged reads (a :class:`ckptstore_core.chain.RangeReader`): a presigned
    URL's GET with a Range header, else the service's ``GET .../blobs/{i}``."""

    def __init__(self, transport: Transport, path: str, keys: list[str], urls: list[str | None]):
        self._transport = transport
        self._path = path
        self._index = {k: i for i, k in enumerate(keys)}
        self._urls = urls

    def view(self, key: str, start: int, end: int) -> Buffer:
        i = self._index[key]
        url = self._urls[i]
        if url is None:
            target = f"{self._path}/blobs/{i}?start={start}&end={end}"
            with self._transport.stream("GET", target) as response:
                data = response.read()
        else:
            data = _presigned_range(url, start, end, self._transport.timeout)
        if len(data) != end - start:
            raise ValueError(f"blob {key!r} holds no bytes {start}-{end}")
        return data


def _presigned_range(url: str, start: int, end: int, timeout: float) -> bytes:
    """``[start, end)`` of the object behind a presigned GET URL."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-{end - 1}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            data: bytes = response.read()
            return data
    except urllib.error.HTTPError as exc:
        if exc.code == 416:
            raise ValueError(f"no bytes {start}-{end} in the object") from exc
        raise store_error(exc, "ranged read") from exc
    except OSError as exc:  # refused, reset, timed out
        raise StorageUnavailable(f"the store did not answer a ranged read: {exc}") from exc
