"""Parts whose writers encoded their own chunks (``direct=True``, docs/scale.md): the plan
a writer encodes against, and the registration of what it stored.

    writer: plan(names) -> run the core's chunk pipeline against the plan's parent
         -> PUT the encoded part (ckptstore_core.encoded: header, frames, tail)
    here:   header checked -> part lock -> each frame appended to the part's blob as it
            arrives (stored as sent, never decoded here) -> the tail's rows checked against
            this service's own plan of the same parent -> blob durable -> part ``done``,
            ``encoded_by=client``
    commit: as any part (:meth:`PartSaver.commit`); the checkpoint is ``pending`` until the
            verifier (:mod:`ckptstore_service.maintenance.verify`) decoded every chunk.

What the service trusts a writer with is only what it cannot check without decoding: each
chunk's stored bytes, its codec and the checksum of its raw bytes. Everything else it
derives itself: the chunk cut (the same fixed chunks a service-side save makes, so later
saves line up), each chunk's base, depth and sibling (its own :class:`DeltaPlanner` over
the same parent, which the writer names: a plan made against another parent is refused),
the chunk's place in the blob (its frame's). A writer can thus point at no chunk but the
one at the same place in the parent, and a delta is refused where the plan allows none
(a keyframe, a chain at its depth limit). What it encoded wrongly under honest-looking
checksums fails every load's checksum check until the verifier marks the checkpoint
corrupt; no other checkpoint is touched.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore_core import codec
from ckptstore_core.codec import Buffer
from ckptstore_core.encoded import EncodedParser, FramePiece, Plan, Tail, chunk_cut, parse_tail
from ckptstore_core.errors import CheckpointExists, InvalidRequest, InvalidStream
from ckptstore_core.lossy import LOSSY
from ckptstore_core.pipeline import DeltaPlanner, NewChunk, RawChunk, TensorInfo
from ckptstore_core.pipeline.plan import rests_on_base
from ckptstore_core.records import LOSSY_KEY
from ckptstore_core.wire import Header
from ckptstore_service.catalog import Catalog, Lease, PartRecord
from ckptstore_service.catalog.models import CLIENT
from ckptstore_service.handoff import SealedBuffer
from ckptstore_service.metrics import Metrics
from ckptstore_service.names import blob_key, check_part_name, parse_blob_key
from ckptstore_service.save.header import body_parser, check_metadata, header_of
from ckptstore_service.save.parts import PartSaver, unstored_part
from ckptstore_service.save.plan import keyframe_after, parent_rows, planner_for
from ckptstore_service.save.upload import PartTransaction
from ckptstore_service.settings import Settings
from ckptstore_service.storage import BlobStore, presigned_key

__all__ = ["DirectSaver", "Uploaded"]

log = logging.getLogger("ckptstore")

_NO_BLOCK = np.empty(0, np.uint8)  # a planned chunk's buffer: the plan reads only its place


@dataclass(frozen=True)
class Uploaded:
    """A part its writer uploaded to the store itself (``POST .../parts/{part}/uploaded``):
    the presigned upload (``key``, ``upload_id``), the part's safetensors header (its JSON),
    each chunk's stored size in blob order, and the tail (as in an encoded body)."""

    key: str
    upload_id: str
    header: str
    sizes: list[int]
    tail: dict[str, Any]


class DirectSaver:
    """Plans and registers client-encoded parts (see the module's docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        store: BlobStore,
        parts: PartSaver,
        settings: Settings,
        metrics: Metrics,
    ) -> None:
        self._catalog = catalog
        self._blobs = store
        self._parts = parts
        self._settings = settings
        self._metrics = metrics

    def plan(self, run: str, step: int, names: Sequence[str]) -> Plan:
        """The plan of a part of ``run/step`` holding the tensors ``names``."""
        s = self._settings
        parent = self._catalog.parent_of(run, step)
        keyframe, since = keyframe_after(parent, s)
        tensors, chunks = ({}, []) if parent is None else parent_rows(self._catalog, parent, names)
        return Plan(
            None if parent is None else parent.id,
            None if parent is None else parent.step,
            keyframe,
            since,
            s.max_chain_depth,
            s.chunk_bytes,
            s.zstd_level,
            tuple(tensors.values()),
            tuple(chunks),
            self._blobs.presigns and s.presign,
        )

    def ingest(
        self, run: str, step: int, name: str, body: Iterable[Buffer], content_length: int | None
    ) -> tuple[PartRecord, bool]:
        """Register part ``name`` of ``run/step`` from an encoded body; returns (part,
        created), as :meth:`PartSaver.ingest_part` does for a raw one."""
        check_part_name(name)
        it = iter(body)
        parser, header, first = self._open(it)
        frames = _frames(parser, first, it)

        def land(tx: PartTransaction) -> tuple[list[tuple[int, int]], Tail, int]:
            places = _appended(frames, tx)
            tail = parser.close()
            return places, tail, tx.finish()

        return self._save(run, step, name, header, lambda: _drained(frames, parser), land)

    def _open(self, it: Iterator[Buffer]) -> tuple[EncodedParser, Header, list[FramePiece]]:
        """The body's header, checked as a raw upload's is, and the frame pieces after it."""
        s = self._settings
        parser = EncodedParser(body_parser(s), s.chunk_bytes, s.max_header_bytes)
        for data in it:
            events = list(parser.feed(data))
            if parser.header is None:
                continue
            header = parser.header
            check_metadata(header)
            if LOSSY_KEY in header.metadata:
                raise InvalidRequest("a part encoded by its writer cannot be lossy")
            pieces = [_copy(e) for e in events if isinstance(e, FramePiece)]
            return parser, header, pieces
        parser.close()  # raises: the body ended early
        raise AssertionError("unreachable")

    def _store(
        self,
        run: str,
        step: int,
        checkpoint_id: int,
        name: str,
        header: Header,
        lease: Lease,
        land: Callable[[PartTransaction], tuple[list[tuple[int, int]], Tail, int]],
        uploaded: str | None = None,
    ) -> None:
        """Store part ``name`` of ``header``'s tensors: ``land(tx)`` puts its chunks in the
        blob and returns their places, the tail and the blob's size, durable; ``uploaded``:
        the key of a blob its writer uploaded itself (``land`` completes it)."""
        parent = self._catalog.parent_of(run, step)
        planner, _ = planner_for(self._catalog, self._settings, header, parent, same_names=True)
        with PartTransaction.begin(
            self._catalog, self._blobs, run, step, checkpoint_id, name, lease, uploaded
        ) as tx:
            places, tail, stored_bytes = land(tx)
            want = None if parent is None else parent.id
            if tail.parent != want:
                raise CheckpointExists(
                    f"part {name!r} of {run}/{step} was encoded against checkpoint "
                    f"{tail.parent}, but the step's parent is now {want}: plan it again"
                )
            tensors, chunks, siblings = _rows(header, tail, planner, places, self._settings)
            tx.commit(
                raw_bytes=header.data_len,
                stored_bytes=stored_bytes,
                tensors=tensors,
                chunks=chunks,
                sibling_bases=siblings,
                encoded_by=CLIENT,
            )
        log.info(
            "registered client-encoded part %s of %s/%d: %d -> %d bytes%s",
            name,
            run,
            step,
            header.data_len,
            stored_bytes,
            " (uploaded by its writer)" if uploaded else "",
        )

    # -- straight to the store (presigned uploads) -------------------------------------------

    def open_upload(self, run: str, step: int, name: str, max_bytes: int) -> dict[str, Any]:
        """A presigned upload of part ``name`` of ``run/step``, of at most ``max_bytes``
        encoded bytes: a fresh key of that step, the upload's id, its part size and one URL
        per part (InvalidRequest where the store takes none)."""
        check_part_name(name)
        if not (self._blobs.presigns and self._settings.presign):
            raise InvalidRequest("this service's store takes no presigned uploads: PUT .../encoded")
        key = presigned_key(blob_key(run, step), time.time())
        up = self._blobs.presigned_upload(key, max_bytes, self._settings.url_ttl_s)
        assert up is not None  # the store presigns
        return {
            "key": key,
            "upload_id": up.upload_id,
            "part_size": up.part_size,
            "urls": list(up.urls),
            "url_ttl_s": self._settings.url_ttl_s,
        }

    def register(self, run: str, step: int, name: str, doc: Uploaded) -> tuple[PartRecord, bool]:
        """Register part ``name`` of ``run/step`` whose blob its writer uploaded (``doc``:
        the upload, the part's safetensors header, each chunk's stored size and the tail);
        the upload is completed once its parts hold exactly those bytes (else 400), never
        read. Returns (part, created) as :meth:`ingest` does."""
        check_part_name(name)
        _check_upload_key(run, step, doc.key)
        header = _header_of(doc.header.encode(), self._settings)
        sizes = doc.sizes
        tail = parse_tail(json.dumps(doc.tail).encode(), len(sizes))

        def land(tx: PartTransaction) -> tuple[list[tuple[int, int]], Tail, int]:
            try:
                stored = self._blobs.complete_presigned(doc.key, doc.upload_id, sum(sizes))
            except ValueError as exc:
                raise InvalidStream(f"part {name!r} of {run}/{step}: {exc}") from None
            return _places(sizes), tail, stored

        def unstored(existing: PartRecord | None) -> None:
            if existing is None or existing.blob_key != doc.key:  # stored before, not this
                self._blobs.abort_presigned(doc.key, doc.upload_id)

        try:
            return self._save(run, step, name, header, lambda: tail, land, doc.key, unstored)
        except BaseException:
            self._blobs.abort_presigned(doc.key, doc.upload_id)  # if not completed
            raise

    def _save(
        self,
        run: str,
        step: int,
        name: str,
        header: Header,
        tail: Callable[[], Tail],
        land: Callable[[PartTransaction], tuple[list[tuple[int, int]], Tail, int]],
        uploaded: str | None = None,
        unstored: Callable[[PartRecord | None], None] = lambda existing: None,
    ) -> tuple[PartRecord, bool]:
        """Part ``name`` of ``run/step``, of ``header``'s tensors: stored by ``land`` (see
        :meth:`_store`), or, when the step is committed or the part done already, compared
        with what is stored (``tail()``: its rows; other content is a 409) and answered
        without storing anything, ``unstored(existing part or None)`` first."""
        checkpoint_id, committed = self._parts.open_checkpoint(run, step)
        if committed is not None:
            what = f"part {name!r} of {run}/{step}, which is committed already"
            _check_same(header, tail(), self._catalog.tensors(committed.id), what)
            unstored(None)
            return unstored_part(committed.id, name, header), False
        with self._catalog.part_lock(run, step, name, blocking=False) as held:
            if held is None:
                raise CheckpointExists(f"part {name!r} of {run}/{step} is being uploaded")
            existing = self._catalog.find_part(checkpoint_id, name)
            if existing is not None and existing.status == "done":
                what = f"part {name!r} of {run}/{step}"
                _check_same(header, tail(), self._catalog.part_tensors(existing), what)
                unstored(existing)
                return existing, False
            if existing is not None:  # a crashed upload of this part: its lock is free
                self._parts.collect(existing)
            self._store(run, step, checkpoint_id, name, header, held, land, uploaded)
        part = self._catalog.find_part(checkpoint_id, name)
        assert part is not None
        self._metrics.part_saved(part)
        return part, True


def _places(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Each chunk's (offset, length) in a blob of its stored bytes back to back."""
    offsets = itertools.accumulate(sizes, initial=0)
    return [(offset, n) for offset, n in zip(offsets, sizes, strict=False)]


def _check_upload_key(run: str, step: int, key: str) -> None:
    """InvalidRequest unless ``key`` is one :meth:`DirectSaver.open_upload` makes for
    ``run/step`` (a writer registers no other run's or step's blob)."""
    parsed = parse_blob_key(key)
    if parsed is None or parsed.since is None or (parsed.run, parsed.step) != (run, step):
        raise InvalidRequest(f"{key!r} is no presigned upload of {run}/{step}")


def _header_of(text: bytes, settings: Settings) -> Header:
    """A part's safetensors header (its JSON ``text``), checked as an upload's is."""
    header = header_of(text, settings)
    if LOSSY_KEY in header.metadata:
        raise InvalidRequest("a part encoded by its writer cannot be lossy")
    return header


def _drained(frames: Iterator[FramePiece], parser: EncodedParser) -> Tail:
    """The tail, read past every frame (storing nothing)."""
    for _ in frames:
        pass
    return parser.close()


def _check_same(header: Header, tail: Tail, stored: Sequence[TensorInfo], what: str) -> None:
    """Return if every tensor of the part is one of ``stored`` by name, dtype and shape, with
    the checksum it was sent as; else CheckpointExists naming ``what``. An encoded part
    carries no raw bytes to compare a region of another layout with: such a part is sent
    again raw (``direct=False``) to be compared through the DCP layout."""
    by_name = {t.name: t for t in stored}
    for spec, checksum in zip(header.tensors, tail.tensors, strict=True):
        same = by_name.get(spec.name)
        if same is None or (same.dtype, same.shape) != (spec.dtype, spec.shape):
            raise CheckpointExists(
                f"{what}: its tensor {spec.name!r} ({spec.dtype} {list(spec.shape)}) is not "
                "stored there under that name (an encoded part is compared by name: send it "
                "raw, direct=False, to compare it with another layout)"
            )
        if same.sent != checksum:
            raise CheckpointExists(f"{what}: its tensor {spec.name!r} holds other content")


def _copy(p: FramePiece) -> FramePiece:
    """``p`` with bytes of its own, unless it views an immutable ``bytes`` or a body buffer
    the server never writes again (what the app's body pieces are: the view keeps them
    alive): a buffer the body's producer may reuse must not reach the blob writer's queue."""
    if isinstance(p.data.obj, (bytes, SealedBuffer)):
        return p
    return FramePiece(p.index, memoryview(bytes(p.data)), p.last)


def _frames(
    parser: EncodedParser, first: list[FramePiece], it: Iterator[Buffer]
) -> Iterator[FramePiece]:
    yield from first
    for data in it:
        for event in parser.feed(data):
            if isinstance(event, FramePiece):
                yield _copy(event)


def _appended(frames: Iterator[FramePiece], tx: PartTransaction) -> list[tuple[int, int]]:
    """Append each frame to the blob; each one's (offset, length) there, in frame order."""
    places: list[tuple[int, int]] = []
    start = size = 0
    for piece in frames:
        offset, n = tx.write((piece.data,))
        if size == 0:
            start = offset
        size += n
        if piece.last:
            places.append((start, size))
            size = 0
    return places


def _rows(
    header: Header,
    tail: Tail,
    planner: DeltaPlanner,
    places: list[tuple[int, int]],
    settings: Settings,
) -> tuple[list[TensorInfo], list[NewChunk], dict[int, int]]:
    """The part's rows from the tail, each chunk checked against this service's plan
    (InvalidStream for one the plan does not allow, see the module's docstring)."""
    if len(tail.tensors) != len(header.tensors):
        raise InvalidStream(
            f"the tail gives {len(tail.tensors)} tensor checksums for {len(header.tensors)} tensors"
        )
    cuts = list(chunk_cut(header, settings.chunk_bytes))
    if len(tail.chunks) != len(cuts):
        raise InvalidStream(f"the tail describes {len(tail.chunks)} chunks, the header {len(cuts)}")
    chunks: list[NewChunk] = []
    siblings: dict[int, int] = {}
    for k, (row, cut, (blob_offset, size)) in enumerate(
        zip(tail.chunks, cuts, places, strict=True)
    ):
        t = header.tensors[cut[0]]
        where = f"chunk {k} (tensor {t.name!r} at {cut[1]})"
        if (row.tensor_idx, row.offset, row.raw_len) != cut:
            raise InvalidStream(
                f"{where}: the tail names {row.tensor_idx, row.offset, row.raw_len}"
            )
        if row.codec == LOSSY or (row.codec == codec.REF and size):
            raise InvalidStream(f"{where}: codec {row.codec!r} with {size} stored bytes")
        raw = RawChunk(cut[0], cut[1], cut[2], t.itemsize, t.begin + cut[1], _NO_BLOCK)
        try:
            plan = planner.plan(raw)
        except KeyError:  # a bf16/f16 copy before its fp32 master
            raise InvalidStream(f"{where}: a copy sent before its fp32 master") from None
        rests = row.codec == codec.REF or rests_on_base(row.codec)
        if rests and (plan.base is None or (row.codec != codec.REF and not plan.delta)):
            raise InvalidStream(f"{where}: the plan allows no {row.codec!r} chunk here")
        if codec.split_cast(row.codec) is not None and plan.cast is None:
            raise InvalidStream(f"{where}: no fp32 master to predict it from")
        if plan.written is not None:
            plan.written.set()  # nothing waits for the cache file here
        link = planner.link(raw, plan, row.codec)
        if link.sibling is not None:
            siblings[k] = link.sibling
        chunks.append(
            NewChunk(
                cut[0],
                cut[1],
                cut[2],
                t.itemsize,
                row.codec,
                link.base_id,
                link.depth,
                blob_offset,
                size,
                row.checksum,
            )
        )
    tensors = [
        TensorInfo(i, t.name, t.dtype, t.shape, t.begin, t.nbytes, checksum)
        for i, (t, checksum) in enumerate(zip(header.tensors, tail.tensors, strict=True))
    ]
    for c in chunks:  # a tensor of one chunk is that chunk: the same checksum
        one = tensors[c.tensor_idx]
        if c.raw_len == one.nbytes and c.checksum != one.checksum:
            raise InvalidStream(f"tensor {one.name!r}: its checksum is not its one chunk's")
    return tensors, chunks, siblings
