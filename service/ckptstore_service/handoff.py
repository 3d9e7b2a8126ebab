"""Batched hand-offs between threads: each wake-up of a consumer thread costs more than the
few KiB a piece may hold, so producers hand over lists of pieces."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["unbatched"]


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
