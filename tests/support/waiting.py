"""Waiting on observable conditions instead of sleeping.

A test that needs something to have happened in another process or thread (a row in the
catalog, a file on disk, a /healthz field, a lock held) polls for exactly that, with a
deadline that only matters when the test fails:

    wait_until(catalog.uploads_in_progress, what="the upload began")
    eventually(lambda: assert_nothing_stored(service, run))

Sleeping for a fixed time instead is either too short on a loaded machine (the test checks
something other than it means to) or too long everywhere else. Sleeps that stay in the tests
simulate time passing for the code under test (a slow link, a crash at some point of a
background job), and say so where they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["eventually", "poll", "wait_until"]

T = TypeVar("T")


def poll(condition: Callable[[], T], timeout: float, interval: float = 0.05) -> T:
    """``condition()``'s first truthy value, or its last (falsy) one once ``timeout`` s passed.

    ``condition`` is always called at least once, and once more at the deadline.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            return value
        time.sleep(min(interval, left))


def wait_until(
    condition: Callable[[], T], timeout: float = 20.0, what: str = "", interval: float = 0.05
) -> T:
    """Poll ``condition`` until it returns something truthy, and return that; fail the test
    (AssertionError naming ``what``) when it is still falsy after ``timeout`` seconds."""
    value = poll(condition, timeout, interval)
    assert value, f"not within {timeout} s: {what or getattr(condition, '__name__', condition)}"
    return value


def eventually(check: Callable[[], None], timeout: float = 5.0, interval: float = 0.1) -> None:
    """Retry ``check`` until it passes (raises no AssertionError); after ``timeout`` seconds
    its last AssertionError fails the test. For a state reached asynchronously: the service
    notices a hang-up, collects a failed upload, finishes a background pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(interval)
