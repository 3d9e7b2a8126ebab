"""A checkpoint written through torch.distributed.checkpoint, served as its full tensors.

Such a checkpoint is stored as pieces of shards (``{fqn}@{offsets}``, see
:mod:`ckptstore_core.dcp_layout`). A plain ``GET .../checkpoints/{step}`` returns what a
single process wants instead: one safetensors stream of the full, unsharded tensors, named by
their DCP names (``model.layer.weight``), in the order they were saved; each non-tensor entry
(DCP's ``torch.save`` bytes, which only the client reads) as a ``U8`` tensor of those bytes.
The response's metadata says so (``ckptstore.layout: dcp-full``) and keeps DCP's metadata.

Memory stays bounded for what FSDP/HSDP write: pieces that span whole rows (every shard and
grid cut along dim 0) are sent one after the other as they are decoded. A tensor cut along
another dimension (tensor parallelism) is assembled in memory, one tensor at a time.

A checkpoint whose metadata names no DCP layout, or one that does not match its stored
tensors (a plain safetensors file uploaded with a ``dcp`` metadata key: a pulled, already
full checkpoint pushed back), is served as stored.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ckptstore_core.chain import Piece
from ckptstore_core.dcp_layout import FULL, LAYOUT_KEY, METADATA_KEY, Entry, parse_layout
from ckptstore_core.errors import CorruptData
from ckptstore_core.pipeline.rows import TensorInfo
from ckptstore_core.wire import DTYPE_SIZES

__all__ = ["FullView", "full_view", "layout_view"]

log = logging.getLogger("ckptstore")


@dataclass(frozen=True)
class _Output:
    entry: Entry
    dtype: str
    shape: tuple[int, ...]
    stored: tuple[TensorInfo, ...]  # the pieces' tensors, in the entry's piece order


@dataclass(frozen=True)
class FullView:
    """The full tensors of a DCP checkpoint: their specs, the stored tensors to read (in
    that order), and :meth:`stream`, which turns those tensors' bytes into the full ones'."""

    outputs: tuple[_Output, ...]

    @property
    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(o.entry.fqn, o.dtype, o.shape) for o in self.outputs]

    @property
    def stored(self) -> list[TensorInfo]:
        return [t for o in self.outputs for t in o.stored]

    def metadata(self, stored: Mapping[str, str]) -> dict[str, str]:
        return {**stored, LAYOUT_KEY: FULL}

    def stream(self, data: Iterator[Piece]) -> Iterator[Piece]:
        """``data``: the bytes of :attr:`stored`, in order, each piece within one tensor."""
        for out in self.outputs:
            if out.entry.whole_rows:
                for t in out.stored:
                    yield from _take(data, t)
            else:
                yield _assembled(out, data)


def full_view(
    metadata: Mapping[str, str], tensors: Sequence[TensorInfo], prefix: str | None
) -> FullView | None:
    """The full view of a checkpoint with ``metadata`` and stored ``tensors``, keeping the
    entries whose DCP name starts with ``prefix``; ``None`` if it has no DCP layout that
    matches its tensors (it is then served as stored)."""
    text = metadata.get(METADATA_KEY)
    if text is None or metadata.get(LAYOUT_KEY) == FULL:
        return None
    try:
        return layout_view(text, tensors, prefix)
    except ValueError as exc:
        log.warning("a checkpoint's %r metadata is no layout of its tensors: %s", METADATA_KEY, exc)
        return None


def layout_view(text: str, tensors: Sequence[TensorInfo], prefix: str | None = None) -> FullView:
    """The full view that DCP metadata ``text`` gives stored ``tensors``; ``ValueError`` if
    the document is malformed or names pieces that the tensors do not hold, as it says.
    A commit checks its metadata with this (``save/parts.py``)."""
    by_name = {t.name: t for t in tensors}
    entries = parse_layout(text)
    return FullView(
        tuple(_output(e, by_name) for e in entries if not prefix or e.fqn.startswith(prefix))
    )


def _output(entry: Entry, by_name: Mapping[str, TensorInfo]) -> _Output:
    stored = []
    for piece in entry.pieces:
        t = by_name.get(piece.name)
        if t is None:
            raise ValueError(f"{entry.fqn!r}: no stored tensor {piece.name!r}")
        if not entry.is_bytes and t.shape != piece.sizes:
            raise ValueError(f"{piece.name!r} has shape {list(t.shape)}, not {list(piece.sizes)}")
        stored.append(t)
    if entry.size is None:
        return _Output(entry, "U8", (stored[0].nbytes,), tuple(stored))
    dtypes = {t.dtype for t in stored}
    if len(dtypes) != 1:
        raise ValueError(f"{entry.fqn!r}: pieces of dtypes {sorted(dtypes)}")
    return _Output(entry, dtypes.pop(), entry.size, tuple(stored))


def _take(data: Iterator[Piece], t: TensorInfo) -> Iterator[Piece]:
    """The pieces of ``data`` that hold tensor ``t``'s bytes."""
    left = t.nbytes
    while left:
        piece = next(data, None)
        if piece is None or len(piece) > left:
            raise CorruptData(f"the stored bytes of {t.name!r} do not match its size")
        left -= len(piece)
        yield piece


def _assembled(out: _Output, data: Iterator[Piece]) -> memoryview:
    """A tensor whose pieces do not span whole rows, put together in memory."""
    itemsize = DTYPE_SIZES[out.dtype]
    full = np.empty((*out.shape, itemsize), dtype=np.uint8)
    for piece, t in zip(out.entry.pieces, out.stored, strict=True):
        raw = b"".join(bytes(p) for p in _take(data, t))
        region = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes, strict=True))
        full[region] = np.frombuffer(raw, dtype=np.uint8).reshape((*piece.sizes, itemsize))
    assert full.nbytes == math.prod(out.shape) * itemsize
    return memoryview(full.reshape(-1).data)
