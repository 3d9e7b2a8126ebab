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

import logging
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

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

__all__ = ["BaseSink", "KeepBase", "Loaded", "each_direct", "each_parent", "load_direct"]

log = logging.getLogger("ckptstore")

_AHEAD = 64 << 20  # decoded bytes queued ahead of the copy into the tensors' buffers
_KEEP = 64 << 20  # decoded fp32 masters kept for their bf16/f16 copies


class BaseSink(Protocol):
    """Where a load's tensors go to become a run's base (:class:`ckptstore.direct.
    LoadedBase`): each one as it is checked, then closed."""

    def add(self, tensor: TensorInfo, data: Buffer) -> None: ...

    def close(self) -> None: ...


#: A base for the service's URL and a run (:meth:`ckptstore.direct.DirectWriter.loaded`).
KeepBase = Callable[[str, str], BaseSink]


@dataclass(frozen=True)
class Loaded:
    """A direct load's tensors: ``specs`` (name, dtype, shape) and each one's bytes, the
    metadata a plain load's response carries, and the step served."""

    specs: list[tuple[str, str, tuple[int, ...]]]
    buffers: list[memoryview]
    metadata: dict[str, str]
    step: int


@dataclass(frozen=True)
class _Layout:
    """The answer of ``POST .../ranges``: the step served, its metadata and id, the
    tensors asked for, every chunk their chains reach, and the blobs' reader; ``base``:
    the service's URL and the run, the key of the run's base (:mod:`ckptstore.direct`)."""

    base: tuple[str, str]
    step: int
    metadata: dict[str, str]
    checkpoint_id: int
    tensors: list[TensorInfo]
    closure: dict[int, ChunkInfo]
    reader: _Ranges


def load_direct(
    transport: Transport,
    run: str,
    step: int | str,
    prefix: str | None = None,
    names: Collection[str] | None = None,
    workers: int | None = None,
    *,
    keep_base: KeepBase | None = None,
) -> Loaded:
    """The tensors of ``run/step`` under ``prefix`` (or the stored tensors ``names``, or
    all), fetched and decoded here; one attempt (the caller retries). ``keep_base``: where
    the stored tensors decoded go to become this process's base of the run for its next
    direct save (:meth:`ckptstore.direct.DirectWriter.loaded`)."""
    layout = _layout(transport, run, step, prefix, names)
    tensors, metadata = layout.tensors, layout.metadata
    buffers = [buf for _, buf in _checked(layout, workers, keep_base)]
    view = full_view(metadata, tensors, prefix) if names is None else None
    if view is None:
        return Loaded([(t.name, t.dtype, t.shape) for t in tensors], buffers, metadata, layout.step)
    # as a load's stream: no piece for an empty tensor (it has no chunks)
    full = _per_output(view, view.stream(b for b in buffers if len(b)))
    return Loaded(view.specs, full, view.metadata(metadata), layout.step)


def each_direct(
    transport: Transport,
    run: str,
    step: int,
    names: Collection[str],
    workers: int | None = None,
    *,
    keep_base: KeepBase | None = None,
) -> Generator[tuple[TensorInfo, memoryview], None, None]:
    """The stored tensors ``names`` of ``run/step``, each with its bytes as soon as it is
    decoded and checked, in the service's order: the caller holds one tensor at a time
    (plus the decoder's read-ahead), not all of them. ``keep_base``: as :func:`load_direct`."""
    yield from _checked(_layout(transport, run, step, None, names), workers, keep_base)


def each_parent(
    transport: Transport,
    run: str,
    step: int,
    checkpoint_id: int,
    sums: Mapping[str, bytes],
    workers: int | None = None,
    read_limit: float = float("inf"),
) -> Iterator[tuple[TensorInfo, memoryview]]:
    """The stored tensors of ``run/step`` named in ``sums`` whose checksum is the one
    ``sums`` gives (a direct save's plan's parent: :meth:`ckptstore.direct.DirectWriter.
    save_part`), each decoded and checked as :func:`each_direct`'s; none where the step is
    no longer checkpoint ``checkpoint_id`` (deleted and saved again since the plan); not
    the tensors whose chains' stored bytes (what their reads fetch) pass ``read_limit``
    times their raw bytes (deep in a chain of deltas that saved little)."""
    layout = _layout(transport, run, step, None, list(sums))
    if layout.checkpoint_id != checkpoint_id:
        return
    tensors = [t for t in layout.tensors if sums.get(t.name) == t.checksum]
    if len(tensors) < len(layout.tensors):
        log.warning(
            "%d tensors of %s step %s differ from the plan's checksums: not read as bases",
            len(layout.tensors) - len(tensors), run, step,
        )  # fmt: skip
    costs = _chain_bytes(layout)
    cheap = [t for t in tensors if costs.get(t.idx, 0) <= read_limit * t.nbytes]
    if len(cheap) < len(tensors):
        log.info(
            "%s step %s: %d tensors' chains hold more than %s stored bytes per raw byte: "
            "not read as bases",
            run, step, len(tensors) - len(cheap), read_limit,
        )  # fmt: skip
    tensors = cheap
    yield from _decoded(replace(layout, tensors=tensors), workers)


def _chain_bytes(layout: _Layout) -> dict[int, int]:
    """The stored bytes a read of each tensor of ``layout`` fetches: its own chunks and the
    chunks their chains reach (each counted once per tensor)."""
    reached: dict[int, set[int]] = {}
    for c in layout.closure.values():
        if c.checkpoint_id != layout.checkpoint_id:
            continue
        seen = reached.setdefault(c.tensor_idx, set())
        link: ChunkInfo | None = c
        while link is not None and link.id not in seen:
            seen.add(link.id)
            link = None if link.base_id is None else layout.closure.get(link.base_id)
    return {i: sum(layout.closure[c].stored_len for c in ids) for i, ids in reached.items()}


def _layout(
    transport: Transport,
    run: str,
    step: int | str,
    prefix: str | None,
    names: Collection[str] | None,
) -> _Layout:
    path = checkpoint_path(run, step)
    body = {"prefix": prefix or None, "names": None if names is None else list(names)}
    doc = transport.call("POST", path + "/ranges", body, retried=False)
    served = int(doc["checkpoint"]["step"])
    tensors = [
        TensorInfo(i, n, d, tuple(sh), b, nb, bytes.fromhex(ck))
        for i, n, d, sh, b, nb, ck in doc["tensors"]
    ]
    keys = [b["key"] for b in doc["blobs"]]
    closure = {c.id: c for c in _chunks(doc["chunks"], keys)}
    reader = _Ranges(
        transport, checkpoint_path(run, served), keys, [b["url"] for b in doc["blobs"]]
    )
    return _Layout(
        (transport.url, run),
        served,
        dict(doc["metadata"]),
        doc["checkpoint_id"],
        tensors,
        closure,
        reader,
    )


def _chunks(rows: list[list[Any]], keys: list[str]) -> list[ChunkInfo]:
    return [
        ChunkInfo(ti, off, rl, its, cd, base, dp, bo, sl, bytes.fromhex(ck), cid, keys[b], ckpt)
        for cid, ckpt, ti, off, rl, its, cd, base, dp, b, bo, sl, ck in rows
    ]


def _checked(
    layout: _Layout, workers: int | None, keep_base: KeepBase | None
) -> Iterator[tuple[TensorInfo, memoryview]]:
    """:func:`_decoded`, each tensor also added to the run's base where ``keep_base``."""
    if keep_base is None:
        yield from _decoded(layout, workers)
        return
    base = keep_base(*layout.base)
    try:
        for t, buf in _decoded(layout, workers):
            base.add(t, buf)
            yield t, buf
    finally:
        base.close()


def _decoded(layout: _Layout, workers: int | None) -> Iterator[tuple[TensorInfo, memoryview]]:
    """Each tensor with its bytes, decoded chunk by chunk and checked whole, in order, as
    soon as its last chunk is decoded."""
    tensors, closure = layout.tensors, layout.closure
    order = {t.idx: i for i, t in enumerate(tensors)}
    own = sorted(
        (
            c
            for c in closure.values()
            if c.checkpoint_id == layout.checkpoint_id and c.tensor_idx in order
        ),
        key=lambda c: (order[c.tensor_idx], c.offset),
    )
    check_tiling(tensors, own)
    decoder = ChainDecoder(layout.reader, closure, _KEEP)
    decoder.keep_masters(own)
    with ThreadPoolExecutor(workers or min(4, os.cpu_count() or 2)) as pool:
        ahead = decoded_ahead(pool, decoder, own, _AHEAD)
        try:
            # the tiling was checked: each tensor's chunks come next, back to back
            decoded = zip(own, ahead, strict=True)
            for t in tensors:
                # uninitialised: every byte is written by a decoded chunk
                buf = np.empty(t.nbytes, np.uint8)
                filled = 0
                while filled < t.nbytes:
                    c, data = next(decoded)
                    buf[c.offset : c.offset + c.raw_len] = np.frombuffer(data, np.uint8)
                    filled += c.raw_len
                if xxhash.xxh3_128_digest(buf.data) != t.checksum:
                    raise CorruptData(f"tensor {t.name!r} does not match its checksum")
                yield t, buf.data
        finally:
            ahead.close()  # a consumer gone early: what is queued is cancelled


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
