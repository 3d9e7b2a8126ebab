"""Giving the memory that large requests freed back to the operating system.

glibc's malloc keeps what a thread frees in that thread's arena for reuse, and gives an
arena's pages back only from its top: after a burst of large saves or loads, a process
holds hundreds of megabytes it no longer uses (32 concurrent 40 MB saves: 260 MB resident
idle, 640 MB after, for good). ``malloc_trim(0)`` walks every arena and returns the pages
of its free chunks (``madvise(MADV_DONTNEED)``), in a few milliseconds with arenas locked.

:class:`MemoryTrimmer` does that from one daemon thread: every ``interval_s`` it asks the
allocator how much it holds free (``mallinfo2``: the free bytes of all arenas) and trims
when that is ``threshold`` bytes or more and the allocator's figures moved since the last
trim (a trim leaves freed chunks counted as free, so an idle process is trimmed once, not
every round). Where glibc is not the allocator (no ``malloc_trim``), the trimmer does
nothing; a glibc older than 2.33 (no ``mallinfo2``) is trimmed every round in which the
resident size (``/proc/self/statm``) is ``threshold`` above its lowest.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable

__all__ = ["MemoryTrimmer", "allocator_free_bytes", "malloc_trim", "resident_bytes"]

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MiB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return None if name is None else ctypes.CDLL(name)
    except OSError:
        return None


def _function(name: str) -> Callable[..., object] | None:
    libc = _libc()
    return getattr(libc, name, None) if libc is not None else None


_TRIM = _function("malloc_trim")  # glibc only (not musl, not macOS)
_INFO = _function("mallinfo2")  # glibc 2.33+
if _TRIM is not None:
    _TRIM.argtypes = [ctypes.c_size_t]  # type: ignore[attr-defined]
    _TRIM.restype = ctypes.c_int  # type: ignore[attr-defined]
if _INFO is not None:
    _INFO.argtypes = []  # type: ignore[attr-defined]
    _INFO.restype = _MallInfo2  # type: ignore[attr-defined]


def malloc_trim() -> bool:
    """Return the allocator's free pages to the OS; False where that is not available."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def allocator_free_bytes() -> tuple[int, int] | None:
    """``(free, in use)`` bytes of glibc's arenas (``mallinfo2``), or None without it."""
    if _INFO is None:
        return None
    info = _INFO()
    assert isinstance(info, _MallInfo2)
    return int(info.fordblks), int(info.uordblks)


def resident_bytes() -> int | None:
    """This process's resident set size, or None without ``/proc``."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class MemoryTrimmer:
    """Trims the allocator (``malloc_trim``) when it holds ``threshold`` bytes free (see
    the module's docstring). ``start()`` starts its thread (not when ``interval_s`` is 0 or
    trimming is not available); ``close()`` stops it."""

    def __init__(self, interval_s: float, threshold: int = 64 * _MiB) -> None:
        self.interval_s = interval_s
        self.threshold = threshold
        self.trims = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._after_trim: tuple[int, int] | None = None  # the figures the last trim left
        self._lowest = resident_bytes() or 0

    @property
    def available(self) -> bool:
        return _TRIM is not None and (_INFO is not None or resident_bytes() is not None)

    def start(self) -> MemoryTrimmer:
        if self.interval_s > 0 and self.available:
            self._thread = threading.Thread(target=self._loop, name="memory-trim", daemon=True)
            self._thread.start()
        return self

    def _due(self) -> bool:
        figures = allocator_free_bytes()
        if figures is not None:
            free, used = figures
            last = self._after_trim
            moved = last is None or abs(free - last[0]) + abs(used - last[1]) >= _MiB
            return free >= self.threshold and moved
        resident = resident_bytes()
        if resident is None:
            return False
        self._lowest = min(self._lowest, resident)
        return resident - self._lowest >= self.threshold

    def check(self) -> bool:
        """One round: trim if due; True if it trimmed."""
        if _TRIM is None or not self._due():
            return False
        before = resident_bytes()
        malloc_trim()
        self.trims += 1
        self._after_trim = allocator_free_bytes()
        after = resident_bytes()
        if before is not None and after is not None:
            log.debug("malloc_trim: %d -> %d MiB resident", before // _MiB, after // _MiB)
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # never let the trimmer take the service down
                log.exception("memory trim failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
