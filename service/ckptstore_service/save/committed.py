"""A part or a commit that arrives for a step committed already: the same save again (its
answer was lost, the trainer retried it under a new save token, maybe from another world
size), which is accepted without storing anything, or other content, a 409 that says so.

*Same content* for a part: every tensor it holds is, bit for bit, what the committed
checkpoint holds at that place. A tensor is compared

* by name: a stored tensor of the committed checkpoint with the same name, dtype and shape
  (the same rank layout, or any piece whose grid cell both layouts share: ``ckptstore.dcp``)
  has the checksum of the bytes it was sent as; the part's bytes must have it;
* else through the layout: a DCP piece ``{fqn}@{offsets}`` is the region ``offsets`` +
  its shape of the full tensor ``fqn`` of the committed checkpoint's DCP layout
  (:mod:`ckptstore_core.dcp_layout`), of the same dtype; that region's bytes are read back
  from the stored pieces that overlap it and their checksum compared.

The header is checked first (every tensor must name a stored one or a region of one, with its
dtype), so a part of another shape is refused before its body is read; the body is then read
and hashed, never stored. A part compared by name costs its upload and no storage at all; one
compared through the layout also reads the overlapping stored pieces back (whole-row regions
streamed, other regions put together in memory one full tensor at a time, as a plain GET
does). A writer that asks first (``POST .../parts/{part}/check``: its header and the
checksums of its tensors, :func:`check_digests`) is compared the same way without sending
its body at all.

*Same content* for a commit naming other parts than the committed ones (none of them: a
commit naming some of the committed parts is another set of the same save's parts): a DCP
layout describing the same tensors (name, dtype, size and properties; the cut into pieces
is free) and the same other metadata. The bytes were compared by the part uploads: with
other part names, a commit without a DCP layout cannot be compared and is a 409.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ckptstore_core.dcp_layout import FULL, LAYOUT_KEY, METADATA_KEY, Entry, parse_layout
from ckptstore_core.errors import CheckpointExists
from ckptstore_core.wire import DTYPE_SIZES, TensorSpec
from ckptstore_service.catalog import CheckpointRecord, TensorInfo
from ckptstore_service.chains import Piece
from ckptstore_service.save.header import Incoming

__all__ = ["ReadTensors", "check_commit", "check_digests", "check_part"]

#: The bytes of some of a checkpoint's tensors, in the order given, verified.
ReadTensors = Callable[[CheckpointRecord, list[TensorInfo]], Iterator[Piece]]


@dataclass
class _Region:
    """A tensor of the part checked through the layout: ``index`` in the part's header."""

    index: int
    spec: TensorSpec
    offsets: tuple[int, ...]
    digest: bytes = b""


@dataclass
class _Full:
    """A full tensor of the committed checkpoint that some regions lie in."""

    entry: Entry
    dtype: str
    stored: list[TensorInfo]  # its pieces, in the entry's order
    regions: list[_Region] = field(default_factory=list)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def row_bytes(self) -> int:
        assert self.entry.size is not None
        return math.prod(self.entry.size[1:]) * self.itemsize

    def whole_rows(self, region: _Region) -> bool:
        assert self.entry.size is not None
        size, shape = self.entry.size, region.spec.shape
        return len(size) <= 1 or (not any(region.offsets[1:]) and shape[1:] == size[1:])

    @property
    def streamed(self) -> bool:
        """Its regions' bytes are ranges of the full tensor's, its pieces' back to back."""
        return self.entry.whole_rows and all(self.whole_rows(r) for r in self.regions)


def check_part(
    info: CheckpointRecord,
    stored: Sequence[TensorInfo],
    incoming: Incoming,
    read: ReadTensors,
    what: str,
) -> None:
    """Return if part ``incoming`` holds what committed checkpoint ``info`` (whose tensors
    are ``stored``) holds at its tensors' places (see the module's docstring), else raise
    CheckpointExists naming ``what`` and the first tensor that differs. Consumes the body;
    ``read`` reads stored tensors back for the regions compared through the layout."""
    header = incoming.header
    found = _match(info, stored, header.tensors, what)
    hashers = [xxhash.xxh3_128() for _ in header.tensors]
    for piece in incoming.pieces:
        hashers[piece.index].update(piece.data)
    found.compare([h.digest() for h in hashers], read, what)


def check_digests(
    info: CheckpointRecord,
    stored: Sequence[TensorInfo],
    specs: Sequence[TensorSpec],
    digests: Sequence[bytes] | None,
    read: ReadTensors,
    what: str,
) -> None:
    """:func:`check_part` of a part described, not sent: its tensors ``specs`` and the
    xxh3-128 ``digests`` of their bytes, in the same order (None: the specs are checked
    only). A region of another rank layout is read back and hashed here."""
    found = _match(info, stored, specs, what)
    if digests is not None:
        found.compare(digests, read, what)


@dataclass
class _Match:
    """Where each tensor of a part lies in a committed checkpoint: a stored tensor of its
    name (``direct``, by the part's index), or a region of a full tensor (``fulls``)."""

    info: CheckpointRecord
    direct: dict[int, TensorInfo]
    fulls: list[_Full]
    regions: list[_Region]

    def compare(self, digests: Sequence[bytes], read: ReadTensors, what: str) -> None:
        """CheckpointExists naming the first tensor whose ``digests`` (by the part's index)
        is not what the checkpoint holds at its place."""
        for i, t in self.direct.items():
            if digests[i] != t.sent:
                raise CheckpointExists(f"{what}: its tensor {t.name!r} holds other content")
        if self.regions:
            for region in self.regions:
                region.digest = digests[region.index]
            _compare_regions(self.info, self.fulls, read, what)


def _match(
    info: CheckpointRecord, stored: Sequence[TensorInfo], specs: Sequence[TensorSpec], what: str
) -> _Match:
    """Each of ``specs`` as a stored tensor or a region of one; CheckpointExists for one
    that is neither (another name, dtype or shape: other content)."""
    by_name = {t.name: t for t in stored}
    fulls = _fulls(info, stored)
    direct: dict[int, TensorInfo] = {}
    regions: list[_Region] = []
    for i, spec in enumerate(specs):
        same = by_name.get(spec.name)
        if same is not None and same.dtype == spec.dtype and same.shape == spec.shape:
            direct[i] = same
            continue
        region = _region_of(i, spec, fulls)
        if region is None:
            raise CheckpointExists(
                f"{what}: its tensor {spec.name!r} ({spec.dtype} {list(spec.shape)}) is no "
                "tensor of the committed checkpoint, nor a region of one: other content"
            )
        regions.append(region)
    return _Match(info, direct, [f for f in fulls.values() if f.regions], regions)


def check_commit(
    info: CheckpointRecord,
    committed: Sequence[str],
    names: Sequence[str],
    metadata: Mapping[str, str],
) -> None:
    """Return if a commit of parts ``names`` with ``metadata`` is committed checkpoint
    ``info`` (of parts ``committed``) again, else raise CheckpointExists: the same parts
    (a retried commit), or other parts with a DCP layout of the same tensors and the same
    other metadata (a save retried under a new token, whose parts were compared as they
    were uploaded)."""
    if list(names) == list(committed):
        return
    refused = CheckpointExists(
        f"run {info.run!r} already has a checkpoint at step {info.step}, of other content"
    )
    if set(names) & set(committed):
        raise CheckpointExists(
            f"run {info.run!r} already has a checkpoint at step {info.step}, of other parts"
        )
    stored = info.stored_metadata
    if METADATA_KEY not in metadata or METADATA_KEY not in stored:
        raise refused
    if _without_layout(metadata) != _without_layout(stored):
        raise refused
    try:
        same = _tensor_table(metadata[METADATA_KEY]) == _tensor_table(stored[METADATA_KEY])
    except ValueError:
        same = False
    if not same:
        raise refused


def _without_layout(metadata: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in metadata.items() if k not in (METADATA_KEY, LAYOUT_KEY)}


def _tensor_table(text: str) -> dict[str, object]:
    """What a DCP layout says of each entry but how it is cut: ``{fqn: node}`` without the
    chunks. ValueError for a document that is no layout."""
    parse_layout(text)  # ValueError for what is not one
    doc = json.loads(text)
    table: dict[str, object] = {}
    for fqn, node in doc["state_dict"]:
        table[fqn] = {k: v for k, v in node.items() if k != "chunks"}
    return table


def _fulls(info: CheckpointRecord, stored: Sequence[TensorInfo]) -> dict[str, _Full]:
    """The full tensors of ``info``'s DCP layout, by name; none without one."""
    text = info.stored_metadata.get(METADATA_KEY)
    if text is None or info.stored_metadata.get(LAYOUT_KEY) == FULL:
        return {}
    try:
        entries = parse_layout(text)
    except ValueError:
        return {}
    by_name = {t.name: t for t in stored}
    out = {}
    for entry in entries:
        pieces = [by_name.get(p.name) for p in entry.pieces]
        if entry.is_bytes or None in pieces:
            continue
        tensors = [t for t in pieces if t is not None]
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) == 1:
            out[entry.fqn] = _Full(entry, dtypes.pop(), tensors)
    return out


def _region_of(index: int, spec: TensorSpec, fulls: Mapping[str, _Full]) -> _Region | None:
    """The region of a full tensor that part tensor ``spec`` is (a DCP piece name
    ``{fqn}@{offsets}``, the same dtype, inside the tensor), added to its full tensor's."""
    fqn, at, tail = spec.name.rpartition("@")
    full = fulls.get(fqn) if at else None
    if full is None or full.dtype != spec.dtype:
        return None
    try:
        offsets = tuple(int(o) for o in tail.split(",")) if tail else ()
    except ValueError:
        return None
    size = full.entry.size
    assert size is not None
    if len(offsets) != len(size) or len(spec.shape) != len(size):
        return None
    if any(o < 0 or o + s > d for o, s, d in zip(offsets, spec.shape, size, strict=True)):
        return None
    region = _Region(index, spec, offsets)
    full.regions.append(region)
    return region


def _compare_regions(
    info: CheckpointRecord, fulls: list[_Full], read: ReadTensors, what: str
) -> None:
    """Read back what ``fulls``' regions cover and compare each region's checksum."""
    wanted: list[tuple[_Full, list[TensorInfo]]] = []
    for full in fulls:
        wanted.append((full, _overlapping(full) if full.streamed else full.stored))
    data = read(info, [t for _, tensors in wanted for t in tensors])
    for full, tensors in wanted:
        digests = _streamed(full, tensors, data) if full.streamed else _assembled(full, data)
        for region, digest in zip(full.regions, digests, strict=True):
            if digest != region.digest:
                raise CheckpointExists(
                    f"{what}: its tensor {region.spec.name!r} holds other content"
                )


def _span(full: _Full, region: _Region) -> tuple[int, int]:
    """A whole-row region's byte range in its full tensor."""
    start = (region.offsets[0] if region.offsets else 0) * full.row_bytes
    return start, start + region.spec.nbytes


def _starts(full: _Full) -> list[int]:
    """Where each stored piece of a whole-row tensor begins in the full tensor's bytes."""
    starts, at = [], 0
    for t in full.stored:
        starts.append(at)
        at += t.nbytes
    return starts


def _overlapping(full: _Full) -> list[TensorInfo]:
    """The stored pieces of a whole-row tensor that its regions overlap, in order."""
    spans = [_span(full, r) for r in full.regions]
    return [
        t
        for t, start in zip(full.stored, _starts(full), strict=True)
        if any(a < start + t.nbytes and start < b for a, b in spans)
    ]


def _take(data: Iterator[Piece], nbytes: int) -> Iterator[memoryview]:
    left = nbytes
    while left:
        piece = memoryview(next(data)).cast("B")
        left -= len(piece)
        yield piece


def _streamed(full: _Full, tensors: list[TensorInfo], data: Iterator[Piece]) -> list[bytes]:
    """The checksums of ``full``'s whole-row regions, hashed as ``tensors`` (its pieces
    that they overlap) stream by."""
    spans = [_span(full, r) for r in full.regions]
    hashers = [xxhash.xxh3_128() for _ in spans]
    begin = dict(zip((id(t) for t in full.stored), _starts(full), strict=True))
    for t in tensors:
        at = begin[id(t)]
        for piece in _take(data, t.nbytes):
            end = at + len(piece)
            for (a, b), h in zip(spans, hashers, strict=True):
                if a < end and at < b:
                    h.update(piece[max(a, at) - at : min(b, end) - at])
            at = end
    return [h.digest() for h in hashers]


def _assembled(full: _Full, data: Iterator[Piece]) -> list[bytes]:
    """The checksums of ``full``'s regions, cut from the full tensor put together in
    memory from all its pieces."""
    size = full.entry.size
    assert size is not None
    whole = np.empty((*size, full.itemsize), dtype=np.uint8)
    for piece, t in zip(full.entry.pieces, full.stored, strict=True):
        raw = b"".join(bytes(p) for p in _take(data, t.nbytes))
        cut = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes, strict=True))
        whole[cut] = np.frombuffer(raw, dtype=np.uint8).reshape((*piece.sizes, full.itemsize))
    out = []
    for region in full.regions:
        cut = tuple(slice(o, o + s) for o, s in zip(region.offsets, region.spec.shape, strict=True))
        out.append(xxhash.xxh3_128_digest(np.ascontiguousarray(whole[cut]).data))
    return out
