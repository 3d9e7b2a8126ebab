"""Time spent queued counts against a store operation's deadline.

A blob store bounds each operation (S3: ``CKPTSTORE_S3_DEADLINE_S``), but work that waits in
a thread pool before it runs would start its clock only then: eight loads queued for two
codec threads during a frozen S3 answered one deadline after the other (issue 33). A job
submitted through :class:`QueuedPool` records when it was submitted; the first store
operation the job makes takes that time as its start (:func:`take_queued_since`), so a job
that waited too long for a stalled attempt to end by the deadline fails at once, and every
request gets its answer within the bound, queued or not. A store with no deadline ignores it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from typing import ParamSpec, TypeVar

__all__ = ["QueuedPool", "take_queued_since"]

P = ParamSpec("P")
T = TypeVar("T")

# when the job running in this thread was submitted (None: not queued, or taken already)
_queued_since: ContextVar[float | None] = ContextVar("ckptstore_queued_since", default=None)


def take_queued_since() -> float | None:
    """When the job running in this thread was submitted (``time.monotonic``), for its first
    store operation only: None afterwards, and outside a :class:`QueuedPool`'s jobs."""
    since = _queued_since.get()
    if since is not None:
        _queued_since.set(None)
    return since


class QueuedPool(ThreadPoolExecutor):
    """A thread pool whose jobs' first store operation counts the time they were queued."""

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        since = time.monotonic()

        def job() -> T:
            token = _queued_since.set(since)
            try:
                return fn(*args, **kwargs)
            finally:
                _queued_since.reset(token)

        return super().submit(job)
