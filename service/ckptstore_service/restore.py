"""Load path: resolve ``run/step`` -> decode chains -> verify -> stream safetensors out.

The data comes from the chunks kept decoded when they hold them all (a step loaded again,
``latest`` included: memory), else from the base cache when the checkpoint is cached
(``latest`` of an active run: no decoding at all), and otherwise from storage: each chunk
follows its chain back to a self-contained chunk, decodes forward and is verified against
its xxh3-128; the chunks are checked to tile their tensors, so verified chunks make verified
tensors. Chunks are decoded in the codec pool, in order, a bounded number ahead of the one
being sent. Data from the base cache (which has no chunk checksums) is verified tensor by
tensor against the checksums recorded at save time. The response header carries those checksums
(``__metadata__["ckptstore.xxh3_128"]``) so the client can check too.

Corruption found after the response has started can only cut it short, which a client reads
as a service that failed while sending (retried). So a response that carries checksums first
completes the tensor it was sending with zeros (:func:`_completed_on_corruption`): the client,
which checks each tensor as it ends, finds that tensor's checksum wrong and raises
``CorruptData``; the response is then cut, so no reader takes it for a whole checkpoint.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import TypeVar

import xxhash

from ckptstore_core.assemble import full_view
from ckptstore_core.errors import CheckpointNotFound, CorruptData, InvalidRequest
from ckptstore_core.wire import encode_header
from ckptstore_service.cache_policy import CachePolicy
from ckptstore_service.catalog import Catalog, CheckpointRecord, TensorInfo
from ckptstore_service.chains import ChainSource, DecodeStats, Piece, check_empty
from ckptstore_service.read_ahead import ReadAhead

__all__ = [
    "CHECKSUMS_KEY",
    "Loader",
    "Restore",
    "corrupt_verdict",
    "resolving_latest",
    "selected",
    "tensors_of",
]

CHECKSUMS_KEY = "ckptstore.xxh3_128"
_READ_BYTES = 4 << 20
_SEND_BYTES = 1 << 20
_LATEST_ATTEMPTS = 5  # resolutions of ``latest`` while its checkpoints are deleted
log = logging.getLogger("ckptstore")
T = TypeVar("T")


@dataclass(frozen=True)
class Restore:
    info: CheckpointRecord
    total_len: int
    body: Iterator[Piece]


class Loader:
    """Serves checkpoints: from the base cache when it holds them, else decoded from
    storage (and, for a run's latest, kept in the cache as it streams: the cache policy)."""

    def __init__(
        self,
        catalog: Catalog,
        cache: CachePolicy,
        source: ChainSource,
        read_ahead: ReadAhead | None = None,
    ) -> None:
        self._catalog = catalog
        self._cache = cache
        self._source = source
        self._read_ahead = read_ahead

    def open(
        self,
        run: str,
        step: int | None,
        prefix: str | None,
        names: Collection[str] | None = None,
    ) -> Restore:
        """Resolve a checkpoint and start its stream of the tensors under ``prefix``, or of
        the tensors ``names`` (InvalidRequest if one is not in the checkpoint), or of all
        (raises the not-found errors, and any error before the first piece, up front).

        Without ``names``, a checkpoint written through torch.distributed.checkpoint comes
        as its full tensors (:mod:`ckptstore_core.assemble`); ``names`` selects stored
        tensors (a DCP checkpoint's pieces) as they are.

        ``step`` None is the run's latest: if the checkpoint it resolved to is deleted
        before its rows are read, it is resolved again (a delete may take a run's newest at
        any time; up to 5 times), so a run that has checkpoints does not answer
        CheckpointNotFound.
        """
        return resolving_latest(run, step, lambda: self._open(run, step, prefix, names))

    def _open(
        self,
        run: str,
        step: int | None,
        prefix: str | None,
        names: Collection[str] | None,
    ) -> Restore:
        info = self._catalog.get(run, step)
        corrupt_verdict(info)
        tensors = tensors_of(self._catalog, info)
        view = full_view(info.stored_metadata, tensors, prefix) if names is None else None
        if view is not None:
            return self._start(
                info,
                view.specs,
                view.metadata(info.stored_metadata),
                lambda stats: view.stream(self._data(info, view.stored, stats, fill=False)),
            )
        tensors = selected(info, tensors, prefix, names)
        metadata = dict(info.stored_metadata)
        metadata[CHECKSUMS_KEY] = json.dumps({t.name: t.checksum.hex() for t in tensors})
        whole = not prefix and names is None
        return self._start(
            info,
            [(t.name, t.dtype, t.shape) for t in tensors],
            metadata,
            lambda stats: _completed_on_corruption(
                tensors, self._data(info, tensors, stats, fill=whole)
            ),
            after=whole,
        )

    def _start(
        self,
        info: CheckpointRecord,
        specs: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str],
        data: Callable[[DecodeStats], Iterator[Piece]],
        after: bool = True,
    ) -> Restore:
        """The response: the header of ``specs``, then the bytes ``data`` yields; once they
        are all out, a whole load (``after``) is told to the read-ahead."""
        first, header = encode_header(specs, metadata)

        def body() -> Iterator[Piece]:
            t0 = time.perf_counter()
            stats = DecodeStats()
            yield from _coalesced(first, data(stats))
            log.info(
                "loaded %s/%d: %d bytes in %.2fs from %s (fetch %.2fs, decode %.2fs, in threads)",
                info.run,
                info.step,
                header.data_len,
                time.perf_counter() - t0,
                stats.source,
                stats.fetch_s,
                stats.decode_s,
            )
            if after and self._read_ahead is not None:
                self._read_ahead.loaded(info)

        # the first piece now: what fails before it (the catalog's chunks, the first decodes)
        # is still an HTTP error; what fails later can only cut the response short
        stream = body()
        head = next(stream)
        return Restore(info, header.total_len, itertools.chain([head], stream))

    def _data(
        self, info: CheckpointRecord, tensors: list[TensorInfo], stats: DecodeStats, fill: bool
    ) -> Iterator[Piece]:
        """The tensors' bytes, in order, verified: from the decoded chunks kept when they
        hold them all (memory), else from the base-cache file, else decoded from storage."""
        chains = self._source.load(info, tensors, stats)
        kept = chains.kept()
        if kept is not None:
            stats.source = "memory"
            return self._cache.warm_after(info, kept)
        fd = self._cache.open(info.run, info.id)
        if fd is not None:
            return _verified(tensors, _from_cache(fd, tensors))
        stats.source = "storage"
        data = chains.stream()
        return self._cache.fill(info, data) if fill else self._cache.warm_after(info, data)


def resolving_latest(run: str, step: int | None, read: Callable[[], T]) -> T:
    """``read()``, which resolves checkpoint ``step`` of ``run``; for ``latest`` (None),
    called again while it raises CheckpointNotFound: the checkpoint it resolved was deleted
    before its rows were read (a delete may take a run's newest at any time), and a run
    that has checkpoints must not answer that it has none."""
    for _ in range(_LATEST_ATTEMPTS - 1 if step is None else 0):
        try:
            return read()
        except CheckpointNotFound:
            log.info("%s: its latest was deleted while it was read: resolved again", run)
    return read()


def corrupt_verdict(info: CheckpointRecord) -> None:
    """CorruptData if the verifier found ``info`` corrupt: it loads no more."""
    if info.verification == "corrupt":
        raise CorruptData(
            f"checkpoint {info.run}/{info.step} holds client-encoded chunks that do not "
            "decode to their checksums (found by the verifier)"
        )


def tensors_of(catalog: Catalog, info: CheckpointRecord) -> list[TensorInfo]:
    """The tensors of checkpoint ``info``; CheckpointNotFound if it was deleted since
    ``info`` was read (its rows went with it)."""
    tensors = catalog.tensors(info.id)
    if len(tensors) != info.tensors:
        raise CheckpointNotFound(f"run {info.run!r} has no checkpoint at step {info.step}")
    return tensors


def selected(
    info: CheckpointRecord,
    tensors: list[TensorInfo],
    prefix: str | None,
    names: Collection[str] | None,
) -> list[TensorInfo]:
    """The tensors under ``prefix``, or those named ``names`` (all of them must exist)."""
    if prefix:
        tensors = [t for t in tensors if t.name.startswith(prefix)]
    if names is not None:
        wanted = set(names)
        tensors = [t for t in tensors if t.name in wanted]
        if len(tensors) != len(wanted):
            missing = sorted(wanted - {t.name for t in tensors})[:3]
            raise InvalidRequest(f"{info.run}/{info.step} has no tensor {missing}")
    return tensors


def _coalesced(first: bytes, pieces: Iterator[Piece]) -> Iterator[Piece]:
    """Join small pieces into ~1 MiB writes: each piece costs a thread hop and a send. On
    CorruptData once the response has started, the pieces joined so far go out first
    (:func:`_completed_on_corruption`'s filler among them); before, it is the response."""
    batch: list[Piece] = [first]
    size = len(first)
    started = False
    try:
        for piece in pieces:
            if size and size + len(piece) > _SEND_BYTES:
                started = True
                yield batch[0] if len(batch) == 1 else b"".join(batch)
                batch, size = [], 0
            batch.append(piece)
            size += len(piece)
    except CorruptData:
        if started and batch:
            yield batch[0] if len(batch) == 1 else b"".join(batch)
        raise
    if batch:
        yield batch[0] if len(batch) == 1 else b"".join(batch)


def _completed_on_corruption(tensors: list[TensorInfo], pieces: Iterator[Piece]) -> Iterator[Piece]:
    """Pass the pieces (the bytes of ``tensors``, in order) through; if reading them raises
    CorruptData, first complete the tensor being sent (the next one, at a boundary) with
    zeros, then raise. The client checks that tensor against the checksum the response
    carries and raises CorruptData; without this it would see a response cut short. Costs
    at most one tensor's bytes, once, for a checkpoint that cannot be served anyway."""
    ends = list(itertools.accumulate(t.nbytes for t in tensors))
    sent = 0
    try:
        for piece in pieces:
            sent += len(piece)
            yield piece
    except CorruptData:
        left = next((end for end in ends if end > sent), sent) - sent
        log.warning(
            "corrupt data after %d bytes of a load: %d bytes of filler, then cut", sent, left
        )
        zeros = memoryview(bytes(min(left, _SEND_BYTES)))
        while left:
            n = min(left, len(zeros))
            yield zeros[:n]
            left -= n
        raise


def _verified(tensors: list[TensorInfo], pieces: Iterator[tuple[int, Piece]]) -> Iterator[Piece]:
    """Pass the pieces through, checking each tensor's whole checksum when it ends."""
    by_idx = {t.idx: t for t in tensors}
    current: TensorInfo | None = None
    hasher = xxhash.xxh3_128()
    seen = 0

    def check(t: TensorInfo) -> None:
        if seen != t.nbytes or hasher.digest() != t.checksum:
            raise CorruptData(f"tensor {t.name!r} does not match its checksum")

    for idx, data in pieces:
        if current is None or idx != current.idx:
            if current is not None:
                check(current)
            current, hasher, seen = by_idx[idx], xxhash.xxh3_128(), 0
        hasher.update(data)
        seen += len(data)
        yield data
    if current is not None:
        check(current)
    check_empty(tensors)  # empty tensors produce no pieces


def _from_cache(fd: int, tensors: list[TensorInfo]) -> Iterator[tuple[int, Piece]]:
    try:
        for t in tensors:
            for off in range(0, t.nbytes, _READ_BYTES):
                n = min(_READ_BYTES, t.nbytes - off)
                data = os.pread(fd, n, t.begin + off)
                if len(data) != n:
                    raise CorruptData("base cache file is truncated")
                yield t.idx, data
    finally:
        os.close(fd)
