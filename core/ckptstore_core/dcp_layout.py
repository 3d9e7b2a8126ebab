"""Where the tensors of a checkpoint written through torch.distributed.checkpoint are: torch-free.

A DCP checkpoint is stored as *pieces*: each rank's shards, cut along dim 0 at a grid of the
global tensor, each piece a stored tensor named ``{fqn}@{offsets}`` (``ckptstore.dcp``). The
commit's metadata holds DCP's own Metadata as JSON under :data:`METADATA_KEY` (written by
``ckptstore.dcp.metadata_to_json``). This module reads the part of that document that says
which stored piece covers which region of which full tensor, so that the service can stream a
DCP checkpoint as its full, unsharded tensors (``GET .../checkpoints/{step}``) without torch,
and both sides agree on what that stream holds.

The document (version 1), as far as it is read here::

    {"v": 1,
     "state_dict": [[fqn, {"t": "tensor", "size": [...], "chunks": [[offsets, sizes], ...]}]
                    | [fqn, {"t": "bytes"}], ...],
     "planner_data": [[fqn, [path, ...]], ...] | null,
     "storage_data": [[fqn, offsets | null, part, stored name], ...]}

Entries come in the order the state was saved (``planner_data``'s order, then the rest).
A ``bytes`` entry is DCP's ``torch.save`` of a non-tensor value: its stored bytes travel as a
``U8`` tensor named ``fqn`` and only the client decodes them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "FULL",
    "LAYOUT_KEY",
    "METADATA_KEY",
    "Entry",
    "Piece",
    "parse_chunks",
    "parse_layout",
]

#: The commit metadata key holding DCP's Metadata as JSON.
METADATA_KEY = "dcp"
#: The response metadata key saying how a DCP checkpoint's stream is laid out, and its value
#: for full tensors named by their DCP names (what a plain GET returns).
LAYOUT_KEY = "ckptstore.layout"
FULL = "dcp-full"
_VERSION = 1


@dataclass(frozen=True, slots=True)
class Piece:
    """A stored tensor (``name``) holding the region ``offsets`` + ``sizes`` of a full one."""

    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of the saved state: a tensor of global ``size`` made of ``pieces`` (in
    offset order), or (``size is None``) a non-tensor value stored as one piece of bytes."""

    fqn: str
    size: tuple[int, ...] | None
    pieces: tuple[Piece, ...]

    @property
    def is_bytes(self) -> bool:
        return self.size is None

    @property
    def whole_rows(self) -> bool:
        """Every piece spans whole rows (all of dims 1..): the full tensor is its pieces'
        bytes one after the other."""
        if self.size is None or len(self.size) <= 1:
            return True
        return all(not any(p.offsets[1:]) and p.sizes[1:] == self.size[1:] for p in self.pieces)


def parse_layout(text: str) -> list[Entry]:
    """The entries of a DCP metadata document, in the order the state was saved, each
    tensor's pieces checked to lie inside it and to cover it exactly once (by element
    count, and back to back for whole-row pieces). ``ValueError`` says what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"DCP metadata is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != _VERSION:
        raise ValueError(f"DCP metadata: not version {_VERSION} of ckptstore's JSON form")
    stored = _storage(doc.get("storage_data"))
    entries: dict[str, Entry] = {}
    for item in _list(doc.get("state_dict"), "state_dict"):
        entry = _entry(item, stored)
        if entry.fqn in entries:
            raise ValueError(f"DCP metadata: {entry.fqn!r} twice")
        entries[entry.fqn] = entry
    order = [fqn for fqn in _planner_order(doc.get("planner_data")) if fqn in entries]
    seen = set(order)
    order += [fqn for fqn in entries if fqn not in seen]
    return [entries[fqn] for fqn in order]


def _list(value: object, what: str) -> list[object]:
    if not isinstance(value, list):
        raise ValueError(f"DCP metadata: {what} must be a list")
    return value


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"DCP metadata: {what} must be a list of integers >= 0, got {value!r}")
    return tuple(value)


def _storage(value: object) -> Mapping[tuple[str, tuple[int, ...] | None], str]:
    """``(fqn, offsets or None) -> stored tensor name``."""
    out: dict[tuple[str, tuple[int, ...] | None], str] = {}
    for item in _list(value, "storage_data"):
        if not isinstance(item, list) or len(item) != 4:
            raise ValueError(f"DCP metadata: bad storage_data entry {item!r}")
        fqn, offsets, _part, name = item
        if not isinstance(fqn, str) or not isinstance(name, str):
            raise ValueError(f"DCP metadata: bad storage_data entry {item!r}")
        key = (fqn, None if offsets is None else _ints(offsets, f"{fqn!r} offsets"))
        out[key] = name
    return out


def _planner_order(value: object) -> list[str]:
    if value is None:
        return []
    return [
        item[0]
        for item in _list(value, "planner_data")
        if isinstance(item, list) and item and isinstance(item[0], str)
    ]


def _entry(item: object, stored: Mapping[tuple[str, tuple[int, ...] | None], str]) -> Entry:
    if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], dict):
        raise ValueError(f"DCP metadata: bad state_dict entry {item!r}")
    fqn, node = item
    if not isinstance(fqn, str):
        raise ValueError(f"DCP metadata: bad state_dict entry {item!r}")
    if node.get("t") == "bytes":
        name = stored.get((fqn, None))
        if name is None:
            raise ValueError(f"DCP metadata has no storage for {fqn!r}")
        return Entry(fqn, None, (Piece(name, (), ()),))
    if node.get("t") != "tensor":
        raise ValueError(f"DCP metadata: {fqn!r} is neither a tensor nor bytes")
    size = _ints(node.get("size"), f"{fqn!r}: size")
    pieces = []
    for offsets, sizes in parse_chunks(fqn, size, node.get("chunks")):
        name = stored.get((fqn, offsets))
        if name is None:
            raise ValueError(f"DCP metadata has no storage for {fqn!r} at {list(offsets)}")
        pieces.append(Piece(name, offsets, sizes))
    pieces.sort(key=lambda p: p.offsets)
    entry = Entry(fqn, size, tuple(pieces))
    _check_cover(entry)
    return entry


def parse_chunks(
    fqn: str, size: tuple[int, ...], chunks: object
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The ``(offsets, sizes)`` of a tensor entry's ``chunks`` (``[[offsets, sizes], ...]``),
    each checked to be a region of a tensor of ``size``; ``ValueError`` says what is wrong.
    The client's decoder of the whole document reads them with this too."""
    out = []
    for chunk in _list(chunks, f"{fqn!r}: chunks"):
        if not isinstance(chunk, list) or len(chunk) != 2:
            raise ValueError(f"DCP metadata: {fqn!r}: bad chunk {chunk!r}")
        offsets = _ints(chunk[0], f"{fqn!r}: chunk offsets")
        sizes = _ints(chunk[1], f"{fqn!r}: chunk sizes")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise ValueError(f"DCP metadata: {fqn!r}: chunk {chunk!r} of a {len(size)}-d tensor")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise ValueError(f"DCP metadata: {fqn!r}: chunk {chunk!r} outside its {list(size)}")
        out.append((offsets, sizes))
    return out


def _check_cover(entry: Entry) -> None:
    """The pieces hold as many elements as the tensor and do not overlap: they cover it."""
    assert entry.size is not None
    total = sum(math.prod(p.sizes) for p in entry.pieces)
    if total != math.prod(entry.size):
        raise ValueError(
            f"DCP metadata: the chunks of {entry.fqn!r} hold {total} of its "
            f"{math.prod(entry.size)} elements"
        )
    pieces = [p for p in entry.pieces if math.prod(p.sizes)]
    if entry.whole_rows:
        ends = [p.offsets[0] + p.sizes[0] for p in pieces[:-1]] if entry.size else []
        if any(end != p.offsets[0] for end, p in zip(ends, pieces[1:], strict=True)):
            raise ValueError(f"DCP metadata: the chunks of {entry.fqn!r} overlap")
        return
    for i, a in enumerate(pieces):
        for b in pieces[i + 1 :]:
            if all(
                ao < bo + bs and bo < ao + as_
                for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
            ):
                raise ValueError(f"DCP metadata: the chunks of {entry.fqn!r} overlap")
