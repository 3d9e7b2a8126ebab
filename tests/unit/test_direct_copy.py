"""A direct save's frames reach the blob writer's queue without a copy when the body's
pieces view memory nobody writes again (``bytes``, the protocol's read buffers), with a copy
of their own otherwise."""

from __future__ import annotations

import numpy as np

from ckptstore_core.encoded import FramePiece
from ckptstore_service.handoff import SealedBuffer
from ckptstore_service.save.direct import _copy


def test_views_of_sealed_buffers_and_of_bytes_pass_uncopied() -> None:
    sealed = np.frombuffer(b"0123456789", np.uint8).copy().view(SealedBuffer)
    for data in (memoryview(b"0123456789")[2:6], sealed.data[2:6].toreadonly().cast("B")):
        piece = FramePiece(0, data, False)
        assert _copy(piece) is piece


def test_a_view_of_a_reusable_buffer_is_copied() -> None:
    buf = bytearray(b"0123456789")
    piece = FramePiece(0, memoryview(buf)[2:6], True)
    copied = _copy(piece)
    buf[2:6] = b"xxxx"  # the producer reuses its buffer
    assert bytes(copied.data) == b"2345" and (copied.index, copied.last) == (0, True)
