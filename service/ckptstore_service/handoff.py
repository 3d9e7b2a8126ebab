"""Batched hand-offs between threads: each wake-up of a consumer thread costs more than the
few KiB a piece may hold, so producers hand over lists of pieces."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

__all__ = ["SealedBuffer", "unbatched"]


class SealedBuffer(np.ndarray):
    """Bytes of a request body that the server read into memory of their own and never
    writes again (``api.protocol``'s read buffers): a view of them may go on to another
    thread, or into a blob writer's queue, without a copy, as a view of ``bytes`` may."""


def unbatched(items: Iterable[object], end: object) -> Iterator[Any]:
    """The pieces of a batched hand-off between threads: each item is a list of pieces (of
    the caller's type), an exception (raised here) or ``end``."""
    for item in items:
        if item is end:
            return
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, list)
        yield from item
